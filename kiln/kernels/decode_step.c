/* A whole decode step of a LLaMA-shaped decoder stack, one token for each of m sequences, in
 * one native call.
 *
 * Layer by layer from Python, a decode step pays ~15 Python calls and tensor allocations per
 * layer, which on a 135M-parameter model cost as much as the arithmetic. This runs the same
 * kernels (rmsnorm, AMX or skinny gemm, rotary, paged attention, silu_mul) in the same order with
 * the same roundings, so it agrees with the layer-by-layer path bit for bit; each layer is
 *
 *   x = rmsnorm(h); qkv = x Wqkv^T (+b); [per-head rmsnorm(q), rmsnorm(k)]; rotary(q, k);
 *   cache[slot] = k, v
 *   h = h + attention(q, cache; the layer's sliding window and attention sinks) Wo^T (+b)
 *   x = rmsnorm(h); gu = x Wfc^T (+b); h = h + (silu(gate) * up) Wproj^T (+b)
 *
 * or, in a layer with experts (bf16 models with weight-only quantized experts: Qwen3-MoE,
 * Mixtral, DeepSeek-V2), h = h + the chosen experts' weighted sum for x (router, softmax top-k
 * and the experts call of moe_experts.c, as kiln.layers.moe computes them), a shared expert's
 * output included; a latent attention layer (DeepSeek-V2's MLA) computes its attention block the
 * absorbed way (latent_attention) over a cache of one latent row per token.
 *
 * with the residual adds rounded to the model dtype as eager PyTorch does. Layouts: hidden
 * [m, hidden_size] (updated in place), the KV caches [num_blocks, kv_heads, block_size,
 * head_size] (token slot = block * block_size + offset), slots/token_index/seq_lens [m], block_tables [m, max_blocks], cos/sin
 * [m, rot_dim] float32, scratch of kiln_decode_step_scratch(dims, m) elements. A quantized KV
 * cache (dims kv_kind KILN_KV_INT8 or KILN_KV_FP8, each layer's kv_scales [K, V]) takes the
 * codes of k * (1 / k_scale) and v * (1 / v_scale) (dtypes.h, as kiln.step.attention.
 * quantize_kv writes them) and is read by the matching attention variant. With a `head` (else
 * NULL) the step goes on to the model's last norm and LM head and writes each token's first
 * `vocab` outputs, as float32, to logits [m, vocab] (rounded through the model dtype first, as
 * the PyTorch path's `lm_head(x).float()` is): a decode step then needs nothing else before
 * sampling. With `profile` (else NULL) the seconds spent in the linear layers (the LM head
 * included), in attention and in the rest are added to profile[0..2]. With `lora` (else NULL)
 * each token's LoRA adapter adds its deltas to the four linears' outputs, with the roundings of
 * kiln.layers.lora (see lora_apply).
 */

/* Adds the seconds `stmt` takes to profile[slot] when profiling. */
#define TIMED(slot, stmt)                                                                          \
    do {                                                                                           \
        const double started_ = profile ? omp_get_wtime() : 0.0;                                   \
        stmt;                                                                                      \
        if (profile) profile[slot] += omp_get_wtime() - started_;                                  \
    } while (0)
enum { LINEAR = 0, ATTENTION = 1, OTHER = 2 };
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"

/* A linear's weight, bias (or NULL) and, for bf16, its tile-packed copy (or NULL); a weight-only
 * quantized one (bits 8, 6 or 4) has tile-ordered codes as its weight, its scales and offsets (or
 * NULL) and its group size (0: int8 with float32 scales per output channel; quant_linear.c); an
 * FP8 one (fp8 set) e4m3 codes in tile order and float32 scales per column. AWQ's input multiplier `prequant` (float32 [k], or NULL) and a static FP8
 * activation scale `act_scale` (FP8, W4A8_AWQ; 0 for none) apply to the input first. A
 * SmoothQuant W8A8 one (w8a8 set): row-major int8 codes, float32 scales per column and the
 * smoothing multiplier `prequant` (w8a8_linear.c). */
