/* Weight-only quantized linear layers: y = x W^T + b with W stored as int8 (per output channel
 * scale, W8A16) or 4-bit codes (a scale, and optionally a zero point, per group of k, W4A16);
 * x, y and b bfloat16.
 *
 * Codes are stored in the AMX tile order of amx_linear.c (one byte per int8 code, 512 a tile;
 * 4-bit codes two a byte, 256 a tile: tile rows 2j and 2j + 1 share 32 bytes, row 2j in the
 * low nibbles, so one 16-bit widening and a mask or a shift give either row), so
 * a panel's tiles dequantize with straight vector loads into a per-thread scratch that the
 * AMX kernel then multiplies for every row block of x: each weight byte is read from memory
 * once per call, and dequantized once per call, whatever the number of rows.
 *
 *   int8:  w[c][k] = q * scale[c]                         (q signed, -127..127)
 *   4-bit: w[c][k] = (u - zero[c][g]) * scale[c][g]       (u 0..15; zero 8 when not stored;
 *                                                          g = k / group)
 * computed in fp32 as u * s + (-zero * s) and rounded to bf16 for the tile paths (AMX, or
 * without AMX a portable loop over the same panels); one row of x takes a GEMV over the codes
 * that applies the scales after the sums instead (quant_gemv).
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

typedef struct {
    const uint8_t *codes;  /* tile order, see above */
    const float *scales;   /* [n] (bits 8) or [n, k / group] (bits 4) */
    const float *zeros;    /* [n, k / group] in code units, or NULL */
    int64_t n, k, group, bits;
} kiln_qweight;

/* Tile order from row-major codes: int8 [n, k] or packed 4-bit [n, k / 2] (byte j of a row holds
 * codes 2j in its low and 2j + 1 in its high nibble). */
void kiln_quant_pack(const uint8_t *codes, uint8_t *out, int64_t n, int64_t k, int64_t bits, int num_threads) {
    const int64_t kblocks = k / 32;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t nb = 0; nb < n / 16; ++nb)
        for (int64_t kb = 0; kb < kblocks; ++kb) {
            if (bits == 8) {  /* 16-bit units (the pair of one column): a 16 x 16 transpose */
                uint16_t *tile = (uint16_t *)(out + (nb * kblocks + kb) * 512);
                for (int c = 0; c < 16; ++c) {
                    const uint16_t *row = (const uint16_t *)(codes + (nb * 16 + c) * k + kb * 32);
                    for (int p = 0; p < 16; ++p) tile[p * 16 + c] = row[p];
                }
            } else {  /* tile rows 2j and 2j + 1 share 32 bytes: low and high nibbles */
                uint8_t *tile = out + (nb * kblocks + kb) * 256;
                for (int c = 0; c < 16; ++c) {
                    const uint8_t *row = codes + (nb * 16 + c) * (k / 2) + kb * 16;  /* byte p: k pair p */
                    for (int p = 0; p < 16; ++p)
                        for (int e = 0; e < 2; ++e) {
                            const uint8_t u = (row[p] >> (4 * e)) & 0x0f;
                            uint8_t *at = tile + (p / 2) * 32 + 2 * c + e;
                            *at = p % 2 ? (uint8_t)((*at & 0x0f) | (u << 4)) : u;
                        }
                }
            }
        }
}

/* Scale and offset of the 16 columns of block nb at k block kb (fp32). */
static inline void column_scales(const kiln_qweight *W, int64_t nb, int64_t kb, float s[16], float o[16]) {
    const int64_t groups = W->bits == 8 ? 1 : W->k / W->group, g = W->bits == 8 ? 0 : kb * 32 / W->group;
    const float default_zero = W->bits == 8 ? 0.f : 8.f;
    for (int c = 0; c < 16; ++c) {
        const int64_t at = (nb * 16 + c) * groups + g;
        s[c] = W->scales[at];
        o[c] = -(W->zeros ? W->zeros[at] : default_zero) * s[c];
    }
}

