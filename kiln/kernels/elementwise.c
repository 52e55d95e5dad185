/* Per-layer elementwise work fused into one pass each: RMSNorm, SiLU(gate) * up, and rotary.
 *
 * Each is a handful of PyTorch ops in eager mode (RMSNorm in bf16: upcast, norm, downcast,
 * scale), and at decode time the dispatch of those small ops costs more than their
 * arithmetic. Rounding follows the eager reference: values are computed in fp32 and stored
 * in the tensor's dtype; bf16 RMSNorm rounds the normalised value before scaling (as Hugging
 * Face does). Rows may be strided (views into a fused projection); the last dim is contiguous.
 * Rows are split over threads only when there are 16 or more (waking a thread costs more
 * than a decode step's few rows).
 */
#include <math.h>
#include <stdint.h>

#include "dtypes.h"
#include "kernels.h"
static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) { return bf16_load(bf16_store(x)); }

#define DEFINE_ELEMENTWISE(SUFFIX, T, LOAD, STORE, ROUND)                                          \
/* out[r] = rmsnorm(x[r]) * weight */                                                              \
void kiln_rmsnorm_##SUFFIX(const T *x, int64_t x_stride, const T *weight, T *out, int64_t rows,    \
                          int64_t dim, float eps, int num_threads) {                               \
    _Pragma("omp parallel for if(rows >= 16) num_threads(num_threads)")                                   \
    for (int64_t r = 0; r < rows; ++r) {                                                           \
        const T *xr = x + r * x_stride;                                                            \
        float sq = 0.f;                                                                            \
        _Pragma("omp simd reduction(+:sq)")                                                        \
        for (int64_t i = 0; i < dim; ++i) { const float v = LOAD(xr[i]); sq += v * v; }            \
        const float inv = 1.f / sqrtf(sq / (float)dim + eps);                                      \
        T *o = out + r * dim;                                                                      \
        _Pragma("omp simd")                                                                        \
        for (int64_t i = 0; i < dim; ++i) o[i] = STORE(ROUND(LOAD(xr[i]) * inv) * LOAD(weight[i])); \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* out[r] = silu(gu[r, :inter]) * gu[r, inter:] */                                                 \
void kiln_silu_mul_##SUFFIX(const T *gu, int64_t gu_stride, T *out, int64_t rows, int64_t inter,   \
                           int num_threads) {                                                      \
    _Pragma("omp parallel for if(rows >= 16) num_threads(num_threads)")                                   \
    for (int64_t r = 0; r < rows; ++r) {                                                           \
        const T *g = gu + r * gu_stride, *u = g + inter;                                           \
        T *o = out + r * inter;                                                                    \
        _Pragma("omp simd")                                                                        \
        for (int64_t i = 0; i < inter; ++i) {                                                      \
            const float a = LOAD(g[i]);                                                            \
            o[i] = STORE(ROUND(a / (1.f + expf(-a))) * LOAD(u[i]));                                \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* In place on x [tokens, heads, head_size] (token stride given, heads contiguous): the first  \
 * rot_dim dims of every head rotate by cos/sin [tokens, rot_dim] (their two halves repeat),   \
 * pairing dim i with i + rot_dim / 2 (Hugging Face's rotate_half). */                            \
void kiln_rotary_##SUFFIX(T *x, int64_t token_stride, const float *cos, const float *sin,           \
                         int64_t tokens, int64_t heads, int64_t head_size, int64_t rot_dim,       \
                         int num_threads) {                                                        \
    const int64_t half = rot_dim / 2;                                                              \
    _Pragma("omp parallel for if(tokens >= 16) num_threads(num_threads)")                                 \
    for (int64_t t = 0; t < tokens; ++t) {                                                         \
        const float *c = cos + t * rot_dim, *s = sin + t * rot_dim;                                \
        for (int64_t h = 0; h < heads; ++h) {                                                      \
            T *v = x + t * token_stride + h * head_size;                                           \
            _Pragma("omp simd")                                                                    \
            for (int64_t i = 0; i < half; ++i) {                                                   \
                const float a = LOAD(v[i]), b = LOAD(v[i + half]);                                 \
                v[i] = STORE(a * c[i] - b * s[i]);                                                 \
                v[i + half] = STORE(b * c[i + half] + a * s[i + half]);                            \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_ELEMENTWISE(f32, float, f32_load, f32_store, f32_round)
DEFINE_ELEMENTWISE(bf16, bf16_t, bf16_load, bf16_store, bf16_round)

/* out[r] = the index of row r's largest value: the first on ties, or the first NaN if the row
 * has any (torch.argmax's answers); greedy decoding's pick. NaNs are found by their bits, which
 * -ffast-math's float comparisons could not be trusted to see. The second pass looks for the
 * value 64 at a time, a vector compare each. */
static inline uint32_t abs_bits(float x) {
    union { float f; uint32_t u; } v = {x};
    return v.u & 0x7fffffffu;
}

static int64_t first_match(const float *x, int64_t n, float value, int nan) {
    for (int64_t c0 = 0; c0 < n; c0 += 64) {
        const int64_t c1 = c0 + 64 < n ? c0 + 64 : n;
        int hit = 0;
        if (nan) {
            _Pragma("omp simd reduction(|:hit)")
            for (int64_t i = c0; i < c1; ++i) hit |= abs_bits(x[i]) > 0x7f800000u;
        } else {
            _Pragma("omp simd reduction(|:hit)")
            for (int64_t i = c0; i < c1; ++i) hit |= x[i] == value;
        }
        if (hit)
            for (int64_t i = c0; i < c1; ++i)
                if (nan ? abs_bits(x[i]) > 0x7f800000u : x[i] == value) return i;
    }
    return 0;  /* a row of -inf: its first */
}

void kiln_argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
    _Pragma("omp parallel for if(rows >= 16) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        float best = -INFINITY;
        uint32_t top = 0;
        _Pragma("omp simd reduction(max:best) reduction(max:top)")
        for (int64_t i = 0; i < n; ++i) {
            best = xr[i] > best ? xr[i] : best;
            const uint32_t a = abs_bits(xr[i]);
            top = a > top ? a : top;
        }
        out[r] = first_match(xr, n, best, top > 0x7f800000u);
    }
}