typedef struct {
    const void *weight, *bias, *packed;
    int64_t bits, group;
    const void *scales, *offsets;  /* float32 [n] (FP8, int8 per channel), or float16 per group */
    const float *prequant;
    int64_t fp8;
    float act_scale;
    int64_t w8a8;  /* SmoothQuant: row-major int8 codes, scales per column, int8 activations per row */
} kiln_linear;

/* A mixture-of-experts block in place of the MLP (bf16 models): the router, a bf16 [E, hidden]
 * weight (and bias, or NULL) read by the skinny GEMM as kiln.layers.moe's ReplicatedLinear
 * reads it; kiln_moe_route's softmax top-k (normalized when `normalize`); the chosen experts of
 * `fc` (each expert's fused [fc | up] rows) and `proj` with activation `act` (KILN_ACT_*, with
 * alpha and limit) in one kiln_moe_experts_bf16 call. */
typedef struct {
    const void *router, *router_bias;
    int64_t num_experts, top_k, normalize;
    kiln_experts fc, proj;
    int64_t act;
    float alpha, limit;
    float scaling;                       /* the routing weights' factor (DeepSeek's routed_scaling_factor) */
    int64_t has_shared;                  /* a shared expert every token takes (un-gated), in the same call */
    kiln_experts shared_fc, shared_proj;
} kiln_moe_block;

/* Multi-head latent attention (DeepSeek-V2; kiln.layers.mla) in place of qkv and the KV cache's
 * K/V rows: q from q_b (q_proj) or q_b(rmsnorm(q_a x)) (q_a.weight or packed set), each head
 * `nope` dims then `rope`; kv_a's latent (kv_lora, normalized by kv_norm) and shared rotary key
 * (rope) are the token's cache row (k_cache [num_blocks, 1, block_size, kv_lora + rope]); the
 * absorbed decode scores q_nope keys[h]^T (keys [heads, kv_lora, nope]) and q_pe against the
 * rows and takes its values from the rows' latents times values[h]^T ([heads, v_head, kv_lora]).
 * eps: the q_a and kv_a norms' epsilon. */
typedef struct {
    kiln_linear q_a, q_b, kv_a;
    const void *q_a_norm, *kv_norm, *keys, *values;
    int64_t q_lora, kv_lora, nope, rope, v_head;
    float eps;
} kiln_latent_attention;

/* window: the layer's sliding attention window (0: none); kv_scales: float32 [K scale, V scale]
 * of a quantized cache (NULL for a float one); q_norm / k_norm: per-head RMSNorm weights [head_size]
 * applied to q and k before rotary (Qwen3; NULL: none); moe: the layer's experts, which then
 * replace fused_fc and proj (NULL: a dense MLP); mla: the layer's latent attention, which then
 * replaces qkv (dims head_size is its v_head; NULL: ordinary attention); sinks: gpt-oss's
 * attention sinks, float32 [heads] (NULL: none). */
typedef struct {
    const void *input_norm, *post_norm;
    kiln_linear qkv, dense, fused_fc, proj;
    void *k_cache, *v_cache;
    int64_t window;
    const float *kv_scales;
    const void *q_norm, *k_norm;
    const kiln_moe_block *moe;
    const kiln_latent_attention *mla;
    const float *sinks;
} kiln_decoder_layer;

/* kv_kind: the caches' element type (KILN_KV_FLOAT: the model dtype; KILN_KV_INT8, KILN_KV_FP8);
 * head_width: the LM head's outputs when the step computes logits (0: it does not); inter: the
 * widest dense MLP (0 when every layer has experts); qk_eps: the q/k norms' epsilon. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_size, rot_dim, inter, block_size, max_blocks;
    float eps, scale;
    int64_t kv_kind, head_width;
    float qk_eps;
} kiln_decoder_dims;

/* One LoRA module of one adapter inside one linear (e.g. attn_k inside the fused qkv): `a`
 * [rank, k] and `bt` [rank, width] (B transposed) float32 for output columns start .. start +
 * width - 1, and DoRA's magnitudes `scale` [width] (NULL: plain LoRA); `a` NULL: no module. */
