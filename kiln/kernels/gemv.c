/* y = x W^T for a few rows of bfloat16 activations against bfloat16 weights.
 *
 * Decoding one token per sequence at small batch is a matrix-vector product: it reads every
 * weight once and is bound by memory bandwidth. PyTorch's bf16 path for it (oneDNN) reaches
 * roughly half the bandwidth its fp32 path does on this CPU; this kernel streams each weight
 * row once for all rows of x, with AVX512-BF16 dot products where the CPU has them.
 *
 * Layouts (row-major, contiguous): x [m, k], w [n, k] (nn.Linear's weight), bias [n] or NULL,
 * y [m, n]. Output rows are split over threads by blocks of weight rows.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t bf16_t;

#define GEMV_MAX_ROWS 4 /* beyond this oneDNN (AMX) is as fast or faster */
#define ROWS_PER_TASK 16

static inline float bf16_to_f32(bf16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline bf16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40u); /* quiet NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (bf16_t)(v.u >> 16);
}

/* dot(x, w) over k elements, fp32 accumulation. */
static inline float dot_bf16(const bf16_t *x, const bf16_t *w, int64_t k) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(x + i), (__m512bh)_mm512_loadu_si512(w + i));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(x + i + 32),
                                (__m512bh)_mm512_loadu_si512(w + i + 32));
    }
    for (; i < k; i += 32) {
        const __mmask32 mask = k - i >= 32 ? 0xffffffffu : ((1u << (k - i)) - 1u);
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i),
                                (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
    float acc = 0.f;
    _Pragma("omp simd reduction(+:acc)")
    for (int64_t i = 0; i < k; ++i) acc += bf16_to_f32(x[i]) * bf16_to_f32(w[i]);
    return acc;
#endif
}

int kiln_gemv_bf16(const bf16_t *x, const bf16_t *w, const bf16_t *bias, bf16_t *y, int64_t m, int64_t n,
                   int64_t k, int num_threads) {
    if (m <= 0 || m > GEMV_MAX_ROWS || n <= 0 || k <= 0) return 1;
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t end = (t + 1) * ROWS_PER_TASK < n ? (t + 1) * ROWS_PER_TASK : n;
        for (int64_t j = t * ROWS_PER_TASK; j < end; ++j) {
            const bf16_t *wj = w + j * k;
            const float b = bias ? bf16_to_f32(bias[j]) : 0.f;
            for (int64_t r = 0; r < m; ++r) y[r * n + j] = f32_to_bf16(dot_bf16(x + r * k, wj, k) + b);
        }
    }
    return 0;
}

int kiln_gemv_max_rows(void) { return GEMV_MAX_ROWS; }
