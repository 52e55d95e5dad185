/* The routed experts of a mixture-of-experts block for a few tokens (decode steps), in one call:
 *
 *   out[t] = sum over t's chosen experts e of  weight[t][e] * (act(x[t] Wfc_e^T + bfc_e) Wproj_e^T + bproj_e)
 *
 * with weight-only quantized experts in quant_linear.c's engine layout, stacked expert-major
 * (expert e's codes, scales and offsets at a fixed stride from expert 0's). From Python each
 * chosen expert cost an index_select, two kernel calls, a multiply and an index_add: on
 * Qwen3-30B-A3B's shape (48 layers, 8 experts a token) ~56 ms of a 134 ms step, beside 78 ms of
 * GEMVs. Here the (token, expert) pairs are grouped by expert, x is quantized once for the GEMV
 * (quant_gemv.h), and the threads split every chosen expert's panels between them at once (a
 * thread's share runs across experts), so a step reads each chosen expert's bytes once, in long
 * streams, whatever the number of experts.
 *
 * The activation (act): KILN_ACT_SILU, silu(fc) * up over the fused [fc | up] outputs;
 * KILN_ACT_CLAMPED_SWIGLU, gpt-oss's g = min(fc, limit), u = clamp(up, -limit, limit),
 * (u + 1) * g * sigmoid(alpha * g). Sums are float32 throughout; the activation is rounded to
 * bf16 (the down projection's input) and each token's weighted sum once, at the end. An expert
 * chosen by more than KILN_QUANT_GEMV_MAX_ROWS tokens runs on dequantized tiles (with its own
 * threads), as a linear of that many rows would. Otherwise a token's result does not depend on
 * the other tokens of the call (the GEMV's rows are independent, a token's experts are summed in
 * its router's order): a batch of decode steps equals its tokens one at a time.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"
#include "quant_gemv.h"

/* Routing (kiln.layers.moe's MixtureOfExperts.route, one call instead of four tensor ops a
 * layer): per row of router logits [m, E] (bf16 when is_bf16, else float32), the softmax over
 * all E in float32, the top_k largest (the lower index first among equals) into ids [m, top_k]
 * and their probabilities into weights, divided by their sum when normalize. */
void kiln_moe_route(const void *logits, int64_t is_bf16, int64_t m, int64_t E, int64_t top_k, int64_t normalize,
                    int64_t *ids, float *weights) {
    float probs[E];
    for (int64_t t = 0; t < m; ++t) {
        float top = -INFINITY, sum = 0.f;
        for (int64_t e = 0; e < E; ++e) {
            probs[e] = is_bf16 ? bf16_load(((const bf16_t *)logits)[t * E + e]) : ((const float *)logits)[t * E + e];
            top = fmaxf(top, probs[e]);
        }
        for (int64_t e = 0; e < E; ++e) sum += probs[e] = expf(probs[e] - top);
        float chosen = 0.f;
        for (int64_t j = 0; j < top_k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
            ids[t * top_k + j] = best;
            weights[t * top_k + j] = probs[best] / sum;
            chosen += weights[t * top_k + j];
            probs[best] = -1.f;  /* taken */
        }
        if (normalize)
            for (int64_t j = 0; j < top_k; ++j) weights[t * top_k + j] /= chosen;
    }
}

int kiln_moe_experts_supported(void) {
#ifdef KILN_HAVE_QUANT_GEMV
    return 1;
#else
    return 0;
#endif
}

#ifdef KILN_HAVE_QUANT_GEMV
static kiln_qweight expert_weight(const kiln_experts *E, int64_t e) {
    const void *scales = E->scales + e * E->scales_stride;
    const kiln_qweight W = {E->codes + e * E->codes_stride, E->group ? NULL : scales,
                            E->group ? scales : NULL,
                            E->group && E->offsets ? (const uint16_t *)(E->offsets + e * E->offsets_stride) : NULL,
                            E->n, E->k, E->group ? E->group : E->k, E->bits & 0xff,
                            (E->bits & KILN_CODES_E2M1) != 0, E->group && (E->bits & KILN_SCALES_SUPER) != 0};
    return W;
}