typedef struct {
    const float *a, *bt, *scale;
    int64_t rank, start, width;
} kiln_lora_linear;

/* Module slots per linear: the fused qkv holds attn_qkv, attn_q, attn_k and attn_v. */
#define KILN_LORA_SLOTS 4

/* A step's adapters: adapters[i] points at adapter i's modules [num_layers][4][KILN_LORA_SLOTS]
 * (linears qkv, dense, fused_fc, proj); token_adapter[t] is token t's adapter (-1: none). */
typedef struct {
    const kiln_lora_linear *const *adapters;
    int64_t num_adapters;
    const int64_t *token_adapter;
    /* floats of scratch: m x (the widest linear input + the largest rank + the widest module) */
    int64_t work_size;
} kiln_lora_step;

/* The final RMSNorm (its own eps) and the LM head, whose first `vocab` outputs are the logits. */
typedef struct {
    const void *norm;
    float eps;
    kiln_linear linear;
    int64_t vocab;
} kiln_decoder_head;

int64_t kiln_decode_step_scratch(const kiln_decoder_dims *d, int64_t m) {
    const int64_t q = d->heads * d->head_size, kv = d->kv_heads * d->head_size;
    const int64_t layers = 2 * d->hidden + (q + 2 * kv) + q + 3 * d->inter;
    return m * (layers > d->hidden + d->head_width ? layers : d->hidden + d->head_width);
}

/* y [m, n] = x [m, k] W^T + b: the packed tile kernel whenever the weight is in tiles (an
 * engine's, or a packed copy; one row streams them as fast as the skinny GEMM streams a plain
 * weight), else the skinny GEMM (the same choice as kiln.layers.linear). */
static void linear_bf16(const bf16_t *x, const kiln_linear *L, bf16_t *y, int64_t m, int64_t n, int64_t k,
                        int num_threads) {
    if (L->w8a8) {
        kiln_w8a8_linear_bf16(x, L->weight, L->scales, L->prequant, L->bias, y, m, n, k, num_threads);
    } else if (L->fp8) {
        kiln_fp8_linear_bf16(x, L->weight, L->scales, L->act_scale, L->prequant, L->bias, y, m, n, k, num_threads);
    } else if (L->bits) {
        bf16_t *prepared = NULL;  /* the input after AWQ's multiply (and W4A8's FP8 rounding) */
        if (L->prequant || L->act_scale > 0.f) {
            prepared = malloc(sizeof(bf16_t) * m * k);
            kiln_prepare_quant_input(x, m, k, L->prequant, L->act_scale, prepared, num_threads);
        }
        kiln_quant_linear_bf16(prepared ? prepared : x, L->weight, L->scales, L->offsets, L->bits, L->group, L->bias,
                               y, m, n, k, num_threads);
        free(prepared);
    } else if (L->packed) kiln_packed_linear_bf16(x, L->packed, L->bias, y, m, n, k, num_threads);
    else kiln_skinny_gemm_bf16(x, L->weight, L->bias, y, m, n, k, num_threads);
}

static void linear_f32(const float *x, const kiln_linear *L, float *y, int64_t m, int64_t n, int64_t k,
                       int num_threads) {
    kiln_skinny_gemm_f32(x, L->weight, L->bias, y, m, n, k, num_threads);
}

/* y [m, n] (the linear's output for x [m, k], bias included) plus each token's LoRA deltas
 * d = B (A x) in float32 for linear `which` of layer `layer`, as kiln.layers.lora adds them:
 * rounded to the model dtype and added (plain LoRA), or, for DoRA, the module's columns
 * replaced by (y - bias + d) * scale + bias rounded once. Adapter by adapter over its tokens and
 * module by module, so each A and B is read once a step, B only over its module's columns (the
 * Python path's fused B is zero elsewhere), in blocks of columns summed in registers. A few
 * tokens' rank-r products are too small to share out: threads from LORA_PARALLEL_TOKENS. */
