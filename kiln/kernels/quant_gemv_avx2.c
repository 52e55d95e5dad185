/* quant_linear.c's integer GEMV for CPUs with AVX2 but no AVX512-VNNI (AMD Zen 2 and 3, Intel
 * client cores): the same engine layout, the same prepared x (int8 blocks of 32 with a scale
 * each for 4- and 6-bit codes; 16-bit fixed point for int8 codes) and the same flushes to fp32
 * per span, so a row's result does not depend on the other rows of the call here either.
 *
 * Without VPDPBUSD a code vector meets x in two steps: VPMADDUBSW multiplies the unsigned codes
 * by x's signed bytes and adds pairs in int16, the low- and high-nibble halves of a chunk are
 * added in int16 (at most 2 * 2 * 63 * 127 = 32004 for 6-bit codes: no saturation), and
 * VPMADDWD by ones widens each column's sum to int32. int8 codes: VPMADDWD of the tile's
 * sign-extended code pairs by x's 16-bit pairs, as VPDPWSSD does. A 64-byte chunk is two
 * 256-bit halves (columns 0-7 and 8-15). With sixteen vector registers a call takes at most
 * two rows of x at once (more spilled its accumulators), and the loops over rows, blocks and
 * halves are unrolled so the accumulators live in registers (rolled, GCC kept them on the
 * stack: a third of the speed).
 */
#include "quant_gemv.h"

#ifdef KILN_QUANT_GEMV_AVX2
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "quant_layout.h"

static inline __m256 load8_bf16(const bf16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline __m256i bcast32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* 6-bit codes: bit pair `pair` of each high-bits byte, moved to bits 4-5 (beside the nibble). */
static inline __m256i high_pair(__m256i high, int pair) {
    const __m256i mask = _mm256_set1_epi8(0x30);
    switch (pair) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(high, 4), mask);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(high, 2), mask);
    case 2: return _mm256_and_si256(high, mask);
    default: return _mm256_and_si256(_mm256_srli_epi16(high, 2), mask);
    }
}