static const bf16_t *dequant_panel(const void *weight, int64_t nb0, int blocks, int64_t kblocks, bf16_t *scratch) {
    const kiln_qweight *W = weight;
    const int64_t tile_bytes = W->bits == 8 ? 512 : 256;
    for (int b = 0; b < blocks; ++b)
        for (int64_t kb = 0; kb < kblocks; ++kb) {
            float s[16], o[16];
            column_scales(W, nb0 + b, kb, s, o);
            const uint8_t *tile = W->codes + ((nb0 + b) * kblocks + kb) * tile_bytes;
            bf16_t *out = scratch + (b * kblocks + kb) * 512;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            /* lane i of a 16-lane half is column i / 2 (+ 8 for the upper half) */
            const __m512i lo_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
            const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
            const __m512 sv = _mm512_loadu_ps(s), ov = _mm512_loadu_ps(o);
            const __m512 s_lo = _mm512_permutexvar_ps(lo_idx, sv), s_hi = _mm512_permutexvar_ps(hi_idx, sv);
            const __m512 o_lo = _mm512_permutexvar_ps(lo_idx, ov), o_hi = _mm512_permutexvar_ps(hi_idx, ov);
            for (int p = 0; p < 16; ++p) {
                __m512i lo, hi;
                if (W->bits == 8) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(tile + p * 32));
                    lo = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q));
                    hi = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1));
                } else {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(tile + (p / 2) * 32));
                    const __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 4 * (p % 2)), _mm256_set1_epi8(0x0f));
                    lo = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(u));
                    hi = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(u, 1));
                }
                const __m512 f_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s_lo, o_lo);
                const __m512 f_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s_hi, o_hi);
                _mm512_storeu_si512(out + p * 32, (__m512i)_mm512_cvtne2ps_pbh(f_hi, f_lo));
            }
#else
            for (int p = 0; p < 16; ++p)
                for (int i = 0; i < 32; ++i) {
                    const int c = i / 2;
                    float u;
                    if (W->bits == 8) u = (float)(int8_t)tile[p * 32 + i];
                    else u = (float)((tile[(p / 2) * 32 + i] >> (4 * (p % 2))) & 0x0f);
                    out[p * 32 + i] = bf16_store(u * s[c] + o[c]);
                }
#endif
        }
    return scratch;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define HAVE_QUANT_GEMV 1
/* One row of x (batch-1 decode) straight from the codes, in integers: x is scaled per call to
 * 16-bit fixed point (error at most 2^-15 of its largest value, finer than its own bf16
 * rounding for all but tiny entries) and VPDPWSSD multiplies code pairs by x pairs into int32
 * lanes, one lane per output column (the tile order puts a column's k pair in one lane).
 * Converting codes to floats instead ran 3x slower than the memory here. The int32 sums are
 * flushed to fp32 per group (4-bit) or every FLUSH k blocks (8-bit, before they could
 * overflow), times scale * x's scale; a group's zero point comes in through its sum of x. */
#define FLUSH_KBLOCKS 16  /* 16 * 32 * 16383 * 127 < 2^31 */
#define QUANT_GEMV_MAX_ROWS 8  /* beyond, dequantized tiles on AMX win (benchmarks/README.md) */

/* MT rows (1-4) of x against NB (1 or 4) output blocks; both constant once inlined. */
static inline __attribute__((always_inline)) void gemv_blocks(const kiln_qweight *W, const int16_t *xq,
                                                             const float *xsum, const float *xscale, int MT,
                                                             int64_t nb0, int NB, float *out) {
    const int64_t k = W->k, kblocks = k / 32, tile_bytes = W->bits == 8 ? 512 : 256;
    const int64_t span = W->bits == 8 ? FLUSH_KBLOCKS : W->group / 32;  /* k blocks per flush */
    const int64_t groups = W->bits == 8 ? 1 : k / W->group;
    __m512 total[4][4];
    for (int t = 0; t < MT; ++t)
        for (int b = 0; b < NB; ++b) total[t][b] = _mm512_setzero_ps();
    for (int64_t kb0 = 0; kb0 < kblocks; kb0 += span) {
        const int64_t kb1 = kb0 + span < kblocks ? kb0 + span : kblocks;
        __m512i acc[4][4];
        for (int t = 0; t < MT; ++t)
            for (int b = 0; b < NB; ++b) acc[t][b] = _mm512_setzero_si512();
        for (int64_t kb = kb0; kb < kb1; ++kb) {
            const uint8_t *tiles[4];
            for (int b = 0; b < NB; ++b) {
                tiles[b] = W->codes + ((nb0 + b) * kblocks + kb) * tile_bytes;
                _mm_prefetch((const char *)(tiles[b] + 2 * tile_bytes), _MM_HINT_T0);
            }
            for (int p = 0; p < 16; p += 2) {
                __m512i x0[4], x1[4];
                for (int t = 0; t < MT; ++t) {
                    int32_t pairs[2];
                    memcpy(pairs, xq + t * k + kb * 32 + 2 * p, sizeof pairs);
                    x0[t] = _mm512_set1_epi32(pairs[0]);
                    x1[t] = _mm512_set1_epi32(pairs[1]);
                }
                for (int b = 0; b < NB; ++b) {
                    __m512i w0, w1;
                    if (W->bits == 8) {
                        w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tiles[b] + p * 32)));
                        w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tiles[b] + p * 32 + 32)));
                    } else {  /* rows p and p + 1 from one 32-byte load */
                        const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(tiles[b] + p * 16)));
                        w0 = _mm512_and_si512(both, _mm512_set1_epi16(0x0f));
                        w1 = _mm512_srli_epi16(both, 4);
                    }
                    for (int t = 0; t < MT; ++t) {
                        acc[t][b] = _mm512_dpwssd_epi32(acc[t][b], w0, x0[t]);
                        acc[t][b] = _mm512_dpwssd_epi32(acc[t][b], w1, x1[t]);
                    }
                }
            }
        }
        for (int b = 0; b < NB; ++b) {
            float sc[16], of[16];
            column_scales(W, nb0 + b, kb0, sc, of);  /* of = -zero * scale */
            const __m512 sv = _mm512_loadu_ps(sc), ov = _mm512_loadu_ps(of);
            for (int t = 0; t < MT; ++t) {
                const __m512 st = _mm512_mul_ps(sv, _mm512_set1_ps(xscale[t]));
                total[t][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][b]), st, total[t][b]);
                if (W->bits == 4)
                    total[t][b] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xsum[t * groups + kb0 / span]), total[t][b]);
            }
        }
    }
    for (int t = 0; t < MT; ++t)
        for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + t * 64 + 16 * b, total[t][b]);
}

