/* Weight-only quantized linear layers: y = x W^T + b with W stored as int8 codes (a scale per
 * output channel, or a scale and optionally an offset per group of k) or 4-bit codes (a scale, and
 * optionally an offset, per group of k); x, y and b bfloat16.
 *
 *   int8, per channel (group 0): w[c][k] = q * scale[c]                 (q signed, -127..127)
 *   int8, per group:             w[c][k] = q * scale[c][g] + offset[c][g]  (offset 0 when not stored)
 *   4-bit:                       w[c][k] = u * scale[c][g] + offset[c][g]  (u 0..15; offset
 *                                                          -8 * scale when not stored; g = k / group)
 *   4-bit E2M1 (bits 4 | KILN_CODES_E2M1: MXFP4's codes): u = E2M1_U[nibble], twice the E2M1
 *     value plus 12 (0..24), offset -12 * scale when not stored, so w = 2 * E2M1 * scale (an
 *     MXFP4 block's E8M0 scale 2^(e - 127) is scale 2^(e - 128)). One shuffle of each code
 *     vector through the 16-entry table; everything else is the 4-bit path.
 *
 * A zero point z is the offset -z * scale; GGUF's Q4_1 / K-quant minimums are offsets as they are.
 *
 * Engine layouts (kiln build; kiln.kernels.quant_pack / quant_pack_scales):
 *   int8 codes in the tile order of amx_linear.c, one byte a code (512 bytes a 16 x 32 tile:
 *     tile row p holds each column's pair of k); per-channel scales float32 [n].
 *   4-bit codes in "chunks": per 16-column block, each 8 consecutive k (chunk j) take 64 bytes,
 *     byte 4c + i holding w[c][8j + i] in its low nibble and w[c][8j + 4 + i] in its high nibble.
 *     One 64-byte load and a mask (or a shift) give 16 lanes of 4 codes of one column each: the
 *     operand VPDPBUSD multiplies by 4 bytes of x. Blocks pair up into panels (2P, 2P + 1; the
 *     last alone when n / 16 is odd) whose chunks alternate: j of 2P, j of 2P + 1, j + 1 of 2P...
 *     (chunk_at), so the GEMV reads a panel as one stream; with a few KB a block, separate
 *     streams left ~25% of the memory bandwidth unused.
 *   Group scales and offsets (either width) float16 [n / 16][groups][16], so a block's 16 scales
 *     are one vector load.
 *   Super-blocks (bits | KILN_SCALES_SUPER; GGUF's K-quants: 6- or 8-bit scales and minimums of
 *     16 or 32 weights under a float16 per 256): scales and offsets are each [n / 16][k / 256]
 *     records of KILN_SUPER_BYTES(group), 256 / group x 16 int8 codes (group-major, a column
 *     each) and then the 16 columns' float16 multipliers: scale = code * multiplier, offset
 *     likewise (the multiplier carries the sign). Q4_K: 4.625 bits a weight instead of 5 with
 *     float16 pairs, and the products are exact in fp32 (float16 pairs rounded them).
 *   6-bit codes (GGUF's Q6_K: u 0..63, offset -32 * scale when not stored, groups of 16): the
 *     low nibbles as 4-bit codes in chunks (n * k / 2 bytes), then the high bits in the same
 *     panel order (n * k / 4 bytes), 64 bytes per block and 16 k: byte 4c + i holds column c's
 *     k 16p + i, 16p + 4 + i, 16p + 8 + i and 16p + 12 + i in bit pairs 0, 2, 4 and 6, so a
 *     shift and a mask line them up with the two chunks' nibble vectors. 6.5625 bits a weight.
 *
 * A few rows of x take a GEMV straight from the codes in integers (quant_gemv); more rows, the
 * codes of a panel dequantized (u * s + o in fp32, rounded to bf16) into the tile layout of the
 * shared panel kernel (AMX, or AVX512-BF16 dot products), which multiplies them for every row of
 * x: each code is read and dequantized once per call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"
#include "quant_gemv.h"
#include "quant_layout.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Tile / chunk order from row-major codes: int8 [n, k] or packed 4-bit [n, k / 2] (byte j of a
 * row holds codes 2j in its low and 2j + 1 in its high nibble). */