static inline __m256 half_floats(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline __m256 code_floats(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* quant_layout.h's load_block_scales in two halves (columns 0-7, 8-15). */
static inline void block_scales(const kiln_qweight *W, int64_t nb, int64_t g, __m256 s[2], __m256 o[2]) {
    o[0] = o[1] = _mm256_setzero_ps();
    if (W->channel_scales) {
        s[0] = _mm256_loadu_ps(W->channel_scales + nb * 16);
        s[1] = _mm256_loadu_ps(W->channel_scales + nb * 16 + 8);
        return;
    }
    if (W->super) {  /* int8 codes times the super-block's float16 multipliers */
        const int64_t at = super_record_at(W, nb, g), per = KILN_SUPER_K / W->group;
        const int64_t q = (g % per) * 16, mult = per * 16;
        const uint8_t *sc = (const uint8_t *)W->scales + at, *of = (const uint8_t *)W->offsets + at;
        for (int h = 0; h < 2; ++h) {
            s[h] = _mm256_mul_ps(code_floats(sc + q + 8 * h), half_floats(sc + mult + 16 * h));
            if (W->offsets) o[h] = _mm256_mul_ps(code_floats(of + q + 8 * h), half_floats(of + mult + 16 * h));
        }
        return;
    }
    const int64_t at = (nb * (W->k / W->group) + g) * 16;
    for (int h = 0; h < 2; ++h) {
        s[h] = half_floats(W->scales + at + 8 * h);
        if (W->offsets) o[h] = half_floats(W->offsets + at + 8 * h);
    }
}

enum { FMT_U4, FMT_E2M1, FMT_U6, FMT_I8 };  /* the code formats, each a loop of its own */

/* MT rows (1-2) of x against NB output blocks (int8: 1; 4-bit: a whole panel, 1 or 2) of codes
 * in format FMT; all three constant once inlined, so the loops test nothing per chunk. Sums into
 * out[t * 64 + 16 * b + c]. */
static inline __attribute__((always_inline)) void gemv_blocks(const kiln_qweight *W, const kiln_gemv_input *in,
                                                             int64_t t0, int MT, int64_t nb0, int NB, int FMT,
                                                             float *out) {
    const int64_t k = W->k, span = flush_span(W);
    const int32_t zero = (int32_t)folded_zero(W);
    /* the same spot of the next panel, a panel ahead (quant_linear.c's GEMV says why) */
    const int64_t next_panel = FMT == FMT_I8 ? 4 * 16 * k : 2 * 16 * k / 2;
    const uint8_t *panel = FMT != FMT_I8 ? W->codes + chunk_at(W->n, k, nb0, 0) : W->codes + nb0 * (k / 32) * 512;
    const uint8_t *high_panel = FMT == FMT_U6 ? W->codes + high_bits_at(W->n, k, nb0, 0) : NULL;
    const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_U));
    __m256 total[2][2][2];
    _Pragma("GCC unroll 4")
    for (int t = 0; t < MT; ++t)
        _Pragma("GCC unroll 4")
        for (int b = 0; b < NB; ++b) total[t][b][0] = total[t][b][1] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < k; k0 += span) {
        const int64_t k1 = k0 + span < k ? k0 + span : k;
        __m256i acc[2][2][2];
        _Pragma("GCC unroll 4")
        for (int t = 0; t < MT; ++t)
            _Pragma("GCC unroll 4")
            for (int b = 0; b < NB; ++b) acc[t][b][0] = acc[t][b][1] = _mm256_setzero_si256();
        if (FMT == FMT_I8) {  /* NB == 1: a block's tiles are one stream */
            for (int64_t kb = k0 / 32; kb < k1 / 32; ++kb) {
                const uint8_t *tile = panel + kb * 512;
                for (int p = 0; p < 16; ++p) {
                    if (p % 2 == 0) _mm_prefetch((const char *)(tile + p * 32 + next_panel), _MM_HINT_T0);
                    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tile + p * 32)));
                    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tile + p * 32 + 16)));
                    _Pragma("GCC unroll 4")
                    for (int t = 0; t < MT; ++t) {
                        const __m256i xp = bcast32(in->x16 + (t0 + t) * k + kb * 32 + 2 * p);
                        acc[t][0][0] = _mm256_add_epi32(acc[t][0][0], _mm256_madd_epi16(w0, xp));
                        acc[t][0][1] = _mm256_add_epi32(acc[t][0][1], _mm256_madd_epi16(w1, xp));
                    }
                }
            }
        } else {
            for (int64_t j = k0 / 8; j < k1 / 8; ++j) {
                __m256i xl[2], xh[2];
                _Pragma("GCC unroll 4")
                for (int t = 0; t < MT; ++t) {
                    xl[t] = bcast32(in->x8 + (t0 + t) * k + 8 * j);
                    xh[t] = bcast32(in->x8 + (t0 + t) * k + 8 * j + 4);
                }
                _Pragma("GCC unroll 4")
                for (int b = 0; b < NB; ++b) {
                    const uint8_t *chunk = panel + (j * NB + b) * 64;
                    _mm_prefetch((const char *)(chunk + next_panel), _MM_HINT_T0);
                    const uint8_t *bits = FMT == FMT_U6 ? high_panel + ((j / 2) * NB + b) * 64 : NULL;
                    if (FMT == FMT_U6 && j % 2 == 0) _mm_prefetch((const char *)(bits + next_panel / 2), _MM_HINT_T0);
                    _Pragma("GCC unroll 4")
                    for (int h = 0; h < 2; ++h) {
                        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(chunk + 32 * h));
                        __m256i low = _mm256_and_si256(bytes, mask);                          /* k 8j .. 8j + 3 */
                        __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);  /* k 8j + 4 .. */
                        if (FMT == FMT_E2M1) {
                            low = _mm256_shuffle_epi8(table, low);
                            high = _mm256_shuffle_epi8(table, high);
                        }
                        if (FMT == FMT_U6) {
                            const __m256i hb = _mm256_loadu_si256((const __m256i *)(bits + 32 * h));
                            low = _mm256_or_si256(low, high_pair(hb, 2 * (j % 2)));
                            high = _mm256_or_si256(high, high_pair(hb, 2 * (j % 2) + 1));
                        }
                        _Pragma("GCC unroll 4")
                        for (int t = 0; t < MT; ++t) {
                            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, xl[t]),
                                                                   _mm256_maddubs_epi16(high, xh[t]));
                            acc[t][b][h] = _mm256_add_epi32(acc[t][b][h], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
            }
        }
        const int64_t g = k0 / W->group, sp = k0 / span;
        _Pragma("GCC unroll 4")
        for (int b = 0; b < NB; ++b) {
            __m256 sv[2], ov[2];
            block_scales(W, nb0 + b, g, sv, ov);
            _Pragma("GCC unroll 4")
            for (int t = 0; t < MT; ++t) {
                const float xs = FMT == FMT_I8 ? in->xscale[t0 + t] : in->xscale[(t0 + t) * in->spans + sp];
                const __m256i shift = _mm256_set1_epi32(zero ? zero * in->isum[(t0 + t) * in->spans + sp] : 0);
                const __m256 xsum = _mm256_set1_ps(W->offsets ? in->xsum[(t0 + t) * in->spans + sp] : 0.f);
                _Pragma("GCC unroll 4")
                for (int h = 0; h < 2; ++h) {
                    const __m256 sums = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[t][b][h], shift));
                    total[t][b][h] = _mm256_fmadd_ps(sums, _mm256_mul_ps(sv[h], _mm256_set1_ps(xs)), total[t][b][h]);
                    if (W->offsets) total[t][b][h] = _mm256_fmadd_ps(ov[h], xsum, total[t][b][h]);
                }
            }
        }
    }
    _Pragma("GCC unroll 4")
    for (int t = 0; t < MT; ++t)
        _Pragma("GCC unroll 4")
        for (int b = 0; b < NB; ++b)
            _Pragma("GCC unroll 4")
            for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + t * 64 + 16 * b + 8 * h, total[t][b][h]);
}

