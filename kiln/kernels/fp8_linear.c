/* FP8 (e4m3) linear layers, emulated exactly on a CPU without FP8 arithmetic:
 *
 *   y = (Q(x / a) W8^T) * a * w[c] + b
 *
 * with W8 the e4m3 weight codes (per-tensor scale w, given per output column so an engine's
 * fused gate/up pair keeps both halves' scales), a the static per-tensor activation scale and
 * Q the rounding of x / a to the nearest e4m3 value (ties to even, saturating at +-448). Every
 * e4m3 value is exact in bfloat16 (4 significant bits of 8, exponents well inside bf16's
 * range), so x's codes and W8's codes become bf16 without error and their products sum in
 * fp32 through AVX512-BF16 dot products (or AMX): the arithmetic of an FP8 tensor core with
 * fp32 accumulation. The scales multiply each fp32 sum once.
 *
 * e4m3 ("fn": no infinities): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent
 * 0 holds the subnormals m/8 * 2^-6; 0x7F/0xFF are NaN; the largest finite value is 448.
 *
 * Codes are 1 byte each in the tile order of 8-bit codes (quant_linear.c, kiln_quant_pack with
 * bits 8): tile row p of a 16-column block holds each column's pair of k side by side, so a
 * row of 32 codes becomes one VDPBF16PS operand. Few rows of x take a GEMV straight from the
 * codes; more, panels of codes converted into bf16 tiles for the shared panel kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define E4M3_MAX 448.f
#define FP8_GEMV_MAX_ROWS 8

/* bf16 bits of each e4m3 magnitude (the byte's 7 low bits); filled when the library loads. */
static bf16_t e4m3_magnitudes[128];

__attribute__((constructor)) static void fill_e4m3_magnitudes(void) {
    for (int i = 0; i < 128; ++i) {
        const int e = i >> 3, m = i & 7;
        const float v = i == 0x7f ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + m / 8.f, e - 7);
        e4m3_magnitudes[i] = bf16_store(v);  /* exact: at most 4 significant bits */
    }
}

static inline bf16_t e4m3_to_bf16(uint8_t code) {
    return (bf16_t)(e4m3_magnitudes[code & 0x7f] | ((code & 0x80) << 8));
}

/* The nearest e4m3 value of v (ties to even), saturated at +-448; NaN stays NaN. */
static inline float round_e4m3(float v) {
    const float a = fabsf(v);
    if (a >= E4M3_MAX) return copysignf(E4M3_MAX, v);
    if (a < 0.015625f) return nearbyintf(v * 512.f) / 512.f;  /* subnormal grid 2^-9 (and zero) */
    union { float f; uint32_t u; } bits = {v};
    bits.u = (bits.u + 0x7ffffu + ((bits.u >> 20) & 1u)) & 0xfff00000u;  /* keep 3 of 23 mantissa bits */
    return bits.f;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* round_e4m3 on 16 lanes. */
static inline __m512 round_e4m3_x16(__m512 v) {
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u));
    const __m512 a = _mm512_abs_ps(v);
    __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff), odd));
    __m512 r = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xfff00000u)));
    const __m512 sub = _mm512_mul_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(512.f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        _mm512_set1_ps(1.f / 512.f));
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ), r, sub);
    const __m512 saturated = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_set1_ps(E4M3_MAX)), sign));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(E4M3_MAX), _CMP_GE_OQ), r, saturated);
}

static inline __m512 load_bf16x16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

/* x' = Q(x * prequant / a) for m rows of k, as bf16 (exact); prequant (float32 [k]) or NULL.
 * The product x * prequant is rounded to bf16 first, as the layer-by-layer path rounds it. */