/* d [jn] = sum over r of bt[r * stride + j] * u[r] for j < jn (<= LORA_COLS): a block of a
 * module's output columns, summed in registers over the rank. */
#define LORA_COLS 64
#define LORA_PARALLEL_TOKENS 4
static inline void lora_columns(const float *bt, int64_t stride, int64_t rank, const float *u, int64_t jn,
                                float *d) {
    float acc[LORA_COLS] = {0.f};
    if (jn == LORA_COLS) {
        for (int64_t r = 0; r < rank; ++r) {
            const float *row = bt + r * stride, ur = u[r];
            _Pragma("omp simd")
            for (int64_t j = 0; j < LORA_COLS; ++j) acc[j] += row[j] * ur;
        }
    } else {
        for (int64_t r = 0; r < rank; ++r) {
            const float *row = bt + r * stride, ur = u[r];
            for (int64_t j = 0; j < jn; ++j) acc[j] += row[j] * ur;
        }
    }
    memcpy(d, acc, sizeof(float) * jn);
}

#define DEFINE_LORA_APPLY(SUFFIX, T, LOAD, STORE)                                                  \
static void lora_apply_##SUFFIX(const T *x, T *y, int64_t m, int64_t n, int64_t k, const T *bias,  \
                                const kiln_lora_step *lora, int64_t layer, int which,              \
                                float *work, int num_threads) {                                    \
    float *xf = work, *u = work + m * k;                                                           \
    int64_t rows[m];                                                                               \
    for (int64_t t = 0; t < m; ++t)                                                                \
        if (lora->token_adapter[t] >= 0)                                                           \
            for (int64_t i = 0; i < k; ++i) xf[t * k + i] = LOAD(x[t * k + i]);                    \
    for (int64_t s = 0; s < lora->num_adapters; ++s) {                                             \
        int64_t nt = 0;                                                                            \
        for (int64_t t = 0; t < m; ++t)                                                            \
            if (lora->token_adapter[t] == s) rows[nt++] = t;                                       \
        if (nt == 0) continue;                                                                     \
        const kiln_lora_linear *modules = lora->adapters[s] + (4 * layer + which) * KILN_LORA_SLOTS; \
        for (int slot = 0; slot < KILN_LORA_SLOTS; ++slot) {                                       \
            const kiln_lora_linear *e = modules + slot;                                            \
            if (!e->a) continue;                                                                   \
            const int64_t R = e->rank, W = e->width;                                               \
            const int64_t blocks = (W + LORA_COLS - 1) / LORA_COLS;                                \
            _Pragma("omp parallel num_threads(num_threads) if(nt >= LORA_PARALLEL_TOKENS)")         \
            {                                                                                      \
                _Pragma("omp for")                                                                 \
                for (int64_t r = 0; r < R; ++r) {                                                  \
                    const float *row = e->a + r * k;                                               \
                    for (int64_t i = 0; i < nt; ++i) {                                             \
                        const float *xr = xf + rows[i] * k;                                        \
                        float acc = 0.f;                                                           \
                        _Pragma("omp simd reduction(+:acc)")                                       \
                        for (int64_t c = 0; c < k; ++c) acc += row[c] * xr[c];                     \
                        u[i * R + r] = acc;                                                        \
                    }                                                                              \
                }                                                                                  \
                _Pragma("omp for")                                                                 \
                for (int64_t b = 0; b < blocks * nt; ++b) {                                        \
                    const int64_t i = b % nt, j0 = b / nt * LORA_COLS;                             \
                    const int64_t jn = W - j0 < LORA_COLS ? W - j0 : LORA_COLS;                    \
                    float di[LORA_COLS];                                                           \
                    lora_columns(e->bt + j0, W, R, u + i * R, jn, di);                             \
                    T *out = y + rows[i] * n + e->start + j0;                                      \
                    if (e->scale) {                                                                \
                        for (int64_t j = 0; j < jn; ++j) {                                         \
                            const float shift = bias ? LOAD(bias[e->start + j0 + j]) : 0.f;        \
                            out[j] = STORE((LOAD(out[j]) - shift + di[j]) * e->scale[j0 + j] + shift); \
                        }                                                                          \
                    } else {                                                                       \
                        for (int64_t j = 0; j < jn; ++j) out[j] = STORE(LOAD(out[j]) + LOAD(STORE(di[j]))); \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}
DEFINE_LORA_APPLY(f32, float, f32_load, f32_store)
DEFINE_LORA_APPLY(bf16, bf16_t, bf16_load, bf16_store)

/* out [m, hidden] = the experts block B for x [m, hidden], as kiln.layers.moe's MixtureOfExperts
 * computes it (same kernels, same roundings). 0, or KILN_STEP_EXPERTS_FAILED plus
 * kiln_moe_experts_bf16's code (2: no memory). */
#define KILN_STEP_EXPERTS_FAILED 100
static int moe_block_bf16(const bf16_t *x, const kiln_moe_block *B, bf16_t *out, int64_t m, int64_t hidden,
                          int num_threads) {
    const int64_t E = B->num_experts, K = B->top_k;
    bf16_t *logits = malloc(sizeof(bf16_t) * m * E);
    int64_t *ids = malloc(sizeof(int64_t) * m * K);
    float *weights = malloc(sizeof(float) * m * K);
    int rc = 2;
    if (logits && ids && weights) {
        kiln_skinny_gemm_bf16(x, B->router, B->router_bias, logits, m, E, hidden, num_threads);
        kiln_moe_route(logits, 1, m, E, K, B->normalize, ids, weights);
        if (B->scaling != 1.f)
            for (int64_t i = 0; i < m * K; ++i) weights[i] *= B->scaling;
        rc = kiln_moe_experts_bf16(x, m, K, ids, weights, E, &B->fc, &B->proj, B->has_shared ? &B->shared_fc : NULL,
                                   B->has_shared ? &B->shared_proj : NULL, NULL, B->act, B->alpha, B->limit, out,
                                   num_threads);
    }
    free(logits);
    free(ids);
    free(weights);
    return rc ? KILN_STEP_EXPERTS_FAILED + rc : 0;
}

/* Experts take bf16 only (their GEMV quantizes bf16 rows): kiln.models.native_decode gives an
 * fp32 model's step no experts block. */
static int moe_block_f32(const float *x, const kiln_moe_block *B, float *out, int64_t m, int64_t hidden,
                         int num_threads) {
    return KILN_STEP_EXPERTS_FAILED + 1;
}

/* One layer's decode attention over its cache, through the variant for the cache's type. */
#define ATTEND(FN, KT) FN(qkv, qkv_width, (const KT *)L->k_cache, (const KT *)L->v_cache, token_index,  \
                          block_tables, seq_lens, attn, m, d->heads, d->kv_heads, D, d->block_size,     \
                          d->max_blocks, d->scale, L->window, NULL, 0.f, L->sinks, k_scale, v_scale, \
                          num_threads)

#define DEFINE_DECODE_STEP(SUFFIX, T, LOAD, STORE)                                                 \
static void residual_add_##SUFFIX(T *h, const T *x, int64_t n) {                                 \
    _Pragma("omp simd")                                                                            \
    for (int64_t i = 0; i < n; ++i) h[i] = STORE(LOAD(h[i]) + LOAD(x[i]));                         \
}                                                                                                  \
                                                                                                   \
/* Qwen3's q/k norms: each head of q and k in qkv [m, width] normalized in place. */              \
static void qk_norm_##SUFFIX(T *qkv, int64_t width, const kiln_decoder_layer *L,                  \
                             const kiln_decoder_dims *d, int64_t m, int num_threads) {            \
    const int64_t D = d->head_size;                                                                \
    for (int64_t t = 0; t < m; ++t) {                                                              \
        T *q = qkv + t * width, *k = q + d->heads * D;                                             \
        kiln_rmsnorm_##SUFFIX(q, D, L->q_norm, q, d->heads, D, d->qk_eps, num_threads);            \
        kiln_rmsnorm_##SUFFIX(k, D, L->k_norm, k, d->kv_heads, D, d->qk_eps, num_threads);         \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* A latent attention layer's decode (kiln.layers.mla and kiln.step.latent_attention's absorbed  \
 * path, same kernels and roundings): x [m, hidden] to the heads' values out [m, heads * v_head], \
 * writing each token's cache row first. 0, 2 (no memory) or the attention kernel's code. */      \
static int latent_attention_##SUFFIX(const T *x, const kiln_decoder_layer *L, const kiln_decoder_dims *d, \
                                     const float *cos, const float *sin, const int64_t *slots,    \
                                     const int64_t *token_index, const int64_t *block_tables,     \
                                     const int64_t *seq_lens, T *out, int64_t m, int num_threads) { \
    const kiln_latent_attention *A = L->mla;                                                       \
    const int64_t heads = d->heads, qk = A->nope + A->rope, row = A->kv_lora + A->rope;            \
    const int has_q_a = A->q_a.weight || A->q_a.packed;                                            \
    T *q = malloc(sizeof(T) * m * (heads * qk + row + 2 * heads * row + (has_q_a ? A->q_lora : 0))); \
    if (!q) return 2;                                                                              \
    T *kv = q + m * heads * qk, *q_latent = kv + m * row, *o_latent = q_latent + m * heads * row;   \
    if (has_q_a) {                                                                                 \
        T *qa = o_latent + m * heads * row;                                                        \
        linear_##SUFFIX(x, &A->q_a, qa, m, A->q_lora, d->hidden, num_threads);                     \
        kiln_rmsnorm_##SUFFIX(qa, A->q_lora, A->q_a_norm, qa, m, A->q_lora, A->eps, num_threads);  \
        linear_##SUFFIX(qa, &A->q_b, q, m, heads * qk, A->q_lora, num_threads);                    \
    } else {                                                                                       \
        linear_##SUFFIX(x, &A->q_b, q, m, heads * qk, d->hidden, num_threads);                     \
    }                                                                                              \
    linear_##SUFFIX(x, &A->kv_a, kv, m, row, d->hidden, num_threads);                              \
    kiln_rotary_##SUFFIX(q + A->nope, heads * qk, cos, sin, m, heads, qk, A->rope, num_threads);  \
    kiln_rotary_##SUFFIX(kv + A->kv_lora, row, cos, sin, m, 1, row, A->rope, num_threads);        \
    for (int64_t t = 0; t < m; ++t) {                                                              \
        T *r = kv + t * row, *ql = q_latent + t * heads * row;                                     \
        kiln_rmsnorm_##SUFFIX(r, row, A->kv_norm, r, 1, A->kv_lora, A->eps, num_threads);          \
        memcpy((T *)L->k_cache + slots[t] * row, r, sizeof(T) * row);  /* one row a slot */        \
        for (int64_t h = 0; h < heads; ++h)  /* the query's rotary part as it is */                \
            memcpy(ql + h * row + A->kv_lora, q + t * heads * qk + h * qk + A->nope, sizeof(T) * A->rope); \
    }                                                                                              \
    kiln_head_gemm_##SUFFIX(q, heads * qk, qk, A->keys, q_latent, heads * row, row, heads, m, A->kv_lora, \
                            A->nope, num_threads);                                                 \
    const int rc = kiln_paged_decode_attention_##SUFFIX(                                           \
        q_latent, heads * row, L->k_cache, L->k_cache, token_index, block_tables, seq_lens, o_latent, m, heads, 1, \
        row, d->block_size, d->max_blocks, d->scale, 0, NULL, 0.f, NULL, 1.f, 1.f, num_threads);   \
    if (rc == 0)                                                                                   \
        kiln_head_gemm_##SUFFIX(o_latent, heads * row, row, A->values, out, heads * A->v_head, A->v_head, heads, \
                                m, A->v_head, A->kv_lora, num_threads);                           \
    free(q);                                                                                       \
    return rc;                                                                                     \
}                                                                                                  \
                                                                                                   \