/* y[p] = x[p] W_e^T + b_e (float32 [pairs, n]) for the experts taking few rows (experts[a], whose
 * pairs are begin[a] .. begin[a + 1] - 1 of the prepared input; a in few[0 .. count - 1]): the
 * calling team splits all (expert, unit) pairs evenly. */
static void experts_gemv(const kiln_experts *E, const kiln_gemv_input *in, const int64_t *experts,
                         const int64_t *begin, const int64_t *few, int64_t count, float *y) {
    const kiln_qweight first = expert_weight(E, experts[0]);
    const int64_t blocks = E->n / 16, unit = kiln_quant_gemv_unit(&first);
    const int64_t units = (blocks + unit - 1) / unit, total = units * count;
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    float tile[4 * 64];
    for (int64_t u = total * me / threads; u < total * (me + 1) / threads; ++u) {
        const int64_t a = few[u / units], e = experts[a], nb0 = (u % units) * unit;
        const int nb = (int)(blocks - nb0 < unit ? blocks - nb0 : unit);
        const kiln_qweight W = expert_weight(E, e);
        for (int64_t t0 = begin[a]; t0 < begin[a + 1]; t0 += 4) {
            const int mt = begin[a + 1] - t0 < 4 ? (int)(begin[a + 1] - t0) : 4;
            kiln_quant_gemv_tile(&W, in, t0, mt, nb0, nb, tile);
            for (int t = 0; t < mt; ++t)
                for (int c = 0; c < 16 * nb; ++c) {
                    const int64_t col = nb0 * 16 + c;
                    y[(t0 + t) * E->n + col] = tile[t * 64 + c] + (E->bias ? bf16_load(E->bias[e * E->n + col]) : 0.f);
                }
        }
    }
}

/* The same for an expert taking many rows (x [rows, k] bf16, y [rows, n] float32): dequantized
 * tiles through kiln_quant_linear_bf16, with its own threads; tmp holds rows x n bf16. */
static void expert_tiles(const kiln_experts *E, int64_t e, const bf16_t *x, int64_t rows, bf16_t *tmp, float *y,
                         int num_threads) {
    const kiln_qweight W = expert_weight(E, e);
    kiln_quant_linear_bf16(x, W.codes, E->group ? (const void *)W.scales : (const void *)W.channel_scales,
                           W.offsets, E->bits, E->group, E->bias ? E->bias + e * E->n : NULL, tmp, rows, E->n, E->k,
                           num_threads);
    for (int64_t i = 0; i < rows * E->n; ++i) y[i] = bf16_load(tmp[i]);
}

/* h[p] = act(gu[p]) rounded to bf16, gu [pairs, 2 * inter] holding fc then up. */
static void activate(const float *gu, bf16_t *h, int64_t pairs, int64_t inter, int64_t act, float alpha,
                     float limit) {
    _Pragma("omp for schedule(static)")
    for (int64_t p = 0; p < pairs; ++p) {
        const float *g = gu + p * 2 * inter, *u = g + inter;
        bf16_t *o = h + p * inter;
        if (act == KILN_ACT_SILU) {
            _Pragma("omp simd")
            for (int64_t i = 0; i < inter; ++i) o[i] = bf16_store(g[i] / (1.f + expf(-g[i])) * u[i]);
        } else {
            _Pragma("omp simd")
            for (int64_t i = 0; i < inter; ++i) {
                const float gc = fminf(g[i], limit), uc = fminf(fmaxf(u[i], -limit), limit);
                o[i] = bf16_store((uc + 1.f) * (gc / (1.f + expf(-alpha * gc))));
            }
        }
    }
}