/* Rows of x in tiles of four; a row tile's codes stay in L1/L2 between row tiles. */
static void quant_gemv(const bf16_t *x, const kiln_qweight *W, const bf16_t *bias, bf16_t *y, int64_t m,
                       int num_threads) {
    const int64_t k = W->k, n = W->n, nblocks = n / 16, groups = W->bits == 8 ? 1 : k / W->group;
    int16_t *xq = malloc(sizeof(int16_t) * m * k);
    float *xsum = malloc(sizeof(float) * m * groups), *xscale = malloc(sizeof(float) * m);
    for (int64_t t = 0; t < m; ++t) {
        const bf16_t *xr = x + t * k;
        float amax = 0.f;
        for (int64_t i = 0; i < k; ++i) {
            const float v = fabsf(bf16_load(xr[i]));
            amax = v > amax ? v : amax;
        }
        xscale[t] = amax > 0.f ? amax / 16383.f : 1.f;  /* 15 bits: a pair's products stay in int32 */
        for (int64_t i = 0; i < k; ++i) xq[t * k + i] = (int16_t)lrintf(bf16_load(xr[i]) / xscale[t]);
        for (int64_t g = 0; g < groups; ++g) {  /* the group's sum of x as the kernel sees it */
            int64_t sum = 0;
            for (int64_t i = g * (k / groups); i < (g + 1) * (k / groups); ++i) sum += xq[t * k + i];
            xsum[t * groups + g] = (float)sum * xscale[t];
        }
    }
    const int64_t tasks = (nblocks + 3) / 4;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t nb0 = task * 4;
        const int blocks = nblocks - nb0 < 4 ? (int)(nblocks - nb0) : 4;
        for (int64_t t0 = 0; t0 < m; t0 += 4) {
            const int mt = m - t0 < 4 ? (int)(m - t0) : 4;
            const int16_t *xt = xq + t0 * k;
            const float *st = xsum + t0 * groups, *sc = xscale + t0;
            float out[4 * 64];
            for (int b = 0; b < blocks; b += (blocks == 4 ? 4 : 1)) {
#define ROWS(MT)                                                                                   \
                if (blocks == 4) gemv_blocks(W, xt, st, sc, MT, nb0, 4, out);                       \
                else gemv_blocks(W, xt, st, sc, MT, nb0 + b, 1, out + 16 * b);
                switch (mt) {
                case 1: ROWS(1) break;
                case 2: ROWS(2) break;
                case 3: ROWS(3) break;
                default: ROWS(4) break;
                }
#undef ROWS
            }
            for (int t = 0; t < mt; ++t)
                for (int c = 0; c < 16 * blocks; ++c) {
                    const int64_t col = nb0 * 16 + c;
                    y[(t0 + t) * n + col] = bf16_store(out[t * 64 + c] + (bias ? bf16_load(bias[col]) : 0.f));
                }
        }
    }
    free(xscale);
    free(xsum);
    free(xq);
}
#endif

void kiln_quant_linear_bf16(const bf16_t *x, const uint8_t *codes, const float *scales, const float *zeros,
                            int64_t bits, int64_t group, const bf16_t *bias, bf16_t *y, int64_t m, int64_t n,
                            int64_t k, int num_threads) {
    const kiln_qweight W = {codes, scales, zeros, n, k, bits == 8 ? k : group, bits};
#ifdef HAVE_QUANT_GEMV
    if (m <= QUANT_GEMV_MAX_ROWS) {
        quant_gemv(x, &W, bias, y, m, num_threads);
        return;
    }
#endif
    kiln_linear_panels(x, dequant_panel, &W, bias, NULL, y, m, n, k, num_threads);
}
