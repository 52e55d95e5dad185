/* A whole decode step of a LLaMA-shaped decoder stack for one token, in one native call.
 *
 * Layer by layer from Python, batch-1 decode pays ~15 Python calls and tensor allocations
 * per layer, which on a 135M-parameter model cost a third as much as the arithmetic. This
 * runs the same kernels (rmsnorm, gemv, rotary, paged attention, silu_mul) in the same
 * order with the same roundings, so it agrees with the layer-by-layer path bit for bit;
 * each layer is
 *
 *   x = rmsnorm(h); qkv = x Wqkv^T (+b); rotary(q, k); cache[slot] = k, v
 *   h = h + attention(q, cache) Wo^T (+b)
 *   x = rmsnorm(h); gu = x Wfc^T (+b); h = h + (silu(gate) * up) Wproj^T (+b)
 *
 * with the residual adds rounded to the model dtype as eager PyTorch does. Layouts: hidden
 * [hidden_size] (updated in place), the KV caches [num_blocks, block_size, kv_heads, head_size],
 * block_table [max_blocks], cos/sin [rot_dim] float32, scratch of decode_step_scratch() elements.
 */
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"

typedef struct {
    const void *input_norm, *qkv, *qkv_bias, *dense, *dense_bias;
    const void *post_norm, *fused_fc, *fused_fc_bias, *proj, *proj_bias;
    void *k_cache, *v_cache;
} kiln_decoder_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_size, rot_dim, inter, block_size, max_blocks;
    float eps, scale;
} kiln_decoder_dims;

int64_t kiln_decode_step_scratch(const kiln_decoder_dims *d) {
    const int64_t q = d->heads * d->head_size, kv = d->kv_heads * d->head_size;
    return 2 * d->hidden + (q + 2 * kv) + q + 3 * d->inter;
}

#define DEFINE_DECODE_STEP(SUFFIX, T, LOAD, STORE)                                                 \
static void residual_add_##SUFFIX(T *h, const T *x, int64_t n) {                                 \
    _Pragma("omp simd")                                                                            \
    for (int64_t i = 0; i < n; ++i) h[i] = STORE(LOAD(h[i]) + LOAD(x[i]));                         \
}                                                                                                  \
                                                                                                   \
int kiln_decode_step_##SUFFIX(T *hidden, const kiln_decoder_layer *layers, int64_t num_layers,     \
                              const kiln_decoder_dims *d, const float *cos, const float *sin,      \
                              int64_t slot, const int64_t *block_table, int64_t seq_len,           \
                              T *scratch, int num_threads) {                                       \
    const int64_t H = d->hidden, D = d->head_size, q_size = d->heads * D, kv_size = d->kv_heads * D; \
    const int64_t qkv_width = q_size + 2 * kv_size, zero = 0;                                      \
    T *normed = scratch, *qkv = normed + H, *attn = qkv + qkv_width, *out = attn + q_size;        \
    T *gate_up = out + H, *act = gate_up + 2 * d->inter;                                           \
    for (int64_t l = 0; l < num_layers; ++l) {                                                     \
        const kiln_decoder_layer *L = layers + l;                                                  \
        T *k_cache = L->k_cache, *v_cache = L->v_cache;                                            \
        kiln_rmsnorm_##SUFFIX(hidden, H, L->input_norm, normed, 1, H, d->eps, num_threads);         \
        kiln_gemv_##SUFFIX(normed, L->qkv, L->qkv_bias, qkv, qkv_width, H, num_threads);           \
        if (d->rot_dim > 0) {                                                                      \
            kiln_rotary_##SUFFIX(qkv, qkv_width, cos, sin, 1, d->heads, D, d->rot_dim, num_threads);  \
            kiln_rotary_##SUFFIX(qkv + q_size, qkv_width, cos, sin, 1, d->kv_heads, D, d->rot_dim,   \
                                 num_threads);                                                     \
        }                                                                                          \
        memcpy(k_cache + slot * kv_size, qkv + q_size, sizeof(T) * kv_size);                      \
        memcpy(v_cache + slot * kv_size, qkv + q_size + kv_size, sizeof(T) * kv_size);            \
        const int rc = kiln_paged_decode_attention_##SUFFIX(                                       \
            qkv, qkv_width, k_cache, v_cache, &zero, block_table, &seq_len, attn, 1, d->heads,      \
            d->kv_heads, D, d->block_size, d->max_blocks, d->scale, num_threads);                  \
        if (rc != 0) return rc;                                                                    \
        kiln_gemv_##SUFFIX(attn, L->dense, L->dense_bias, out, H, q_size, num_threads);            \
        residual_add_##SUFFIX(hidden, out, H);                                                     \
        kiln_rmsnorm_##SUFFIX(hidden, H, L->post_norm, normed, 1, H, d->eps, num_threads);          \
        kiln_gemv_##SUFFIX(normed, L->fused_fc, L->fused_fc_bias, gate_up, 2 * d->inter, H, num_threads); \
        kiln_silu_mul_##SUFFIX(gate_up, 2 * d->inter, act, 1, d->inter, num_threads);              \
        kiln_gemv_##SUFFIX(act, L->proj, L->proj_bias, out, H, d->inter, num_threads);             \
        residual_add_##SUFFIX(hidden, out, H);                                                     \
    }                                                                                              \
    return 0;                                                                                      \
}

DEFINE_DECODE_STEP(f32, float, f32_load, f32_store)
DEFINE_DECODE_STEP(bf16, bf16_t, bf16_load, bf16_store)