void kiln_quant_pack(const uint8_t *codes, uint8_t *out, int64_t n, int64_t k, int64_t bits, int num_threads) {
    const int64_t kblocks = k / 32, chunks = k / 8;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t nb = 0; nb < n / 16; ++nb) {
        if (bits == 8) {  /* 16-bit units (the pair of one column): a 16 x 16 transpose per tile */
            for (int64_t kb = 0; kb < kblocks; ++kb) {
                uint16_t *tile = (uint16_t *)(out + (nb * kblocks + kb) * 512);
                for (int c = 0; c < 16; ++c) {
                    const uint16_t *row = (const uint16_t *)(codes + (nb * 16 + c) * k + kb * 32);
                    for (int p = 0; p < 16; ++p) tile[p * 16 + c] = row[p];
                }
            }
            continue;
        }
        for (int64_t j = 0; j < chunks; ++j) {
            uint8_t *chunk = out + chunk_at(n, k, nb, j);
            for (int c = 0; c < 16; ++c) {
                const uint8_t *row = codes + (nb * 16 + c) * (k / 2) + j * 4;  /* k 8j .. 8j + 7 */
                for (int i = 0; i < 4; ++i) {
                    const uint8_t low = (row[i / 2] >> (4 * (i % 2))) & 0x0f;        /* k 8j + i */
                    const uint8_t high = (row[2 + i / 2] >> (4 * (i % 2))) & 0x0f;   /* k 8j + 4 + i */
                    chunk[4 * c + i] = (uint8_t)(low | (high << 4));
                }
            }
        }
    }
}

/* The offset a group has when none is stored. */
static inline float implicit_offset(const kiln_qweight *W, float s) { return -(float)code_zero(W) * s; }

/* Scale and offset of the 16 columns of block nb in group g (fp32). */
static inline void column_scales(const kiln_qweight *W, int64_t nb, int64_t g, float s[16], float o[16]) {
    if (W->channel_scales) {
        for (int c = 0; c < 16; ++c) {
            s[c] = W->channel_scales[nb * 16 + c];
            o[c] = 0.f;
        }
        return;
    }
    if (W->super) {
        const int64_t at = super_record_at(W, nb, g), per = KILN_SUPER_K / W->group;
        const uint8_t *sc = (const uint8_t *)W->scales + at, *of = (const uint8_t *)W->offsets + at;
        const int q = (int)(g % per) * 16, mult = (int)per * 16;
        for (int c = 0; c < 16; ++c) {
            uint16_t h;
            memcpy(&h, sc + mult + 2 * c, 2);
            s[c] = (float)(int8_t)sc[q + c] * half_load(h);
            if (W->offsets) memcpy(&h, of + mult + 2 * c, 2);
            o[c] = W->offsets ? (float)(int8_t)of[q + c] * half_load(h) : implicit_offset(W, s[c]);
        }
        return;
    }
    const int64_t at = (nb * (W->k / W->group) + g) * 16;
    for (int c = 0; c < 16; ++c) {
        s[c] = half_load(W->scales[at + c]);
        o[c] = W->offsets ? half_load(W->offsets[at + c]) : implicit_offset(W, s[c]);
    }
}