/* x [m, hidden] bf16; ids [m, top_k] int64 expert indices (< num_experts), weights [m, top_k]
 * float32; fc: the fused [fc | up] projection (n = 2 * inter, k = hidden); proj (n = hidden, k =
 * inter); out [m, hidden] bf16. An expert taking more than KILN_QUANT_GEMV_MAX_ROWS rows runs on
 * dequantized tiles, as a linear of that many rows does. shared_fc / shared_proj (one expert each,
 * an intermediate size of their own; or NULL, and always NULL past KILN_QUANT_GEMV_MAX_ROWS rows):
 * a shared expert every token takes, times shared_weights[t] (float32 [m], or NULL for 1), its
 * GEMVs in the same parallel regions as the routed experts' and added to each token's float32
 * sum after them (a separate pair of linears had cost DeepSeek-V2-Lite ~8 ms a step in two more
 * thread wake-ups, input preparations and PyTorch ops per layer). Returns 0; 1 without the
 * integer GEMV (kiln_moe_experts_supported), 2 out of memory, 3 an expert index out of range, 4
 * a shared expert with too many rows. */
int kiln_moe_experts_bf16(const bf16_t *x, int64_t m, int64_t top_k, const int64_t *ids, const float *weights,
                          int64_t num_experts, const kiln_experts *fc, const kiln_experts *proj,
                          const kiln_experts *shared_fc, const kiln_experts *shared_proj, const float *shared_weights,
                          int64_t act, float alpha, float limit, bf16_t *out, int num_threads) {
    const int64_t pairs = m * top_k, hidden = proj->n, inter = proj->k;
    const int64_t shared_inter = shared_proj ? shared_proj->k : 0;
    for (int64_t p = 0; p < pairs; ++p)
        if (ids[p] < 0 || ids[p] >= num_experts) return 3;
    if (shared_fc && m > KILN_QUANT_GEMV_MAX_ROWS) return 4;
    /* Pairs sorted by expert (a counting sort): slot[p] is pair p's row in expert order. */
    int64_t *count = calloc(num_experts + 1, sizeof *count);
    int64_t *slot = malloc(sizeof *slot * (pairs * 4 + 2)), *experts = slot + pairs, *begin = experts + pairs;
    int64_t *few = begin + pairs + 1;
    const int64_t widest = 2 * inter > hidden ? 2 * inter : hidden;
    bf16_t *xs = malloc(sizeof *xs * pairs * (hidden + inter + widest));
    float *gu = malloc(sizeof *gu * (pairs * (2 * inter + hidden) + m * (3 * shared_inter + hidden)));
    if (!count || !slot || !xs || !gu) {
        free(count), free(slot), free(xs), free(gu);
        return 2;
    }
    bf16_t *h = xs + pairs * hidden, *tmp = h + pairs * inter;
    float *y = gu + pairs * 2 * inter;
    /* the shared expert's [fc | up] outputs, activation (bf16, in the float buffer's room) and output */
    float *shared_gu = y + pairs * hidden, *shared_y = shared_gu + m * 2 * shared_inter;
    bf16_t *shared_h = (bf16_t *)(shared_y + m * hidden);
    const int64_t one_expert[1] = {0}, all_rows[2] = {0, m};
    for (int64_t p = 0; p < pairs; ++p) ++count[ids[p] + 1];
    int64_t active = 0, num_few = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
        if (count[e + 1]) {
            if (count[e + 1] <= KILN_QUANT_GEMV_MAX_ROWS) few[num_few++] = active;
            experts[active] = e;
            begin[active++] = count[e];
        }
        count[e + 1] += count[e];
    }
    begin[active] = pairs;
    for (int64_t p = 0; p < pairs; ++p) {
        slot[p] = count[ids[p]]++;  /* count[e]: expert e's next row */
        memcpy(xs + slot[p] * hidden, x + p / top_k * hidden, sizeof *xs * hidden);
    }
    for (int64_t a = 0; a < active; ++a) {  /* experts of many rows, each on all threads */
        if (begin[a + 1] - begin[a] <= KILN_QUANT_GEMV_MAX_ROWS) continue;
        expert_tiles(fc, experts[a], xs + begin[a] * hidden, begin[a + 1] - begin[a], tmp, gu + begin[a] * 2 * inter,
                     num_threads);
    }
    kiln_gemv_input fc_in, proj_in, shared_fc_in, shared_proj_in;
    void *fc_mem = NULL, *proj_mem = NULL, *shared_fc_mem = NULL, *shared_proj_mem = NULL;
    int failed = 0;
    if (num_few) {  /* any expert's weight tells the GEMV the input's format */
        const kiln_qweight W = expert_weight(fc, experts[0]);
        fc_mem = kiln_quant_gemv_prepare(xs, &W, pairs, &fc_in);
        failed = fc_mem == NULL;
    }
    if (shared_fc && !failed) {
        const kiln_qweight W = expert_weight(shared_fc, 0);
        shared_fc_mem = kiln_quant_gemv_prepare(x, &W, m, &shared_fc_in);
        failed = shared_fc_mem == NULL;
    }
    /* Each GEMV splits its own units between the threads, with no barrier between the routed
     * and the shared experts' calls: a thread runs its share of one, then of the other. */
    _Pragma("omp parallel num_threads(num_threads)")
    if (!failed) {
        if (num_few) experts_gemv(fc, &fc_in, experts, begin, few, num_few, gu);
        if (shared_fc) experts_gemv(shared_fc, &shared_fc_in, one_expert, all_rows, one_expert, 1, shared_gu);
        _Pragma("omp barrier")
        if (shared_fc) activate(shared_gu, shared_h, m, shared_inter, act, alpha, limit);
        activate(gu, h, pairs, inter, act, alpha, limit);  /* ends in the omp for's barrier */
        _Pragma("omp single")
        {
            if (num_few) {
                const kiln_qweight W = expert_weight(proj, experts[0]);
                proj_mem = kiln_quant_gemv_prepare(h, &W, pairs, &proj_in);
                failed = proj_mem == NULL;
            }
            if (shared_fc && !failed) {
                const kiln_qweight W = expert_weight(shared_proj, 0);
                shared_proj_mem = kiln_quant_gemv_prepare(shared_h, &W, m, &shared_proj_in);
                failed = shared_proj_mem == NULL;
            }
        }
        if (!failed && num_few) experts_gemv(proj, &proj_in, experts, begin, few, num_few, y);
        if (!failed && shared_fc)
            experts_gemv(shared_proj, &shared_proj_in, one_expert, all_rows, one_expert, 1, shared_y);
    }
    for (int64_t a = 0; a < active && !failed; ++a) {
        if (begin[a + 1] - begin[a] <= KILN_QUANT_GEMV_MAX_ROWS) continue;
        expert_tiles(proj, experts[a], h + begin[a] * inter, begin[a + 1] - begin[a], tmp, y + begin[a] * hidden,
                     num_threads);
    }
    if (!failed) {
        /* out[t] = its pairs' weighted sum in the order the router ranked them: a token's result
         * does not depend on the other tokens of the call */
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
        for (int64_t t = 0; t < m; ++t)
            for (int64_t c0 = 0; c0 < hidden; c0 += 256) {
                const int64_t width = hidden - c0 < 256 ? hidden - c0 : 256;
                float acc[256] = {0};
                for (int64_t j = 0; j < top_k; ++j) {
                    const float w = weights[t * top_k + j], *ys = y + slot[t * top_k + j] * hidden + c0;
                    _Pragma("omp simd")
                    for (int64_t c = 0; c < width; ++c) acc[c] += w * ys[c];
                }
                if (shared_fc) {
                    const float w = shared_weights ? shared_weights[t] : 1.f, *ys = shared_y + t * hidden + c0;
                    _Pragma("omp simd")
                    for (int64_t c = 0; c < width; ++c) acc[c] += w * ys[c];
                }
                for (int64_t c = 0; c < width; ++c) out[t * hidden + c0 + c] = bf16_store(acc[c]);
            }
    }
    free(fc_mem), free(proj_mem), free(shared_fc_mem), free(shared_proj_mem), free(count), free(slot), free(xs);
    free(gu);
    return failed ? 2 : 0;
}
#else
int kiln_moe_experts_bf16(const bf16_t *x, int64_t m, int64_t top_k, const int64_t *ids, const float *weights,
                          int64_t num_experts, const kiln_experts *fc, const kiln_experts *proj,
                          const kiln_experts *shared_fc, const kiln_experts *shared_proj, const float *shared_weights,
                          int64_t act, float alpha, float limit, bf16_t *out, int num_threads) {
    return 1;
}
#endif