/* One token's K or V, x [kv_heads, D], into cache slot `slot` (each head's row in its own run \
 * of the block): copied, or as codes of x * inv_scale. */                                         \
static void store_kv_##SUFFIX(const T *x, void *cache, int64_t slot, const kiln_decoder_dims *d,   \
                              int64_t kind, float inv_scale) {                                     \
    const int64_t D = d->head_size, bs = d->block_size;                                            \
    for (int64_t h = 0; h < d->kv_heads; ++h) {                                                    \
        const int64_t at = ((slot / bs * d->kv_heads + h) * bs + slot % bs) * D;                   \
        const T *row = x + h * D;                                                                  \
        if (kind == KILN_KV_FLOAT) memcpy((T *)cache + at, row, sizeof(T) * D);                    \
        else for (int64_t i = 0; i < D; ++i) kv_store(cache, at + i, LOAD(row[i]) * inv_scale, kind); \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
int kiln_decode_step_##SUFFIX(T *hidden, int64_t m, const kiln_decoder_layer *layers,             \
                              int64_t num_layers, const kiln_decoder_dims *d, const float *cos,   \
                              const float *sin, const int64_t *slots, const int64_t *token_index, \
                              const int64_t *block_tables, const int64_t *seq_lens, T *scratch,   \
                              const kiln_decoder_head *head, float *logits,                       \
                              const kiln_lora_step *lora, int num_threads, double *profile) {     \
    const int64_t H = d->hidden, D = d->head_size, I = d->inter;                                   \
    const int64_t q_size = d->heads * D, kv_size = d->kv_heads * D, qkv_width = q_size + 2 * kv_size; \
    T *normed = scratch, *qkv = normed + m * H, *attn = qkv + m * qkv_width, *out = attn + m * q_size; \
    T *gate_up = out + m * H, *act = gate_up + m * 2 * I;                                          \
    /* LoRA's float32 input row, rank products and deltas (lora->work_size floats). */             \
    float *work = lora ? malloc(sizeof(float) * lora->work_size) : NULL;                           \
    for (int64_t l = 0; l < num_layers; ++l) {                                                     \
        const kiln_decoder_layer *L = layers + l;                                                  \
        const float k_scale = L->kv_scales ? L->kv_scales[0] : 1.f;                                \
        const float v_scale = L->kv_scales ? L->kv_scales[1] : 1.f;                                \
        TIMED(OTHER, kiln_rmsnorm_##SUFFIX(hidden, H, L->input_norm, normed, m, H, d->eps, num_threads)); \
        int rc = 0;                                                                                \
        if (L->mla) {                                                                              \
            TIMED(ATTENTION, rc = latent_attention_##SUFFIX(normed, L, d, cos, sin, slots, token_index, \
                                                            block_tables, seq_lens, attn, m, num_threads)); \
        } else {                                                                                   \
            TIMED(LINEAR, linear_##SUFFIX(normed, &L->qkv, qkv, m, qkv_width, H, num_threads));    \
            if (lora) TIMED(LINEAR, lora_apply_##SUFFIX(normed, qkv, m, qkv_width, H,              \
                                                        L->qkv.bias, lora, l, 0, work, num_threads)); \
            if (L->q_norm) TIMED(OTHER, qk_norm_##SUFFIX(qkv, qkv_width, L, d, m, num_threads));   \
            TIMED(OTHER, {                                                                         \
                if (d->rot_dim > 0) {                                                              \
                    kiln_rotary_##SUFFIX(qkv, qkv_width, cos, sin, m, d->heads, D, d->rot_dim, num_threads); \
                    kiln_rotary_##SUFFIX(qkv + q_size, qkv_width, cos, sin, m, d->kv_heads, D, d->rot_dim, \
                                         num_threads);                                             \
                }                                                                                  \
                for (int64_t t = 0; t < m; ++t) {                                                  \
                    const T *row = qkv + t * qkv_width + q_size;                                   \
                    store_kv_##SUFFIX(row, L->k_cache, slots[t], d, d->kv_kind, 1.f / k_scale);    \
                    store_kv_##SUFFIX(row + kv_size, L->v_cache, slots[t], d, d->kv_kind, 1.f / v_scale); \
                }                                                                                  \
            });                                                                                    \
            TIMED(ATTENTION, rc = d->kv_kind == KILN_KV_INT8                                       \
                                      ? ATTEND(kiln_paged_decode_attention_##SUFFIX##_i8, int8_t)  \
                                  : d->kv_kind == KILN_KV_FP8                                      \
                                      ? ATTEND(kiln_paged_decode_attention_##SUFFIX##_f8, fp8_t)   \
                                      : ATTEND(kiln_paged_decode_attention_##SUFFIX, T));          \
        }                                                                                          \
        if (rc != 0) { free(work); return rc; }                                                    \
        TIMED(LINEAR, linear_##SUFFIX(attn, &L->dense, out, m, H, q_size, num_threads));            \
        if (lora) TIMED(LINEAR, lora_apply_##SUFFIX(attn, out, m, H, q_size,                       \
                                                    L->dense.bias, lora, l, 1, work, num_threads));\
        TIMED(OTHER, {                                                                             \
            residual_add_##SUFFIX(hidden, out, m * H);                                             \
            kiln_rmsnorm_##SUFFIX(hidden, H, L->post_norm, normed, m, H, d->eps, num_threads);      \
        });                                                                                        \
        if (L->moe) {  /* expert linears hold no LoRA modules */                                   \
            TIMED(LINEAR, rc = moe_block_##SUFFIX(normed, L->moe, out, m, H, num_threads));        \
            if (rc != 0) { free(work); return rc; }                                                \
        } else {                                                                                   \
            TIMED(LINEAR, linear_##SUFFIX(normed, &L->fused_fc, gate_up, m, 2 * I, H, num_threads)); \
            if (lora) TIMED(LINEAR, lora_apply_##SUFFIX(normed, gate_up, m, 2 * I, H,              \
                                                        L->fused_fc.bias, lora, l, 2, work, num_threads)); \
            TIMED(OTHER, kiln_silu_mul_##SUFFIX(gate_up, 2 * I, act, m, I, num_threads));          \
            TIMED(LINEAR, linear_##SUFFIX(act, &L->proj, out, m, H, I, num_threads));               \
            if (lora) TIMED(LINEAR, lora_apply_##SUFFIX(act, out, m, H, I,                         \
                                                        L->proj.bias, lora, l, 3, work, num_threads)); \
        }                                                                                          \
        TIMED(OTHER, residual_add_##SUFFIX(hidden, out, m * H));                                   \
    }                                                                                              \
    if (head) {                                                                                    \
        const int64_t W = d->head_width;                                                           \
        T *head_out = normed + m * H;                                                              \
        TIMED(OTHER, kiln_rmsnorm_##SUFFIX(hidden, H, head->norm, normed, m, H, head->eps, num_threads)); \
        TIMED(LINEAR, linear_##SUFFIX(normed, &head->linear, head_out, m, W, H, num_threads));    \
        for (int64_t t = 0; t < m; ++t)                                                            \
            for (int64_t c = 0; c < head->vocab; ++c) logits[t * head->vocab + c] = LOAD(head_out[t * W + c]); \
    }                                                                                              \
    free(work);                                                                                    \
    return 0;                                                                                      \
}

DEFINE_DECODE_STEP(f32, float, f32_load, f32_store)
DEFINE_DECODE_STEP(bf16, bf16_t, bf16_load, bf16_store)