/* The 4- or 6-bit code of column c, k index kk (kk < 32) of k block kb in block nb (chunk order). */
static inline int code4(const kiln_qweight *W, int64_t nb, int64_t kb, int c, int kk) {
    const uint8_t byte = W->codes[chunk_at(W->n, W->k, nb, kb * 4 + kk / 8) + 4 * c + kk % 4];
    const int u = (kk % 8) < 4 ? byte & 0x0f : byte >> 4;
    if (W->bits == 6) {
        const uint8_t high = W->codes[high_bits_at(W->n, W->k, nb, kb * 2 + kk / 16) + 4 * c + kk % 4];
        return u | (((high >> (2 * ((kk % 16) / 4))) & 3) << 4);
    }
    return W->e2m1 ? E2M1_U[u] : u;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
/* Column scales and offsets spread over a tile row's 32 lanes (lane i: column i / 2, + 8 in the
 * upper half): [0] low half scales, [1] high half scales, [2], [3] offsets. */
static inline void tile_scales(const float s[16], const float o[16], __m512 v[4]) {
    const __m512i lo_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    const __m512 sv = _mm512_loadu_ps(s), ov = _mm512_loadu_ps(o);
    v[0] = _mm512_permutexvar_ps(lo_idx, sv);
    v[1] = _mm512_permutexvar_ps(hi_idx, sv);
    v[2] = _mm512_permutexvar_ps(lo_idx, ov);
    v[3] = _mm512_permutexvar_ps(hi_idx, ov);
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)) && defined(__AVX2__) && \
    defined(__FMA__)
#define DEQUANT_AVX2 1
/* Eight fp32 lanes rounded to bf16 (nearest even; the values are finite), in the low halves. */
static inline __m256i bf16_round8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
}

/* Tile row pairs as bf16 dwords (k pair 2p, 2p + 1 of 8 columns): even k in the low half. */
static inline __m256i bf16_pairs(__m256 even, __m256 odd) {
    return _mm256_or_si256(bf16_round8(even), _mm256_slli_epi32(bf16_round8(odd), 16));
}

/* k block kb of block nb (16 x 32 weights) dequantized into a bf16 tile (AVX2). 4- and 6-bit:
 * chunk j's dword c holds column c's codes of k 8j .. 8j + 3 (low nibbles) and 8j + 4 .. 8j + 7
 * (high), so byte 2r + e of a nibble dword is tile row 4j + 2h + r's k pair element e: lanes are
 * columns, one shift and mask away. int8 tiles are in place: each 16 bytes widen to 8 pairs. */
static void dequant_tile_avx2(const kiln_qweight *W, int64_t nb, int64_t kb, bf16_t *out) {
    float s[16], o[16];
    column_scales(W, nb, kb * 32 / W->group, s, o);
    __m256 sv[2] = {_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8)}, ov[2] = {_mm256_loadu_ps(o), _mm256_loadu_ps(o + 8)};
    const __m256i byte = _mm256_set1_epi32(0xff);
    if (W->bits == 8) {
        const uint8_t *tile = W->codes + (nb * (W->k / 32) + kb) * 512;
        const __m256i dup_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), dup_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
        for (int p = 0; p < 16; ++p)
            for (int q = 0; q < 4; ++q) {  /* columns 4q .. 4q + 3, both k of each */
                const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tile + p * 32 + 8 * q)));
                const __m256i dup = q % 2 ? dup_hi : dup_lo;
                const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), _mm256_permutevar8x32_ps(sv[q / 2], dup),
                                                 _mm256_permutevar8x32_ps(ov[q / 2], dup));
                const __m256i b = bf16_round8(f);  /* 8 bf16 in dword lanes: pack to words in order */
                const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
                _mm_storeu_si128((__m128i *)(out + p * 32 + 8 * q), words);
            }
        return;
    }
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_U));
    for (int j = 0; j < 4; ++j) {
        if (j == 2 && W->group < 32) {  /* 6-bit codes: the k block's second group of 16 */
            column_scales(W, nb, (kb * 32 + 16) / W->group, s, o);
            sv[0] = _mm256_loadu_ps(s), sv[1] = _mm256_loadu_ps(s + 8);
            ov[0] = _mm256_loadu_ps(o), ov[1] = _mm256_loadu_ps(o + 8);
        }
        for (int half = 0; half < 2; ++half) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(W->codes + chunk_at(W->n, W->k, nb, kb * 4 + j) + 32 * half));
            __m256i nibbles[2] = {_mm256_and_si256(bytes, mask), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask)};
            if (W->e2m1)
                for (int h = 0; h < 2; ++h) nibbles[h] = _mm256_shuffle_epi8(table, nibbles[h]);
            if (W->bits == 6) {  /* the high bit pairs, as quant_layout.h's high_pair lines them up */
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(W->codes + high_bits_at(W->n, W->k, nb, kb * 2 + j / 2) + 32 * half));
                const int shift[4] = {4, 2, 0, -2};
                for (int h = 0; h < 2; ++h) {
                    const int sh = shift[2 * (j % 2) + h];
                    const __m256i moved = sh > 0 ? _mm256_slli_epi16(hb, sh) : sh < 0 ? _mm256_srli_epi16(hb, -sh) : hb;
                    nibbles[h] = _mm256_or_si256(nibbles[h], _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
                }
            }
            for (int h = 0; h < 2; ++h)
                for (int r = 0; r < 2; ++r) {  /* tile row 4j + 2h + r: bytes 2r, 2r + 1 of each dword */
                    const __m256 even = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(nibbles[h], 16 * r), byte));
                    const __m256 odd = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(nibbles[h], 16 * r + 8), byte));
                    const __m256i pairs = bf16_pairs(_mm256_fmadd_ps(even, sv[half], ov[half]),
                                                     _mm256_fmadd_ps(odd, sv[half], ov[half]));
                    _mm256_storeu_si256((__m256i *)(out + (4 * j + 2 * h + r) * 32 + 16 * half), pairs);
                }
        }
    }
}
#endif

