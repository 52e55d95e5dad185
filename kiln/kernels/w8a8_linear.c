/* SmoothQuant W8A8 linear layers: y = x W^T + b with int8 weights (a scale per output column)
 * and int8 activations (a scale per row, computed here), x, y and b bfloat16; the same numbers
 * as kiln.quantization.smoothquant.w8a8_linear (torch._int_mm), bit for bit:
 *
 *   xr = x * prequant                         (fp32; SmoothQuant's 1 / s)
 *   a  = max(max|xr|, 1e-12) / 127            (per row)
 *   q  = clamp(round_half_even(xr / a), +-127)
 *   y  = ((float)(q . w_c) * a) * scale[c] + b[c], rounded to bf16
 *
 * The weight is the checkpoint's row-major int8 [n, k] (what torch._int_mm takes too). The
 * integer dot products are exact in int32 (|q w| <= 127^2, so any k below 133,000); every
 * float operation uses AVX-512's explicit-rounding forms, which -ffast-math cannot reorder or
 * turn into reciprocals. Rows are processed against 16 output columns at a time, so a block's
 * codes are read from memory once per call whatever the number of rows.
 */
#include <stdint.h>
#include <stdlib.h>

#include "dtypes.h"
#include "kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

int kiln_w8a8_supported(int64_t n, int64_t k) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return n % 16 == 0 && k % 32 == 0 && k < 133000;
#else
    (void)n, (void)k;
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __m512 load_bf16x16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Row t of x as int16 codes q (k of them) and its scale a. */
static void quantize_row(const bf16_t *x, const float *prequant, int64_t k, int16_t *q, float *a) {
    float *xr = malloc(sizeof(float) * k);
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        __m512 v = load_bf16x16(x + i);
        if (prequant) v = _mm512_mul_round_ps(v, _mm512_loadu_ps(prequant + i), RN);
        _mm512_storeu_ps(xr + i, v);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const __m512 scale = _mm512_div_round_ps(_mm512_max_ps(_mm512_set1_ps(_mm512_reduce_max_ps(amax)),
                                                           _mm512_set1_ps(1e-12f)),
                                             _mm512_set1_ps(127.f), RN);
    const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int64_t i = 0; i < k; i += 16) {
        __m512 r = _mm512_roundscale_ps(_mm512_div_round_ps(_mm512_loadu_ps(xr + i), scale, RN), RN);
        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        _mm256_storeu_si256((__m256i *)(q + i), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(r)));
    }
    *a = _mm512_cvtss_f32(scale);
    free(xr);
}

/* Dot products of 4 consecutive weight rows (columns of y) with MT (1-4) rows of codes q
 * (row stride k): out[t][c]. Each widened weight vector serves every row. */
static inline __attribute__((always_inline)) void dot4(const int8_t *w, int64_t k, const int16_t *q, int MT,
                                                      int32_t out[4][16]) {
    __m512i acc[4][4];
    for (int t = 0; t < MT; ++t)
        for (int c = 0; c < 4; ++c) acc[t][c] = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += 32) {
        __m512i wv[4];
        for (int c = 0; c < 4; ++c) {
            _mm_prefetch((const char *)(w + c * k + i + 512), _MM_HINT_T0);
            wv[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + c * k + i)));
        }
        for (int t = 0; t < MT; ++t) {
            const __m512i x = _mm512_loadu_si512(q + t * k + i);
            for (int c = 0; c < 4; ++c) acc[t][c] = _mm512_dpwssd_epi32(acc[t][c], wv[c], x);
        }
    }
    for (int t = 0; t < MT; ++t)
        for (int c = 0; c < 4; ++c) out[t][c] = _mm512_reduce_add_epi32(acc[t][c]);
}

/* MT rows of y from t0, columns of block nb. */
static inline __attribute__((always_inline)) void block_rows(const int8_t *codes, const int16_t *q, const float *a,
                                                             __m512 ws, const bf16_t *bias, __m512 b, bf16_t *y,
                                                             int64_t t0, int MT, int64_t nb, int64_t n, int64_t k) {
    int32_t acc[4][16];
    for (int c = 0; c < 16; c += 4) {
        int32_t part[4][16];
        dot4(codes + (nb * 16 + c) * k, k, q + t0 * k, MT, part);
        for (int t = 0; t < MT; ++t)
            for (int j = 0; j < 4; ++j) acc[t][c + j] = part[t][j];
    }
    for (int t = 0; t < MT; ++t) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc[t]));  /* RNE, as torch's int32 -> float */
        v = _mm512_mul_round_ps(_mm512_mul_round_ps(v, _mm512_set1_ps(a[t0 + t]), RN), ws, RN);
        if (bias) v = _mm512_add_round_ps(v, b, RN);
        float out[16];
        _mm512_storeu_ps(out, v);
        for (int c = 0; c < 16; ++c) y[(t0 + t) * n + nb * 16 + c] = bf16_store(out[c]);
    }
}
#endif

/* x [m, k] bf16, codes int8 [n, k] row-major, w_scale float32 [n], prequant float32 [k] (or
 * NULL), bias bf16 [n] (or NULL) -> y [m, n] bf16. Needs kiln_w8a8_supported(n, k). */
void kiln_w8a8_linear_bf16(const bf16_t *x, const int8_t *codes, const float *w_scale, const float *prequant,
                           const bf16_t *bias, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    int16_t *q = malloc(sizeof(int16_t) * m * k);
    float *a = malloc(sizeof(float) * m);
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t t = 0; t < m; ++t) quantize_row(x + t * k, prequant, k, q + t * k, a + t);
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t nb = 0; nb < n / 16; ++nb) {
        const __m512 ws = _mm512_loadu_ps(w_scale + nb * 16);
        const __m512 b = bias ? load_bf16x16(bias + nb * 16) : _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < m; t0 += 4) {
            switch (m - t0 < 4 ? m - t0 : 4) {
            case 1: block_rows(codes, q, a, ws, bias, b, y, t0, 1, nb, n, k); break;
            case 2: block_rows(codes, q, a, ws, bias, b, y, t0, 2, nb, n, k); break;
            case 3: block_rows(codes, q, a, ws, bias, b, y, t0, 3, nb, n, k); break;
            default: block_rows(codes, q, a, ws, bias, b, y, t0, 4, nb, n, k); break;
            }
        }
    }
    free(q);
    free(a);
#else
    (void)x, (void)codes, (void)w_scale, (void)prequant, (void)bias, (void)y, (void)m, (void)n, (void)k,
        (void)num_threads;
    abort();  /* callers check kiln_w8a8_supported first */
#endif
}