void kiln_fp8_quantize_rows(const bf16_t *x, int64_t m, int64_t k, const float *prequant, float act_scale,
                            bf16_t *out, int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(m * k > 65536)")
    for (int64_t t = 0; t < m; ++t) {
        const bf16_t *xr = x + t * k;
        bf16_t *o = out + t * k;
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        const __m512 a = _mm512_set1_ps(act_scale);
        for (; i + 16 <= k; i += 16) {
            __m512 v = load_bf16x16(xr + i);
            if (prequant)  /* rounded to bf16 and back */
                v = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(v, _mm512_loadu_ps(prequant + i))));
            _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(round_e4m3_x16(_mm512_div_ps(v, a))));
        }
#endif
        for (; i < k; ++i) {
            float v = bf16_load(xr[i]);
            if (prequant) v = bf16_load(bf16_store(v * prequant[i]));
            o[i] = bf16_store(round_e4m3(v / act_scale));
        }
    }
}

/* The input of a weight-only quantized linear with AWQ's multiplier (prequant, float32 [k], or
 * NULL) and, with act_scale > 0 (W4A8_AWQ), rounded to e4m3 on that static scale:
 * bf16(Q(bf16(x * prequant) / a) * a), or bf16(x * prequant); as the layer-by-layer path rounds. */
void kiln_prepare_quant_input(const bf16_t *x, int64_t m, int64_t k, const float *prequant, float act_scale,
                              bf16_t *out, int num_threads) {
    if (act_scale > 0.f) {
        kiln_fp8_quantize_rows(x, m, k, prequant, act_scale, out, num_threads);
        for (int64_t i = 0; i < m * k; ++i) out[i] = bf16_store(bf16_load(out[i]) * act_scale);
        return;
    }
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(m * k > 65536)")
    for (int64_t t = 0; t < m; ++t)
        for (int64_t i = 0; i < k; ++i) out[t * k + i] = bf16_store(bf16_load(x[t * k + i]) * prequant[i]);
}

/* Codes to bf16 values, one byte at a time (tests compare it with torch's own conversion). */
void kiln_fp8_to_bf16(const uint8_t *codes, int64_t count, bf16_t *out) {
    for (int64_t i = 0; i < count; ++i) out[i] = e4m3_to_bf16(codes[i]);
}

typedef struct {
    const uint8_t *codes;  /* tile order */
    int64_t n, k;
} fp8_weight;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HAVE_FP8_VECTORS 1
typedef struct {
    __m512i t0, t1, t2, t3;  /* e4m3_magnitudes in four registers of 32 */
} e4m3_table;

static inline e4m3_table load_table(void) {
    e4m3_table t = {_mm512_loadu_si512(e4m3_magnitudes), _mm512_loadu_si512(e4m3_magnitudes + 32),
                    _mm512_loadu_si512(e4m3_magnitudes + 64), _mm512_loadu_si512(e4m3_magnitudes + 96)};
    return t;
}

/* 32 codes -> 32 bf16: two table permutes (magnitudes 0-63 and 64-127, picked by bit 6), sign
 * from bit 7. */
static inline __m512i e4m3x32_to_bf16(const uint8_t *codes, const e4m3_table *t) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)codes));
    const __m512i low = _mm512_permutex2var_epi16(t->t0, w, t->t1);
    const __m512i high = _mm512_permutex2var_epi16(t->t2, w, t->t3);
    const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), low, high);
    /* magnitude | (w << 8 & 0x8000) */
    return _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(w, 8), _mm512_set1_epi16((short)0x8000), 0xf8);
}