static const bf16_t *dequant_panel(const void *weight, int64_t nb0, int blocks, int64_t kblocks, bf16_t *scratch) {
    const kiln_qweight *W = weight;
    for (int b = 0; b < blocks; ++b)
        for (int64_t kb = 0; kb < kblocks; ++kb) {
            bf16_t *out = scratch + (b * kblocks + kb) * 512;
#ifdef DEQUANT_AVX2
            dequant_tile_avx2(W, nb0 + b, kb, out);
#else
            float s[16], o[16];
            column_scales(W, nb0 + b, kb * 32 / W->group, s, o);
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
            __m512 sv[4];
            tile_scales(s, o, sv);
            /* a chunk's dword c holds 4 k of column c; tile row 4j + q wants bytes 2q, 2q + 1 of
             * each dword (q < 2: low nibbles, else high): gather them as the rows' 32-byte halves */
            const __m512i pick = _mm512_set_epi8(  /* 4-bit chunks (int8 tiles are in place: above) */
                63, 62, 59, 58, 55, 54, 51, 50, 47, 46, 43, 42, 39, 38, 35, 34,
                31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2,
                61, 60, 57, 56, 53, 52, 49, 48, 45, 44, 41, 40, 37, 36, 33, 32,
                29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
            if (W->bits == 8) {
                const uint8_t *tile = W->codes + ((nb0 + b) * kblocks + kb) * 512;
                for (int p = 0; p < 16; ++p) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(tile + p * 32));
                    const __m512 f_lo = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), sv[0], sv[2]);
                    const __m512 f_hi = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), sv[1], sv[3]);
                    _mm512_storeu_si512(out + p * 32, (__m512i)_mm512_cvtne2ps_pbh(f_hi, f_lo));
                }
                continue;
            }
            const __m512i mask = _mm512_set1_epi8(0x0f);
            const __m512i table = e2m1_table();
            for (int j = 0; j < 4; ++j) {
                if (j == 2 && W->group < 32) {  /* 6-bit codes: the k block's second group of 16 */
                    column_scales(W, nb0 + b, (kb * 32 + 16) / W->group, s, o);
                    tile_scales(s, o, sv);
                }
                const __m512i bytes = _mm512_loadu_si512(W->codes + chunk_at(W->n, W->k, nb0 + b, kb * 4 + j));
                __m512i nibbles[2] = {_mm512_and_si512(bytes, mask), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask)};
                if (W->e2m1)
                    for (int h = 0; h < 2; ++h) nibbles[h] = _mm512_shuffle_epi8(table, nibbles[h]);
                if (W->bits == 6) {
                    const int64_t at = high_bits_at(W->n, W->k, nb0 + b, kb * 2 + j / 2);
                    const __m512i high = _mm512_loadu_si512(W->codes + at);
                    for (int h = 0; h < 2; ++h)
                        nibbles[h] = _mm512_or_si512(nibbles[h], high_pair(high, 2 * (j % 2) + h));
                }
                for (int h = 0; h < 2; ++h) {
                    const __m512i rows = _mm512_permutexvar_epi8(pick, nibbles[h]);  /* rows 4j + 2h, 4j + 2h + 1 */
                    for (int r = 0; r < 2; ++r) {
                        const __m256i u = r ? _mm512_extracti64x4_epi64(rows, 1) : _mm512_castsi512_si256(rows);
                        const __m512 f_lo = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u))), sv[0], sv[2]);
                        const __m512 f_hi = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u, 1))), sv[1], sv[3]);
                        _mm512_storeu_si512(out + (4 * j + 2 * h + r) * 32, (__m512i)_mm512_cvtne2ps_pbh(f_hi, f_lo));
                    }
                }
            }
