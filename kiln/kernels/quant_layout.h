/* The engine layout of weight-only quantized codes (quant_linear.c's header comment): where a
 * chunk, a high-bits record or a super-block record sits, a group's scales and offsets, and the
 * span of k the integer kernels (quant_linear.c's GEMV, quant_amx.c's tiles) sum before each
 * flush to floats. Shared so both kernels read the one layout alike. */
#ifndef KILN_QUANT_LAYOUT_H
#define KILN_QUANT_LAYOUT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "quant_gemv.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* nibble -> twice its E2M1 value plus 12: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the negatives */
static const uint8_t E2M1_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

static inline float half_load(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (e == 0) return (sign ? -1.f : 1.f) * ldexpf((float)m, -24);  /* zero and subnormals */
    v.u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    return v.f;
}

/* Byte offset of 4-bit chunk j (k 8j .. 8j + 7) of block nb: its panel's start, then the
 * chunks before it, alternating between the panel's blocks. */
static inline int64_t chunk_at(int64_t n, int64_t k, int64_t nb, int64_t j) {
    const int64_t first = nb & ~(int64_t)1, pair = first + 1 < n / 16 ? 2 : 1;
    return (first * (k / 8) + j * pair + (nb - first)) * 64;
}

/* 6-bit codes: byte offset of the high bits of k 16p .. 16p + 15 of block nb, after the nibbles:
 * 64 bytes per 16 k, in the panel order the chunks of half as many k have. */
static inline int64_t high_bits_at(int64_t n, int64_t k, int64_t nb, int64_t p) {
    return n * k / 2 + chunk_at(n, k / 2, nb, p);
}

/* The code that means zero in a group with no stored offset: 4-bit codes are centred on 8
 * (E2M1's on 12), 6-bit on 32, int8 on 0. */
static inline int code_zero(const kiln_qweight *W) {
    return W->bits == 4 ? (W->e2m1 ? 12 : 8) : W->bits == 6 ? 32 : 0;
}

/* Byte offset of the super-block record holding group g of block nb (super scales). */
static inline int64_t super_record_at(const kiln_qweight *W, int64_t nb, int64_t g) {
    return (nb * (W->k / KILN_SUPER_K) + g * W->group / KILN_SUPER_K) * KILN_SUPER_BYTES(W->group);
}

/* k per flush: 4-bit, a block of x (32); 6-bit, a group (16); else a divisor of the group (a multiple of 32) of at
 * most 512 k. */
static inline int64_t flush_span(const kiln_qweight *W) {
    if (W->bits == 4) return 32;
    if (W->bits == 6) return 16;  /* Q6_K's groups of 16: two spans of each block of x */
    if (W->channel_scales) return 512;
    int64_t blocks = W->group / 32, best = 1;
    for (int64_t d = 1; d <= 16; ++d)
        if (blocks % d == 0) best = d;
    return best * 32;
}

/* The integer kernels' span sums of 4- and 6-bit codes u against x8 are sum(u x8); with no
 * stored offset the weight is (u - zero) * scale, so the span's sum is moved by -zero * sum(x8)
 * in integers (exact, and one float multiply-add fewer per 16 outputs than an offset term);
 * a stored offset comes in as a float term times the span's sum of x. */
static inline int64_t folded_zero(const kiln_qweight *W) { return W->offsets ? 0 : code_zero(W); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* E2M1_U in each 128-bit lane, for VPSHUFB (a byte's low 4 bits pick within its lane). */
static inline __m512i e2m1_table(void) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1_U));
}

/* 6-bit codes: bit pair `pair` of each high-bits byte, moved to bits 4-5 (beside the nibble). */
static inline __m512i high_pair(__m512i high, int pair) {
    const __m512i mask = _mm512_set1_epi8(0x30);
    switch (pair) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(high, 4), mask);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(high, 2), mask);
    case 2: return _mm512_and_si512(high, mask);
    default: return _mm512_and_si512(_mm512_srli_epi16(high, 2), mask);
    }
}
#endif

#if defined(__AVX512F__)
/* The 16 columns' scales and stored offsets of block nb in group g, as fp32 vectors; the offset
 * is zero where none is stored (the integer kernels fold the zero code into their sums). */
static inline void load_block_scales(const kiln_qweight *W, int64_t nb, int64_t g, __m512 *s, __m512 *o) {
    if (W->channel_scales) {
        *s = _mm512_loadu_ps(W->channel_scales + nb * 16);
        *o = _mm512_setzero_ps();
        return;
    }
    if (W->super) {  /* int8 codes times the super-block's float16 multipliers */
        const int64_t at = super_record_at(W, nb, g), per = KILN_SUPER_K / W->group;
        const int64_t q = (g % per) * 16, mult = per * 16;
        const uint8_t *sc = (const uint8_t *)W->scales + at;
        *s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + q)))),
                           _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + mult))));
        const uint8_t *of = (const uint8_t *)W->offsets + at;
        *o = W->offsets ? _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(of + q)))),
                                        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(of + mult))))
                        : _mm512_setzero_ps();
        return;
    }
    const int64_t at = (nb * (W->k / W->group) + g) * 16;
    *s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(W->scales + at)));
    *o = W->offsets ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(W->offsets + at))) : _mm512_setzero_ps();
}
#endif

#endif