/* 32 floats rounded to int8 in order (VPACKS works within 128-bit lanes: a permute restores it). */
static inline __m256i pack_bytes(const __m256i q[4]) {
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* As quant_linear.c's kiln_quant_gemv_prepare: the same codes, scales and sums. */
void *kiln_quant_gemv_prepare(const bf16_t *x, const kiln_qweight *W, int64_t m, kiln_gemv_input *in) {
    const int64_t k = W->k, span = flush_span(W), spans = k / span;
    char *mem = malloc(sizeof(int16_t) * m * k + sizeof(float) * m * (3 * spans + 1));
    if (mem == NULL) return NULL;
    int16_t *x16 = (int16_t *)mem;
    int8_t *x8 = (int8_t *)x16;  /* 4-bit weights take bytes in the same place */
    float *xscale = (float *)(x16 + m * k), *xsum = xscale + m * spans;
    int32_t *isum = (int32_t *)(xsum + m * spans);
    for (int64_t t = 0; t < m; ++t) {
        const bf16_t *xr = x + t * k;
        if (W->bits != 8) {
            for (int64_t i = 0; i < k; i += 32) {  /* a block of 32: one span, or two (6-bit) */
                __m256 v[4];
                __m256 vmax = _mm256_setzero_ps();
                for (int q = 0; q < 4; ++q) {
                    v[q] = load8_bf16(xr + i + 8 * q);
                    vmax = _mm256_max_ps(vmax, abs8(v[q]));
                }
                const float amax = hmax8(vmax), scale = amax > 0.f ? amax / 127.f : 1.f;
                const __m256 inv = _mm256_set1_ps(1.f / scale);
                __m256i q[4];
                for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  /* to nearest even */
                _mm256_storeu_si256((__m256i *)(x8 + t * k + i), pack_bytes(q));
                const int32_t first = hsum8i(_mm256_add_epi32(q[0], q[1])), second = hsum8i(_mm256_add_epi32(q[2], q[3]));
                if (span == 16) {
                    const int64_t s = t * spans + i / 16;
                    xscale[s] = xscale[s + 1] = scale;
                    isum[s] = first;
                    isum[s + 1] = second;
                    xsum[s] = (float)first * scale;
                    xsum[s + 1] = (float)second * scale;
                } else {
                    const int64_t s = t * spans + i / 32;
                    xscale[s] = scale;
                    isum[s] = first + second;
                    xsum[s] = (float)isum[s] * scale;
                }
            }
            continue;
        }
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8) vmax = _mm256_max_ps(vmax, abs8(load8_bf16(xr + i)));
        const float amax = hmax8(vmax);
        xscale[t] = amax > 0.f ? amax / 16383.f : 1.f;  /* 15 bits: a pair's products stay in int32 */
        const __m256 s = _mm256_set1_ps(xscale[t]);
        __m256i sum = _mm256_setzero_si256();
        for (int64_t i = 0; i < k; i += 16) {
            const __m256i q0 = _mm256_cvtps_epi32(_mm256_div_ps(load8_bf16(xr + i), s));
            const __m256i q1 = _mm256_cvtps_epi32(_mm256_div_ps(load8_bf16(xr + i + 8), s));
            _mm256_storeu_si256((__m256i *)(x16 + t * k + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xd8));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(q0, q1));
            if ((i + 16) % span == 0) {  /* the span's sum of x as the kernel sees it */
                xsum[t * spans + (i + 16) / span - 1] = (float)hsum8i(sum) * xscale[t];
                sum = _mm256_setzero_si256();
            }
        }
    }
    in->x16 = x16;
    in->x8 = x8;
    in->xscale = xscale;
    in->xsum = xsum;
    in->isum = isum;
    in->spans = spans;
    return mem;
}