#else
            for (int p = 0; p < 16; ++p) {
                if (p == 8 && W->group < 32) column_scales(W, nb0 + b, (kb * 32 + 16) / W->group, s, o);
                for (int i = 0; i < 32; ++i) {
                    const int c = i / 2;
                    const float u = W->bits == 8 ? (float)(int8_t)W->codes[((nb0 + b) * kblocks + kb) * 512 + p * 32 + i]
                                                 : (float)code4(W, nb0 + b, kb, c, 2 * p + i % 2);
                    out[p * 32 + i] = bf16_store(u * s[c] + o[c]);
                }
            }
#endif
#endif
        }
    return scratch;
}

#ifdef KILN_QUANT_GEMV_AVX512
/* A few rows of x (decode steps) straight from the codes, in integers. Converting codes to
 * floats instead ran 3x slower than the memory here. The integer sums are flushed to fp32 per
 * span of k, times scale * x's scale; a stored offset comes in times the span's sum of x, a
 * format's zero code (no stored offset) as -zero * sum(x8) in the integer sums (quant_layout.h).
 *   int8: each row of x in 16-bit fixed point (error at most 2^-15 of its largest value); a
 *   span is a group, or at most 512 k, before the sums could overflow. VPDPWSSD multiplies the
 *   tile order's code pairs (widened to 16 bits) by x pairs.
 *   4-bit: x in int8 blocks of 32 with a scale each, as llama.cpp's Q8 activations (bundled
 *   model, every linear on this path: perplexity 7.621 at its Q4_1, 7.603 with 16-bit x, 7.611
 *   in float32, llama.cpp's q4_1 7.620; W4A16 g64 10.735 against 10.718); a span is a block.
 *   VPDPBUSD multiplies a chunk's 4 codes of a column (unsigned bytes, one mask or shift from
 *   the load) by 4 bytes of x, so each 64-byte load feeds 2 instructions per row and nothing is
 *   widened: a row costs half what 16-bit x split in two bytes did, which matters past one row
 *   (verifying proposals, batches), where the GEMV is bound by these instructions rather than
 *   by memory. */
/* Beyond KILN_QUANT_GEMV_MAX_ROWS (quant_gemv.h), AMX int8 tiles with the GEMV's numbers take
 * 4- and 6-bit codes (quant_amx.c) up to KILN_QUANT_AMX_MAX_ROWS; else dequantized tiles on the
 * panel kernel win:
 * SmolLM2-135M Q4_1 on the AMX Xeon of docs/benchmark-log.md, linears of a decode step at 9 / 11 / 13 / 16 rows 11.2 / 12.0 / 14.1 /
 * 16.6 ms against the panel's 14.1 / 14.8 / 14.5 / 14.5 (with 16-bit x; 8-bit x moved the
 * crossover further). Covers a step verifying up to 11 proposals, whose rows then compute what
 * plain decode steps do. */

static inline __m512i bcast32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* MT rows (1-4) of x against NB output blocks (int8: 1 or 4; 4-bit: a whole panel, 1 or 2);
 * both constant once inlined. */