/* MT rows of x' (1-4) against NB (1 or 4) output blocks from block nb0: fp32 sums into out. */
static inline __attribute__((always_inline)) void gemv_blocks(const fp8_weight *W, const bf16_t *x, int MT,
                                                             int64_t nb0, int NB, const e4m3_table *table,
                                                             float *out) {
    const int64_t k = W->k, kblocks = k / 32;
    __m512 acc[4][4];
    for (int t = 0; t < MT; ++t)
        for (int b = 0; b < NB; ++b) acc[t][b] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kblocks; ++kb) {
        const uint8_t *tiles[4];
        for (int b = 0; b < NB; ++b) {
            tiles[b] = W->codes + ((nb0 + b) * kblocks + kb) * 512;
            _mm_prefetch((const char *)(tiles[b] + 2 * 512), _MM_HINT_T0);
        }
        for (int p = 0; p < 16; ++p) {
            __m512bh xv[4];
            for (int t = 0; t < MT; ++t) {
                int32_t pair;
                memcpy(&pair, x + t * k + kb * 32 + 2 * p, sizeof pair);
                xv[t] = (__m512bh)_mm512_set1_epi32(pair);
            }
            for (int b = 0; b < NB; ++b) {
                const __m512bh wv = (__m512bh)e4m3x32_to_bf16(tiles[b] + p * 32, table);
                for (int t = 0; t < MT; ++t) acc[t][b] = _mm512_dpbf16_ps(acc[t][b], wv, xv[t]);
            }
        }
    }
    for (int t = 0; t < MT; ++t)
        for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + t * 64 + 16 * b, acc[t][b]);
}

typedef struct {
    const fp8_weight *W;
    const bf16_t *x;
} fp8_tile_ctx;

/* One tile for kiln_gemv_panels: a full panel at once, a last panel's 1-3 blocks one at a time. */
static void fp8_tile(const void *ctx, int64_t t0, int mt, int64_t nb0, int blocks, float *out) {
    const fp8_weight *W = ((const fp8_tile_ctx *)ctx)->W;
    const bf16_t *xt = ((const fp8_tile_ctx *)ctx)->x + t0 * W->k;
    const e4m3_table table = load_table();
#define ROWS(MT)                                                                                   \
    if (blocks == 4) gemv_blocks(W, xt, MT, nb0, 4, &table, out);                                  \
    else for (int b = 0; b < blocks; ++b) gemv_blocks(W, xt, MT, nb0 + b, 1, &table, out + 16 * b);
    KILN_GEMV_ROWS(mt, ROWS)
#undef ROWS
}
#endif

/* The panel function: tiles of the output blocks nb0.. converted to bf16 into scratch. */
static const bf16_t *fp8_panel(const void *weight, int64_t nb0, int blocks, int64_t kblocks, bf16_t *scratch) {
    const fp8_weight *W = weight;
    const uint8_t *codes = W->codes + nb0 * kblocks * 512;
    const int64_t count = blocks * kblocks * 512;
#ifdef HAVE_FP8_VECTORS
    const e4m3_table table = load_table();
    for (int64_t i = 0; i < count; i += 32) _mm512_storeu_si512(scratch + i, e4m3x32_to_bf16(codes + i, &table));
#else
    for (int64_t i = 0; i < count; ++i) scratch[i] = e4m3_to_bf16(codes[i]);
#endif
    return scratch;
}

/* y [m, n] = (Q(x * prequant / a) W8^T) * a * w_scale[c] + b; x and y bfloat16; codes in tile
 * order; w_scale float32 [n]; prequant float32 [k] or NULL. */
void kiln_fp8_linear_bf16(const bf16_t *x, const uint8_t *codes, const float *w_scale, float act_scale,
                          const float *prequant, const bf16_t *bias, bf16_t *y, int64_t m, int64_t n, int64_t k,
                          int num_threads) {
    bf16_t *xq = malloc(sizeof(bf16_t) * m * k);
    float *col_scale = malloc(sizeof(float) * n);
    kiln_fp8_quantize_rows(x, m, k, prequant, act_scale, xq, num_threads);
    for (int64_t c = 0; c < n; ++c) col_scale[c] = act_scale * w_scale[c];
    const fp8_weight W = {codes, n, k};
#ifdef HAVE_FP8_VECTORS
    if (m <= FP8_GEMV_MAX_ROWS) {
        const fp8_tile_ctx ctx = {&W, xq};
        kiln_gemv_panels(fp8_tile, &ctx, bias, col_scale, y, m, n, 1, num_threads);
    } else
#endif
        kiln_linear_panels(xq, fp8_panel, &W, bias, col_scale, y, m, n, k, num_threads);
    free(col_scale);
    free(xq);
}