/* Rows in pairs; 4-bit, one panel (1 or 2 blocks); int8, one block at a time. */
void kiln_quant_gemv_tile(const kiln_qweight *W, const kiln_gemv_input *in, int64_t t0, int mt, int64_t nb0,
                          int blocks, float *out) {
    const int fmt = W->bits == 8 ? FMT_I8 : W->bits == 6 ? FMT_U6 : W->e2m1 ? FMT_E2M1 : FMT_U4;
    for (int t = 0; t < mt; t += 2) {
#define BLOCKS(MT, FMT)                                                                            \
        if (FMT == FMT_I8)                                                                         \
            for (int b = 0; b < blocks; ++b) gemv_blocks(W, in, t0 + t, MT, nb0 + b, 1, FMT, out + t * 64 + 16 * b); \
        else if (blocks == 2) gemv_blocks(W, in, t0 + t, MT, nb0, 2, FMT, out + t * 64);          \
        else gemv_blocks(W, in, t0 + t, MT, nb0, 1, FMT, out + t * 64);
#define ROWS(MT)                                                                                   \
        switch (fmt) {                                                                             \
        case FMT_U4: BLOCKS(MT, FMT_U4) break;                                                     \
        case FMT_E2M1: BLOCKS(MT, FMT_E2M1) break;                                                 \
        case FMT_U6: BLOCKS(MT, FMT_U6) break;                                                     \
        default: BLOCKS(MT, FMT_I8) break;                                                         \
        }
        if (mt - t >= 2) { ROWS(2) } else { ROWS(1) }
#undef ROWS
#undef BLOCKS
    }
}
#endif