static inline __attribute__((always_inline)) void gemv_blocks(const kiln_qweight *W, const kiln_gemv_input *in,
                                                             int64_t t0, int MT, int64_t nb0, int NB, float *out) {
    const int64_t k = W->k, span = flush_span(W);
    const int32_t zero = (int32_t)folded_zero(W);
    /* A panel's codes are short (a few KB), too short for the hardware prefetcher to ramp up
     * on: each load prefetches the same spot of the next panel (this thread's next, but at the
     * end of its run), a whole panel ahead. */
    const int64_t next_panel = W->bits == 8 ? 4 * 16 * k : 2 * 16 * k / 2;  /* 6-bit: its nibbles */
    const uint8_t *panel = W->bits != 8 ? W->codes + chunk_at(W->n, k, nb0, 0) : NULL;
    const uint8_t *high_panel = W->bits == 6 ? W->codes + high_bits_at(W->n, k, nb0, 0) : NULL;
    __m512 total[4][4];
    for (int t = 0; t < MT; ++t)
        for (int b = 0; b < NB; ++b) total[t][b] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < k; k0 += span) {
        const int64_t k1 = k0 + span < k ? k0 + span : k;
        __m512i acc[4][4];
        for (int t = 0; t < MT; ++t)
            for (int b = 0; b < NB; ++b) acc[t][b] = _mm512_setzero_si512();
        if (W->bits == 8) {
            for (int64_t kb = k0 / 32; kb < k1 / 32; ++kb) {
                const uint8_t *tiles[4];
                for (int b = 0; b < NB; ++b) {
                    tiles[b] = W->codes + ((nb0 + b) * (k / 32) + kb) * 512;
                    _mm_prefetch((const char *)(tiles[b] + next_panel), _MM_HINT_T0);
                }
                for (int p = 0; p < 16; p += 2) {
                    for (int b = 0; b < NB; ++b) {
                        const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tiles[b] + p * 32)));
                        const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tiles[b] + p * 32 + 32)));
                        for (int t = 0; t < MT; ++t) {
                            const int16_t *xp = in->x16 + (t0 + t) * k + kb * 32 + 2 * p;
                            acc[t][b] = _mm512_dpwssd_epi32(acc[t][b], w0, bcast32(xp));
                            acc[t][b] = _mm512_dpwssd_epi32(acc[t][b], w1, bcast32(xp + 2));
                        }
                    }
                }
            }
        } else {
            const __m512i mask = _mm512_set1_epi8(0x0f), table = e2m1_table();
            for (int64_t j = k0 / 8; j < k1 / 8; ++j) {
                for (int b = 0; b < NB; ++b) {
                    const uint8_t *chunk = panel + (j * NB + b) * 64;
                    _mm_prefetch((const char *)(chunk + next_panel), _MM_HINT_T0);
                    const __m512i bytes = _mm512_loadu_si512(chunk);
                    __m512i low = _mm512_and_si512(bytes, mask);                       /* k 8j .. 8j + 3 */
                    __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);  /* k 8j + 4 .. */
                    if (W->e2m1) {
                        low = _mm512_shuffle_epi8(table, low);
                        high = _mm512_shuffle_epi8(table, high);
                    }
                    if (W->bits == 6) {  /* the high bits of both chunks of 16 k: 64 bytes */
                        const uint8_t *bits = high_panel + ((j / 2) * NB + b) * 64;
                        if (j % 2 == 0) _mm_prefetch((const char *)(bits + next_panel / 2), _MM_HINT_T0);
                        const __m512i hb = _mm512_loadu_si512(bits);
                        low = _mm512_or_si512(low, high_pair(hb, 2 * (j % 2)));
                        high = _mm512_or_si512(high, high_pair(hb, 2 * (j % 2) + 1));
                    }
                    for (int t = 0; t < MT; ++t) {
                        const int64_t at = (t0 + t) * k + 8 * j;
                        acc[t][b] = _mm512_dpbusd_epi32(acc[t][b], low, bcast32(in->x8 + at));
                        acc[t][b] = _mm512_dpbusd_epi32(acc[t][b], high, bcast32(in->x8 + at + 4));
                    }
                }
            }
        }
        const int64_t g = k0 / W->group, sp = k0 / span;
        for (int b = 0; b < NB; ++b) {
            __m512 sv, ov;
            load_block_scales(W, nb0 + b, g, &sv, &ov);
            for (int t = 0; t < MT; ++t) {
                const float xs = W->bits == 8 ? in->xscale[t0 + t] : in->xscale[(t0 + t) * in->spans + sp];
                const __m512 st = _mm512_mul_ps(sv, _mm512_set1_ps(xs));
                if (zero)
                    acc[t][b] = _mm512_sub_epi32(acc[t][b], _mm512_set1_epi32(zero * in->isum[(t0 + t) * in->spans + sp]));
                total[t][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][b]), st, total[t][b]);
                if (W->offsets)
                    total[t][b] = _mm512_fmadd_ps(ov, _mm512_set1_ps(in->xsum[(t0 + t) * in->spans + sp]), total[t][b]);
            }
        }
    }
    for (int t = 0; t < MT; ++t)
        for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + t * 64 + 16 * b, total[t][b]);
}

/* x as the GEMV reads it, in one allocation (returned). int8 weights: each row in 16-bit fixed
 * point, a scale per row, and the sum of each flush span's x as the kernel sees it. 4-bit
 * weights (6-bit: sums per 16): each block of 32 in int8 with a scale of its own (its largest value over 127, as
 * llama.cpp's Q8 blocks hold activations), and the block's sum as the kernel sees it: one
 * VPDPBUSD per code vector and row (16-bit x split in two bytes took two). Sixteen values a
 * vector: done serially before the threads start, a scalar loop here cost as much as the GEMV
 * of a small layer. */
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
            for (int64_t i = 0; i < k; i += 32) {  /* a block of 32 (k is a multiple of 32): one span, or two (6-bit) */
                const __m512 a = load16_bf16(xr + i), b = load16_bf16(xr + i + 16);
                const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
                const float scale = amax > 0.f ? amax / 127.f : 1.f;
                const __m512 inv = _mm512_set1_ps(1.f / scale);
                const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  /* to nearest even */
                const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
                _mm_storeu_si128((__m128i *)(x8 + t * k + i), _mm512_cvtsepi32_epi8(qa));
                _mm_storeu_si128((__m128i *)(x8 + t * k + i + 16), _mm512_cvtsepi32_epi8(qb));
                if (span == 16) {
                    xscale[t * spans + i / 16] = xscale[t * spans + i / 16 + 1] = scale;
                    isum[t * spans + i / 16] = _mm512_reduce_add_epi32(qa);
                    isum[t * spans + i / 16 + 1] = _mm512_reduce_add_epi32(qb);
                    xsum[t * spans + i / 16] = (float)isum[t * spans + i / 16] * scale;
                    xsum[t * spans + i / 16 + 1] = (float)isum[t * spans + i / 16 + 1] * scale;
                } else {
                    xscale[t * spans + i / 32] = scale;
                    isum[t * spans + i / 32] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
                    xsum[t * spans + i / 32] = (float)isum[t * spans + i / 32] * scale;
                }
            }
            continue;
        }
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 16)  /* k is a multiple of 32 */
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16_bf16(xr + i)));
        const float amax = _mm512_reduce_max_ps(vmax);
        xscale[t] = amax > 0.f ? amax / 16383.f : 1.f;  /* 15 bits: a pair's products stay in int32 */
        const __m512 s = _mm512_set1_ps(xscale[t]);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < k; i += 16) {
            /* rounded to nearest even, as lrintf does in the default rounding mode */
            const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load16_bf16(xr + i), s));
            _mm256_storeu_si256((__m256i *)(x16 + t * k + i), _mm512_cvtepi32_epi16(q));
            sum = _mm512_add_epi32(sum, q);
            if ((i + 16) % span == 0) {  /* the span's sum of x as the kernel sees it */
                xsum[t * spans + (i + 16) / span - 1] = (float)_mm512_reduce_add_epi32(sum) * xscale[t];
                sum = _mm512_setzero_si512();
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

/* 4-bit, one panel (1 or 2 blocks); int8, a full panel of 4 at once, a last panel's 1-3 blocks
 * one at a time. */
void kiln_quant_gemv_tile(const kiln_qweight *W, const kiln_gemv_input *in, int64_t t0, int mt, int64_t nb0,
                          int blocks, float *out) {
#define ROWS(MT)                                                                                   \
    if (W->bits != 8) {                                                                            \
        if (blocks == 2) gemv_blocks(W, in, t0, MT, nb0, 2, out);                                  \
        else gemv_blocks(W, in, t0, MT, nb0, 1, out);                                              \
    } else if (blocks == 4) gemv_blocks(W, in, t0, MT, nb0, 4, out);                               \
    else for (int b = 0; b < blocks; ++b) gemv_blocks(W, in, t0, MT, nb0 + b, 1, out + 16 * b);
    KILN_GEMV_ROWS(mt, ROWS)
#undef ROWS
}
#endif

/* Up to how many rows a call's rows of 4- or 6-bit codes equal the same rows in smaller calls,
 * bit for bit: the GEMV's rows, and on AMX the int8 tiles' with the GEMV's arithmetic. */
int64_t kiln_quant_batch_invariant_rows(void) {
#ifdef KILN_HAVE_QUANT_GEMV
#ifdef KILN_QUANT_GEMV_AVX512
    if (kiln_amx_available() && KILN_QUANT_AMX_MAX_ROWS > KILN_QUANT_GEMV_MAX_ROWS) return KILN_QUANT_AMX_MAX_ROWS;
#endif
    return KILN_QUANT_GEMV_MAX_ROWS;
#else
    return 0;
#endif
}

#ifdef KILN_HAVE_QUANT_GEMV
int64_t kiln_quant_gemv_unit(const kiln_qweight *W) { return W->bits == 8 ? 4 : 2; }

typedef struct {
    const kiln_qweight *W;
    const kiln_gemv_input *in;
} quant_tile_ctx;

static void quant_tile(const void *ctx, int64_t t0, int mt, int64_t nb0, int blocks, float *out) {
    const quant_tile_ctx *c = ctx;
    kiln_quant_gemv_tile(c->W, c->in, t0, mt, nb0, blocks, out);
}

static void quant_gemv(const bf16_t *x, const kiln_qweight *W, const bf16_t *bias, bf16_t *y, int64_t m,
                       int num_threads) {
    kiln_gemv_input in;
    void *mem = kiln_quant_gemv_prepare(x, W, m, &in);
    const quant_tile_ctx ctx = {W, &in};
    kiln_gemv_panels(quant_tile, &ctx, bias, NULL, y, m, W->n, W->bits == 8 ? 1 : 2, num_threads);
    free(mem);
}
#endif

/* group 0: int8 codes with float32 scales per output channel; else float16 scales (and offsets,
 * or NULL) per group of k. bits: 8, 6 or 4, or'd with KILN_SCALES_SUPER (super-block scales and
 * offsets) and, for 4, KILN_CODES_E2M1. */
void kiln_quant_linear_bf16(const bf16_t *x, const uint8_t *codes, const void *scales, const void *offsets,
                            int64_t bits, int64_t group, const bf16_t *bias, bf16_t *y, int64_t m, int64_t n,
                            int64_t k, int num_threads) {
    const kiln_qweight W = {codes, group ? NULL : scales, group ? scales : NULL, group ? offsets : NULL,
                            n, k, group ? group : k, bits & 0xff, (bits & KILN_CODES_E2M1) != 0,
                            group && (bits & KILN_SCALES_SUPER) != 0};
#ifdef KILN_HAVE_QUANT_GEMV
    if (m <= KILN_QUANT_GEMV_MAX_ROWS) {
        quant_gemv(x, &W, bias, y, m, num_threads);
        return;
    }
    if (kiln_quant_amx_linear(x, &W, bias, y, m, num_threads)) return;
#endif
    kiln_linear_panels(x, dequant_panel, &W, bias, NULL, y, m, n, k, num_threads);
}
