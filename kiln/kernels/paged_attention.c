/* Decode attention straight from the paged KV cache (one query token per row).
 *
 * The PyTorch reference backend copies every sequence's K/V blocks into a padded tensor
 * before each layer's attention; on a CPU that copy costs as much as the attention itself.
 * Here each sequence walks its block table and reads K/V in place, with a block-wise online
 * softmax, so the cache is read once per layer. Rows at consecutive positions of one sequence
 * (a speculative step verifying proposed tokens) read it once for all of them, each row's
 * queries masked past its own position: verifying 11 tokens at 1000 tokens of context, 32 KV
 * heads of 64, went from 47 to 24 ms a step (Intel Xeon, AMX; 2 threads).
 *
 * Layouts (row-major, contiguous):
 *   q, out        [num_tokens, num_heads, head_size]   rows picked by token_index; q's rows
 *                 may be strided (q_stride elements apart: a view into the fused qkv output)
 *   k/v cache     [num_blocks, num_kv_heads, block_size, head_size]   q's type, or int8 codes
 *                 (the _i8 variants) or float8 e4m3 codes (the _f8 variants), dequantized by
 *                 k_scale / v_scale. A KV head's rows of a block are one contiguous run, read
 *                 front to back.
 *   block_tables  [num_seqs, max_blocks] int64
 *   seq_lens      [num_seqs] int64  (tokens in the cache, the new one included)
 * Query heads are grouped onto KV heads as in GQA: head h reads KV head h / (H / KVH).
 *
 * Optional, per call (one layer's settings): a sliding window (window > 0: a sequence of
 * length L attends to its last `window` tokens, L - window .. L - 1, reading from the first of
 * them, which may lie mid-block); attention logit soft-capping (softcap > 0: score =
 * softcap * tanh(score / softcap), after scaling); ALiBi (alibi_slopes, one per query head, or
 * NULL: score += slope * (key position - query position), added after the soft-cap).
 *
 * Built by kiln/kernels/__init__.py with -O3 -march=native -ffast-math -fopenmp (linked without
 * -ffast-math, which would set flush-to-zero process-wide); OpenMP resolves to the
 * libgomp torch has already loaded, so both share one thread pool.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"

/* The next run of cache rows (one KV head's K or V rows of a block), asked for a few lines at a
 * time from inside the loops computing on the current one. A software prefetch that finds every
 * fill buffer busy stalls the core, so asking for a whole run at once left the arithmetic
 * waiting behind it; paced by the rows being computed on, loads and arithmetic overlap. Lines
 * go to L2 (prefetcht2), which measured 4-7% faster than into L1. 8K context on the Xeon of
 * docs/benchmark-log.md (benchmarks/attention_kernel.py): 32 KV heads of 64 21.4 -> 23.3 GB/s,
 * 8 KV heads of 128 with 4 query heads each 13.7 -> 17.2. */
typedef struct {
    const char *next, *end;
    int64_t lines_per_row;
} prefetch_cursor;

static inline __attribute__((always_inline)) void prefetch_rows(prefetch_cursor *c, int64_t rows) {
    for (int64_t i = 0; i < rows * c->lines_per_row && c->next < c->end; ++i, c->next += 64)
        __builtin_prefetch(c->next, 0, 1);
}

/* Scores q . k of a block's tokens in groups of 16, the last group padded with zero rows (out
 * holds whole groups), so a token's score comes out of the same arithmetic wherever the block
 * ends: a step verifying proposals sees further into a block than a plain decode step and must
 * compute the same scores. Returns ntok, or 0 where it does not apply (the caller's loop runs).
 * A dot product per token ends in a horizontal sum, which dominated the kernel; here 16 tokens'
 * partial-sum vectors are reduced together by a transpose-and-add tree (~3 instructions a token
 * instead of ~10). */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)));
}
/* 16 float8 e4m3 codes, exactly, through fp16: the byte sign-extended to 16 bits and shifted
 * left by 7 has the sign at bit 15 and exponent and mantissa where fp16 keeps them (bits 10-13,
 * 7-9); bit 14, a copy of the sign, is cleared. fp16's exponent bias is 15, e4m3's 7, so that
 * half is the code's value times 2^-8, subnormals included, and the multiply by 2^8 is exact
 * (fp16 subnormals convert to normal fp32: nothing here meets denormals-are-zero). */
static inline __m512 load16_f8(const fp8_t *p) {
    const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)p)), 7);
    const __m512 v = _mm512_cvtph_ps(_mm256_and_si256(x, _mm256_set1_epi16((short)0xbfff)));
    return _mm512_mul_ps(v, _mm512_set1_ps(256.f));
}

/* Lane j of the result is the sum of the lanes of v[j]. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
    const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

#define DEFINE_SCORES16(SUFFIX, T)                                                                 \
static inline __attribute__((always_inline)) int64_t scores16_##SUFFIX(                           \
        const float *q, const T *kb, int64_t ntok, const int64_t D, float *out, prefetch_cursor *pf) { \
    if (D % 16 != 0) return 0;                                                                     \
    for (int64_t t = 0; t < ntok; t += 16) {                                                       \
        __m512 v[16];                                                                              \
        for (int j = 0; j < 16; ++j) {                                                             \
            const T *kt = kb + (t + j) * D;                                                        \
            __m512 acc = _mm512_setzero_ps();                                                      \
            if (t + j < ntok) {  /* past the block's tokens: a zero score, never read */           \
                prefetch_rows(pf, 1);                                                              \
                for (int64_t d = 0; d < D; d += 16)                                                \
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_##SUFFIX(kt + d), acc);  \
            }                                                                                      \
            v[j] = acc;                                                                            \
        }                                                                                          \
        _mm512_storeu_ps(out + t, reduce16(v));                                                    \
    }                                                                                              \
    return ntok;                                                                                   \
}
DEFINE_SCORES16(f32, float)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const bf16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* AVX2: each token's dot product in eight lanes, in one order whatever surrounds it. The
 * compiler-vectorized loop peeled a few elements by the stack's alignment, which differs
 * between a run of rows and a row alone, and so rounded their scores differently. */
#define DEFINE_SCORES8(SUFFIX, T)                                                                  \
static inline __attribute__((always_inline)) int64_t scores16_##SUFFIX(                           \
        const float *q, const T *kb, int64_t ntok, const int64_t D, float *out, prefetch_cursor *pf) { \
    if (D % 8 != 0) return 0;                                                                      \
    for (int64_t t = 0; t < ntok; ++t) {                                                           \
        const T *kt = kb + t * D;                                                                  \
        prefetch_rows(pf, 1);                                                                      \
        __m256 acc = _mm256_setzero_ps();                                                          \
        for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8_##SUFFIX(kt + d), acc); \
        out[t] = hsum8(acc);                                                                       \
    }                                                                                              \
    return ntok;                                                                                   \
}
DEFINE_SCORES8(f32, float)
#else
#define scores16_f32(q, kb, ntok, D, out, pf) ((int64_t)0)
#endif
#define scores16_none(q, kb, ntok, D, out, pf) ((int64_t)0)

/* Scores of every query head of a GQA group, one head at a time: q [group, D] (float, unscaled),
 * scores [group, score_stride]. Returns ntok, or 0 where the vector kernel does not apply. */
#define DEFINE_GROUP_SCORES(SUFFIX, T, SCORES16)                                                   \
static inline __attribute__((always_inline)) int64_t group_scores_##SUFFIX(                       \
        const float *q, const T *kb, int64_t ntok, const int64_t D, int64_t group, float *scores,  \
        int64_t score_stride, prefetch_cursor *pf) {                                               \
    int64_t t = 0;                                                                                 \
    for (int64_t g = 0; g < group; ++g) t = SCORES16(q + g * D, kb, ntok, D, scores + g * score_stride, pf); \
    return t;                                                                                      \
}
DEFINE_GROUP_SCORES(f32, float, scores16_f32)

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* bf16 K against q rounded to bf16 (exact: q came from bf16) with AVX512-BF16 dot products (fp32
 * accumulation), G query heads at once: each K row is loaded once for all of them. G is a
 * compile-time constant (see group_scores_bf16), so the heads' q vectors stay in registers. */
static inline __attribute__((always_inline)) int64_t scores16_bf16_heads(
        const float *q, const bf16_t *kb, int64_t ntok, const int64_t D, const int G, float *scores,
        int64_t score_stride, prefetch_cursor *pf) {
    __m512bh qb[G][8];
    for (int g = 0; g < G; ++g)
        for (int64_t c = 0; c < D / 32; ++c)
            qb[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * D + 32 * c + 16), _mm512_loadu_ps(q + g * D + 32 * c));
    for (int64_t t = 0; t < ntok; t += 16) {
        __m512 v[G][16];
        for (int j = 0; j < 16; ++j) {
            const bf16_t *kt = kb + (t + j) * D;
            __m512bh k[8];
            for (int64_t c = 0; c < D / 32; ++c)  /* past the block's tokens: zero rows, never read */
                k[c] = (__m512bh)(t + j < ntok ? _mm512_loadu_si512(kt + 32 * c) : _mm512_setzero_si512());
            if (t + j < ntok) prefetch_rows(pf, 1);
            for (int g = 0; g < G; ++g) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, qb[g][c], k[c]);
                v[g][j] = acc;
            }
        }
        for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * score_stride + t, reduce16(v[g]));
    }
    return ntok;
}

DEFINE_SCORES16(bf16, bf16_t)

/* The group in runs of up to 4 heads, each run with its head count a constant; heads of a size
 * the bf16 dot products do not take (a multiple of 16, not of 32: Phi-2's 80) one at a time in
 * fp32. */
static inline __attribute__((always_inline)) int64_t group_scores_bf16(
        const float *q, const bf16_t *kb, int64_t ntok, const int64_t D, int64_t group, float *scores,
        int64_t score_stride, prefetch_cursor *pf) {
    int64_t t = 0;
    if (D % 32 != 0 || D > 256) {
        for (int64_t g = 0; g < group; ++g) t = scores16_bf16(q + g * D, kb, ntok, D, scores + g * score_stride, pf);
        return t;
    }
    for (int64_t g = 0; g < group; g += 4) {
        const float *qg = q + g * D;
        float *sg = scores + g * score_stride;
        switch (group - g < 4 ? group - g : 4) {
        case 1: t = scores16_bf16_heads(qg, kb, ntok, D, 1, sg, score_stride, pf); break;
        case 2: t = scores16_bf16_heads(qg, kb, ntok, D, 2, sg, score_stride, pf); break;
        case 3: t = scores16_bf16_heads(qg, kb, ntok, D, 3, sg, score_stride, pf); break;
        default: t = scores16_bf16_heads(qg, kb, ntok, D, 4, sg, score_stride, pf);
        }
    }
    return t;
}

/* acc[g] = acc[g] * rescale[g] + sum_t p[g][t] V[t] for G heads with AVX512-BF16 dot products
 * over token pairs: V rows t and t+1 interleaved (unpack) meet each head's pair (p[t], p[t+1])
 * rounded to bf16, so V is never converted to fp32, and each V row is loaded and interleaved
 * once for all G heads. The unpack leaves each 32-dim chunk's sums in a permuted order [0-3,
 * 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31]; acc stays in that order for the whole range
 * (rescaling does not care) and pv_unpermute restores it at the end. `pairs` holds each head's
 * weights as bf16 pairs, pair_stride apart, a zero after an odd count. */
static inline __attribute__((always_inline)) void pv_bf16_heads(
        const uint32_t *pairs, int64_t pair_stride, const bf16_t *vb, int64_t ntok, const int64_t D,
        const int G, const float *rescale, float *acc, prefetch_cursor *pf) {
    const int64_t full = ntok / 2;
    for (int64_t c = 0; c < D / 32; ++c) {
        __m512 lo_acc[G], hi_acc[G];
        for (int g = 0; g < G; ++g) {
            const __m512 r = _mm512_set1_ps(rescale[g]);
            lo_acc[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 32 * c), r);
            hi_acc[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 32 * c + 16), r);
        }
        const bf16_t *v0 = vb + 32 * c;
        for (int64_t i = 0; i <= full; ++i, v0 += 2 * D) {
            if (i == full && !(ntok & 1)) break;
            prefetch_rows(pf, 2);
            const __m512i x = _mm512_loadu_si512(v0);
            /* Past the last token: a zero row, weight 0. */
            const __m512i y = i < full ? _mm512_loadu_si512(v0 + D) : _mm512_setzero_si512();
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
            for (int g = 0; g < G; ++g) {
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pairs[g * pair_stride + i]);
                lo_acc[g] = _mm512_dpbf16_ps(lo_acc[g], lo, pp);
                hi_acc[g] = _mm512_dpbf16_ps(hi_acc[g], hi, pp);
            }
        }
        for (int g = 0; g < G; ++g) {
            _mm512_storeu_ps(acc + g * D + 32 * c, lo_acc[g]);
            _mm512_storeu_ps(acc + g * D + 32 * c + 16, hi_acc[g]);
        }
    }
}

/* P V for the whole group (p: each head's exp-weights, p_stride apart, read up to ntok rounded up
 * to even: the caller leaves a zero after an odd count). Returns 0 where it does not apply (the
 * caller's loop runs); called with p == NULL it only says whether it applies, so the caller knows
 * to unpermute. */
static inline __attribute__((always_inline)) int group_pv_bf16(
        const float *p, int64_t p_stride, const bf16_t *vb, int64_t ntok, const int64_t D, int64_t group,
        const float *rescale, float *acc, prefetch_cursor *pf) {
    if (D % 32 != 0) return 0;
    if (p == NULL) return 1;
    const int64_t npairs = (ntok + 1) / 2, pair_stride = (p_stride + 1) / 2;
    uint32_t pairs[group * pair_stride];
    for (int64_t g = 0; g < group; ++g) {
        const float *pg = p + g * p_stride;
        bf16_t *out = (bf16_t *)(pairs + g * pair_stride);
        int64_t t = 0;
        for (; t + 16 <= 2 * npairs; t += 16)
            _mm256_storeu_si256((void *)(out + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pg + t)));
        for (; t < 2 * npairs; ++t) out[t] = bf16_store(pg[t]);
    }
    for (int64_t g = 0; g < group; g += 4) {
        const uint32_t *pr = pairs + g * pair_stride;
        float *ag = acc + g * D;
        switch (group - g < 4 ? group - g : 4) {
        case 1: pv_bf16_heads(pr, pair_stride, vb, ntok, D, 1, rescale + g, ag, pf); break;
        case 2: pv_bf16_heads(pr, pair_stride, vb, ntok, D, 2, rescale + g, ag, pf); break;
        case 3: pv_bf16_heads(pr, pair_stride, vb, ntok, D, 3, rescale + g, ag, pf); break;
        default: pv_bf16_heads(pr, pair_stride, vb, ntok, D, 4, rescale + g, ag, pf);
        }
    }
    return 1;
}

static inline void pv_unpermute(float *acc, int64_t D) {
    for (int64_t c = 0; c < D / 32; ++c) {
        const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
        const __m512 first = _mm512_shuffle_f32x4(lo, hi, 0x44), second = _mm512_shuffle_f32x4(lo, hi, 0xEE);
        _mm512_storeu_ps(acc + 32 * c, _mm512_shuffle_f32x4(first, first, 0xD8));
        _mm512_storeu_ps(acc + 32 * c + 16, _mm512_shuffle_f32x4(second, second, 0xD8));
    }
}
#else
#if defined(__AVX512F__)
DEFINE_SCORES16(bf16, bf16_t)
DEFINE_GROUP_SCORES(bf16, bf16_t, scores16_bf16)
#elif defined(__AVX2__) && defined(__FMA__)
DEFINE_SCORES8(bf16, bf16_t)
DEFINE_GROUP_SCORES(bf16, bf16_t, scores16_bf16)
#else
DEFINE_GROUP_SCORES(bf16, bf16_t, scores16_none)
#endif
#define group_pv_bf16(p, p_stride, vb, ntok, D, group, rescale, acc, pf) 0
static inline void pv_unpermute(float *acc, int64_t D) { (void)acc; (void)D; }
#endif
#define no_group_pv(p, p_stride, vb, ntok, D, group, rescale, acc, pf) 0

/* A quantized cache's run of rows (int8 or float8 codes) converted once into `buf` in the
 * query's type, so every query head of a GQA group reads it through
 * the float kernel's loops (bf16: AVX512-BF16 dot products) instead of converting each code once
 * per head. Exact: every int8 and every e4m3 value is a bf16 value, and an fp32 one. Float
 * caches are read in place (no_stage). */
#if defined(__AVX512F__)
static inline void store16_f32(float *d, __m512 v) { _mm512_storeu_ps(d, v); }
/* Truncating to the top 16 bits is exact for values bf16 holds exactly. */
static inline void store16_bf16(bf16_t *d, __m512 v) {
    _mm256_storeu_si256((void *)d, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#define STAGE16(KSUF, CSUF) for (; i + 16 <= n; i += 16) store16_##CSUF(buf + i, load16_##KSUF(src + i));
#else
#define STAGE16(KSUF, CSUF)
#endif
#define DEFINE_STAGE(KSUF, KT, KLOAD, CSUF, CT, CSTORE)                                            \
static inline __attribute__((always_inline)) const CT *stage_##KSUF##_##CSUF(                      \
        const KT *src, int64_t n, CT *buf) {                                                       \
    int64_t i = 0;                                                                                 \
    STAGE16(KSUF, CSUF)                                                                            \
    for (; i < n; ++i) buf[i] = CSTORE(KLOAD(src[i]));                                             \
    return buf;                                                                                    \
}
DEFINE_STAGE(i8, int8_t, i8_load, f32, float, f32_store)
DEFINE_STAGE(i8, int8_t, i8_load, bf16, bf16_t, bf16_store)
DEFINE_STAGE(f8, fp8_t, fp8_load, f32, float, f32_store)
DEFINE_STAGE(f8, fp8_t, fp8_load, bf16, bf16_t, bf16_store)
#define no_stage(src, n, buf) ((void)(buf), (src))

/* A per-thread buffer that grows as needed and is kept: allocating (and page-faulting) it
 * on every call would cost more than the merge it serves. */
static void *scratch(size_t bytes) {
    static __thread void *buffer = NULL;
    static __thread size_t capacity = 0;
    if (bytes > capacity) {
        void *grown = realloc(buffer, bytes);
        if (!grown) return NULL;
        buffer = grown;
        capacity = bytes;
    }
    return buffer;
}

/* Softmax's two passes over a block's scores of one query head: scale_max scales s[0..n) and
 * returns the larger of m and their maximum; exp_sum sets s[i] = exp(s[i] - m) and returns their
 * sum. Sixteen lanes at a time with an inline exp (2^f for the fraction f of x log2(e), a
 * degree-6 polynomial, relative error ~2e-7, times 2^n by scalef): the library's vector expf
 * is a call per 8 floats, and with a verifying step's queries the calls took half the kernel. */
#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  /* |f| <= ln2 / 2 */
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline float scale_max(float *s, int64_t n, float scale, float m) {
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 vm = _mm512_set1_ps(m);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), vs);
        _mm512_mask_storeu_ps(s + i, k, x);
        vm = _mm512_mask_max_ps(vm, k, vm, x);
    }
    return _mm512_reduce_max_ps(vm);
}

static inline float exp_sum(float *s, int64_t n, float m) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm));
        _mm512_mask_storeu_ps(s + i, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same in eight lanes. Every score goes through the one vector exp, whatever its place: a
 * compiler-vectorized expf loop took a scalar expf for the elements it peeled or left over, so
 * a row's scores rounded differently when its row of the scratch sat at another alignment (a
 * row in a verifying step's run against the same row alone). */
static inline __m256 exp8(__m256 x) {
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(1.44269504f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147181f));
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    /* 2^n as a float's exponent field (x - m <= 0 here, and n >= -126 after the clamp) */
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

static inline __m256i lanes_below(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float scale_max(float *s, int64_t n, float scale, float m) {
    const __m256 vs = _mm256_set1_ps(scale);
    __m256 vm = _mm256_set1_ps(m);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i k = lanes_below(n - i);
        const __m256 x = _mm256_mul_ps(_mm256_maskload_ps(s + i, k), vs);
        _mm256_maskstore_ps(s + i, k, x);
        vm = _mm256_blendv_ps(vm, _mm256_max_ps(vm, x), _mm256_castsi256_ps(k));
    }
    return hmax8(vm);
}

static inline float exp_sum(float *s, int64_t n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i k = lanes_below(n - i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(s + i, k), vm));
        _mm256_maskstore_ps(s + i, k, e);
        sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(k)));
    }
    return hsum8(sum);
}
#else
static inline float scale_max(float *s, int64_t n, float scale, float m) {
    for (int64_t i = 0; i < n; ++i) { s[i] *= scale; m = s[i] > m ? s[i] : m; }
    return m;
}

static inline float exp_sum(float *s, int64_t n, float m) {
    float sum = 0.f;
    _Pragma("omp simd reduction(+:sum)")
    for (int64_t i = 0; i < n; ++i) { s[i] = expf(s[i] - m); sum += s[i]; }
    return sum;
}
#endif

/* The optional score adjustments of a block: scale, soft-cap, ALiBi bias (pos0 is the first
 * token's position relative to the query, <= 0). Separate from the plain scaling loop so
 * layers without them keep it as it was. */
static inline void adjust_scores(float *sg, int64_t ntok, float scale, float softcap, const float *slope,
                                 int64_t pos0) {
    if (softcap > 0.f) {
        const float inv = 1.f / softcap;
        for (int64_t i = 0; i < ntok; ++i) sg[i] = softcap * tanhf(sg[i] * scale * inv);
    } else {
        for (int64_t i = 0; i < ntok; ++i) sg[i] *= scale;
    }
    if (slope)
        for (int64_t i = 0; i < ntok; ++i) sg[i] += *slope * (float)(pos0 + i);
}

/* The most query floats (rows x query heads of a KV head x head size) one run of rows takes
 * together: its queries, scores and state live on the stack of the thread computing them. */
#define MAX_RUN_QUERY_FLOATS (64 * 128)

/* A row's context is computed in ranges at fixed places: the first RANGE_TOKENS tokens (whole
 * blocks, at least one), then ranges doubling in length (RANGE_TOKENS .. 2 RANGE_TOKENS, then
 * .. 4 RANGE_TOKENS, ...): short contexts still make several tasks, long ones a few long
 * streams. Range i starts at block range_begin(i, per), per the blocks of the first. */
#define RANGE_TOKENS 256

static inline int64_t range_begin(int64_t i, int64_t per) { return i == 0 ? 0 : per << (i - 1); }

/* Splits rows 0..num_seqs-1 into runs, run i being rows start[i] .. start[i + 1] - 1, and returns
 * how many: a row joins the run before it when it is the next position of the same sequence
 * (one token longer, the same blocks), so one K/V read serves the whole run. Without a window
 * reaching into the run and without ALiBi, whose terms depend on the query's position. */
static int64_t find_runs(const int64_t *tables, const int64_t *lens, int64_t num_seqs, int64_t max_blocks,
                         int64_t block_size, int64_t group, int64_t D, int64_t window, int alibi, int64_t *start) {
    int64_t runs = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int joins = s > 0 && !alibi && lens[s] == lens[s - 1] + 1 && (window <= 0 || lens[s] <= window) &&
                          (s - start[runs - 1] + 1) * group * D <= MAX_RUN_QUERY_FLOATS &&
                          memcmp(tables + s * max_blocks, tables + (s - 1) * max_blocks,
                                 sizeof(int64_t) * ((lens[s - 1] + block_size - 1) / block_size)) == 0;
        if (!joins) start[runs++] = s;
    }
    start[runs] = num_seqs;
    return runs;
}

/* Attention state of one (sequence, KV head) over a range of its blocks, unnormalised: per
 * query head of the group the running max, the running sum of exp(score - max), and the
 * exp-weighted sum of values. Ranges of one sequence merge exactly (see merge_parts). Tokens
 * before `first` (outside a sliding window) are skipped; `slopes` are the group's ALiBi slopes.
 * Inlined with a constant head size where possible, so the d-loops unroll and q/acc stay in
 * vector registers across the token loops. */
#define DEFINE_DECODE_KERNEL(NAME, T, LOAD, STORE, KT, STAGE, CT, CLOAD, VEC_SCORES, VEC_PV)                         \
static inline __attribute__((always_inline)) void NAME##_part(                                     \
        const T *q, const KT *k_cache, const KT *v_cache, const int64_t *table, int64_t len,       \
        int64_t b_begin, int64_t b_end, int64_t group, int64_t num_kv_heads, int64_t kvh,          \
        int64_t block_size, float scale, const int64_t D, int64_t first, const float *slopes,      \
        float softcap, const int64_t *limits, float *run_max, float *run_sum, float *acc) {        \
    /* Scores in whole groups of 16 tokens (see scores16), plus the zero after an odd count. */    \
    const int64_t score_stride = (block_size + 15) / 16 * 16 + 1;                                  \
    float qf[group * D], scores[group * score_stride];                                             \
    /* Codes (KT) are staged per block into CT rows; a float cache is read in place. */            \
    const int staged = sizeof(KT) != sizeof(CT);                                                   \
    CT k_rows[staged ? block_size * D : 1], v_rows[staged ? block_size * D : 1];                   \
    for (int64_t g = 0; g < group; ++g) {                                                          \
        /* Unscaled, so a bf16 q converts back to bf16 exactly for bf16 dot products. */         \
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = LOAD(q[g * D + d]);                        \
        run_max[g] = -1e30f; /* finite (built with -ffast-math); exp(-1e30 - m) is 0 */           \
        run_sum[g] = 0.f;                                                                          \
    }                                                                                              \
    memset(acc, 0, sizeof(float) * group * D);                                                     \
    const int64_t row_lines = (D * (int64_t)sizeof(KT) + 63) / 64;                                 \
    for (int64_t b = b_begin; b < b_end; ++b) {                                                    \
        /* The window's first token may lie mid-block: start the block there. */                   \
        const int64_t t0 = b * block_size < first ? first - b * block_size : 0;                    \
        const int64_t ntok = (len - b * block_size < block_size ? len - b * block_size : block_size) - t0;\
        const int64_t at = ((table[b] * num_kv_heads + kvh) * block_size + t0) * D;                \
        /* This block's V rows are asked for while its scores are computed, the next block's K     \
         * rows while its values are summed (the first block's K rows all at once). */             \
        const KT *k_run = k_cache + at, *v_run = v_cache + at;                                     \
        if (b == b_begin) {                                                                        \
            prefetch_cursor first_k = {(const char *)k_run, (const char *)(k_run + ntok * D), row_lines};\
            prefetch_rows(&first_k, ntok);                                                         \
        }                                                                                          \
        prefetch_cursor this_v = {(const char *)v_run, (const char *)(v_run + ntok * D), row_lines};\
        prefetch_cursor next_k = {NULL, NULL, row_lines};                                          \
        if (b + 1 < b_end) {                                                                       \
            const int64_t n1 = len - (b + 1) * block_size < block_size ? len - (b + 1) * block_size : block_size;\
            const KT *k1 = k_cache + (table[b + 1] * num_kv_heads + kvh) * block_size * D;         \
            next_k.next = (const char *)k1;                                                        \
            next_k.end = (const char *)(k1 + n1 * D);                                              \
        }                                                                                          \
        const CT *kb = STAGE(k_run, ntok * D, k_rows);                                             \
        /* Every head's scores first (the group's heads share each K row), then each head's        \
         * online-softmax update, then every head's weighted V sum (sharing each V row). */        \
        const int64_t done = VEC_SCORES(qf, kb, ntok, D, group, scores, score_stride, &this_v);    \
        float rescale[group];                                                                      \
        for (int64_t g = 0; g < group; ++g) {                                                      \
            const float *qg = qf + g * D;                                                          \
            float *sg = scores + g * score_stride;                                                 \
            float m = run_max[g];                                                                  \
            /* A query sees the tokens before its own limit only; the rest weigh 0. */             \
            const int64_t lim = limits ? limits[g] - b * block_size - t0 : ntok;                   \
            const int64_t vis = lim < 0 ? 0 : lim < ntok ? lim : ntok;                             \
            for (int64_t t = done; t < vis; ++t) {                                                 \
                const CT *kt = kb + t * D;                                                         \
                prefetch_rows(&this_v, 1);                                                         \
                float dot = 0.f;                                                                   \
                _Pragma("omp simd reduction(+:dot)")                                               \
                for (int64_t d = 0; d < D; ++d) dot += qg[d] * CLOAD(kt[d]);                       \
                sg[t] = dot;                                                                       \
            }                                                                                      \
            if (softcap > 0.f || slopes) {                                                         \
                adjust_scores(sg, vis, scale, softcap, slopes ? slopes + g : NULL, b * block_size + t0 - (len - 1));\
                for (int64_t i = 0; i < vis; ++i) m = sg[i] > m ? sg[i] : m;                       \
            } else {                                                                               \
                m = scale_max(sg, vis, scale, m);                                                  \
            }                                                                                      \
            rescale[g] = expf(run_max[g] - m);                                                     \
            const float sum = exp_sum(sg, vis, m);                                                 \
            for (int64_t i = vis; i <= ntok; ++i) sg[i] = 0.f; /* and after an odd count, for pairwise sums */ \
            run_max[g] = m;                                                                        \
            run_sum[g] = run_sum[g] * rescale[g] + sum;                                            \
        }                                                                                          \
        const CT *vb = STAGE(v_run, ntok * D, v_rows);                                             \
        if (VEC_PV(scores, score_stride, vb, ntok, D, group, rescale, acc, &next_k)) continue;     \
        for (int64_t g = 0; g < group; ++g) {                                                      \
            const float *sg = scores + g * score_stride;                                           \
            float *ag = acc + g * D, a[D];                                                         \
            for (int64_t d = 0; d < D; ++d) a[d] = ag[d] * rescale[g];                             \
            for (int64_t i = 0; i < ntok; ++i) {                                                   \
                const CT *vt = vb + i * D;                                                         \
                prefetch_rows(&next_k, 1);                                                         \
                const float p = sg[i];                                                             \
                _Pragma("omp simd")                                                                \
                for (int64_t d = 0; d < D; ++d) a[d] += p * CLOAD(vt[d]);                          \
            }                                                                                      \
            for (int64_t d = 0; d < D; ++d) ag[d] = a[d];                                          \
        }                                                                                          \
    }                                                                                              \
    if (VEC_PV(NULL, 0, NULL, 0, D, group, NULL, NULL, NULL))                                      \
        for (int64_t g = 0; g < group; ++g) pv_unpermute(acc + g * D, D);                          \
}                                                                                                  \
                                                                                                   \
/* NAME##_part with the head size as a compile-time constant for the common sizes. */            \
static void NAME##_part_any(const T *q, const KT *k_cache, const KT *v_cache, const int64_t *table,\
        int64_t len, int64_t b_begin, int64_t b_end, int64_t group, int64_t num_kv_heads,          \
        int64_t kvh, int64_t block_size, float scale, int64_t D, int64_t first, const float *slopes,\
        float softcap, const int64_t *limits, float *run_max, float *run_sum, float *acc) {        \
    switch (D) {                                                                                   \
    case 64:                                                                                       \
        NAME##_part(q, k_cache, v_cache, table, len, b_begin, b_end, group, num_kv_heads, kvh,     \
                    block_size, scale, 64, first, slopes, softcap, limits, run_max, run_sum, acc); \
        break;                                                                                     \
    case 128:                                                                                      \
        NAME##_part(q, k_cache, v_cache, table, len, b_begin, b_end, group, num_kv_heads, kvh,     \
                    block_size, scale, 128, first, slopes, softcap, limits, run_max, run_sum, acc);\
        break;                                                                                     \
    default:                                                                                       \
        NAME##_part(q, k_cache, v_cache, table, len, b_begin, b_end, group, num_kv_heads, kvh,     \
                    block_size, scale, D, first, slopes, softcap, limits, run_max, run_sum, acc);  \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
int NAME(const T *q, int64_t q_stride, const KT *k_cache, const KT *v_cache,                       \
         const int64_t *token_index, const int64_t *block_tables, const int64_t *seq_lens, T *out, \
         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,             \
         int64_t block_size, int64_t max_blocks, float scale, int64_t window,                      \
         const float *alibi_slopes, float softcap, const float *sinks, float k_scale, float v_scale,\
         int num_threads) {                                                                        \
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_size <= 0 || block_size <= 0)  \
        return 1;                                                                                  \
    const int64_t group = num_heads / num_kv_heads, D = head_size;                                 \
    /* Rows of one sequence's consecutive positions (a step verifying proposed tokens) form a     \
     * run: its queries share each K/V block, read once for all of them (find_runs). */          \
    int64_t run_start[num_seqs + 1];                                                               \
    const int64_t num_runs = find_runs(block_tables, seq_lens, num_seqs, max_blocks, block_size,   \
                                       group, D, window, alibi_slopes != NULL, run_start);          \
    /* Each row's context goes in ranges (see range_begin), computed as tasks of their own and     \
     * merged after (flash-decoding), so one sequence keeps every thread busy. The ranges start at \
     * fixed places whatever the row's length and whatever rows are beside it, so a row's rounding \
     * does not depend on them: a step verifying proposals computes each row as a plain decode step\
     * would, and a decode row does not depend on the other rows of its step. A run's rows all take\
     * its last row's ranges (those past a row's own tokens add exact zeros). */                   \
    const int64_t per = block_size >= RANGE_TOKENS ? 1 : RANGE_TOKENS / block_size;                \
    int64_t run_splits[num_runs], first_part[num_seqs + 1], splits = 1;                            \
    first_part[0] = 0;                                                                             \
    for (int64_t r = 0; r < num_runs; ++r) {                                                       \
        const int64_t last = run_start[r + 1] - 1, len = seq_lens[last];                           \
        const int64_t first = window > 0 && len > window ? len - window : 0;                       \
        const int64_t nblocks = (len + block_size - 1) / block_size - first / block_size;          \
        for (run_splits[r] = 1; range_begin(run_splits[r], per) < nblocks; ++run_splits[r]) {}      \
        splits = run_splits[r] > splits ? run_splits[r] : splits;                                  \
        for (int64_t s = run_start[r]; s <= last; ++s) first_part[s + 1] = first_part[s] + run_splits[r]; \
    }                                                                                              \
    const int64_t state = group * (D + 2); /* run_max, run_sum, acc[D] per query head */           \
    float *parts = scratch(sizeof(float) * first_part[num_seqs] * num_kv_heads * state);           \
    if (!parts) return 2;                                                                          \
    _Pragma("omp parallel for collapse(3) schedule(dynamic, 1) num_threads(num_threads)")          \
    for (int64_t r = 0; r < num_runs; ++r) {                                                       \
        for (int64_t sp = 0; sp < splits; ++sp) {                                                  \
            for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {                                     \
                if (sp >= run_splits[r]) continue;                                                 \
                /* The run's last row is its longest: its blocks hold every row's tokens. */       \
                const int64_t s0 = run_start[r], rows = run_start[r + 1] - s0, s = s0 + rows - 1;  \
                const int64_t nblocks = (seq_lens[s] + block_size - 1) / block_size;               \
                /* A sliding window starts at token first: its blocks are split, the earlier ones skipped. */ \
                const int64_t first = window > 0 && seq_lens[s] > window ? seq_lens[s] - window : 0; \
                const int64_t fb = first / block_size;                                             \
                const int64_t b0 = fb + range_begin(sp, per), end = fb + range_begin(sp + 1, per);  \
                const int64_t b1 = end < nblocks ? end : nblocks;                                  \
                /* A run's queries: each row's heads of this KV head in turn, each row seeing its own \
                 * length; a single row's state goes straight to its slot. */                      \
                const int64_t nq = rows * group;                                                   \
                T qrun[rows > 1 ? nq * D : 1];                                                     \
                int64_t limits[nq];                                                                \
                float run_state[rows > 1 ? nq * (D + 2) : 1];                                      \
                float *st = rows > 1 ? run_state : parts + ((first_part[s] + sp) * num_kv_heads + kvh) * state; \
                const T *qs = q + token_index[s] * q_stride + kvh * group * D;                     \
                if (rows > 1) {                                                                    \
                    for (int64_t i = 0; i < rows; ++i)                                             \
                        memcpy(qrun + i * group * D, q + token_index[s0 + i] * q_stride + kvh * group * D, \
                               sizeof(T) * group * D);                                             \
                    for (int64_t i = 0; i < nq; ++i) limits[i] = seq_lens[s0 + i / group];         \
                    qs = qrun;                                                                     \
                }                                                                                  \
                NAME##_part_any(qs, k_cache, v_cache, block_tables + s * max_blocks, seq_lens[s], b0, b1, nq, \
                                num_kv_heads, kvh, block_size, scale * k_scale, D, first,          \
                                alibi_slopes ? alibi_slopes + kvh * group : NULL, softcap,         \
                                rows > 1 ? limits : NULL, st, st + nq, st + 2 * nq);               \
                for (int64_t i = 0; rows > 1 && i < rows; ++i) {  /* each row's share into its own slot */ \
                    float *row = parts + ((first_part[s0 + i] + sp) * num_kv_heads + kvh) * state; \
                    memcpy(row, run_state + i * group, sizeof(float) * group);                     \
                    memcpy(row + group, run_state + nq + i * group, sizeof(float) * group);        \
                    memcpy(row + 2 * group, run_state + 2 * nq + i * group * D, sizeof(float) * group * D); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    merge_parts(parts, first_part, num_seqs, num_kv_heads, group, D, out, token_index, num_heads, \
                sinks, sizeof(T) == 2, v_scale, num_threads);                                      \
    return 0;                                                                                      \
}

/* out = the merged, normalised attention of each row's ranges (row s's are parts first_part[s]
 * .. first_part[s + 1] - 1): with M the largest
 * running max, sum = sum_s l_s e^(m_s - M) and acc = sum_s acc_s e^(m_s - M); times v_scale
 * (an int8 V cache's scale: acc is linear in V, so the codes are summed and scaled once).
 * An attention sink (gpt-oss: sinks[h], a logit with no value) joins M and the sum only. */
static void merge_parts(const float *parts, const int64_t *first_part, int64_t num_seqs, int64_t num_kv_heads,
                        int64_t group, int64_t D, void *out, const int64_t *token_index, int64_t num_heads,
                        const float *sinks, int out_bf16, float v_scale, int num_threads) {
    const int64_t state = group * (D + 2);
    _Pragma("omp parallel for collapse(2) if(num_seqs * num_kv_heads >= 16) num_threads(num_threads)")
    for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
            const int64_t splits = first_part[s + 1] - first_part[s];
            for (int64_t g = 0; g < group; ++g) {
                const float sink = sinks ? sinks[kvh * group + g] : -1e30f;
                float m = sink;
                for (int64_t sp = 0; sp < splits; ++sp) {
                    const float *st = parts + ((first_part[s] + sp) * num_kv_heads + kvh) * state;
                    m = st[g] > m ? st[g] : m;
                }
                float sum = sinks ? expf(sink - m) : 0.f, acc[D];
                for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
                for (int64_t sp = 0; sp < splits; ++sp) {
                    const float *st = parts + ((first_part[s] + sp) * num_kv_heads + kvh) * state;
                    const float w = expf(st[g] - m);
                    sum += st[group + g] * w;
                    const float *a = st + 2 * group + g * D;
                    for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * w;
                }
                const float inv = sum > 0.f ? v_scale / sum : 0.f;
                const int64_t o = (token_index[s] * num_heads + kvh * group + g) * D;
                for (int64_t d = 0; d < D; ++d) {
                    if (out_bf16) ((bf16_t *)out)[o + d] = bf16_store(acc[d] * inv);
                    else ((float *)out)[o + d] = acc[d] * inv;
                }
            }
        }
    }
}

/* Float caches pass k_scale = v_scale = 1. An int8 or float8 cache holds x / scale as codes:
 * K's scale folds into the score scale and V's into the final normalisation, so the loops read
 * the codes' values (staged a block at a time in the query's type, see DEFINE_STAGE) and no
 * dequantized copy of the cache is ever made. */
DEFINE_DECODE_KERNEL(kiln_paged_decode_attention_f32, float, f32_load, f32_store, float, no_stage, float, f32_load,
                     group_scores_f32, no_group_pv)
DEFINE_DECODE_KERNEL(kiln_paged_decode_attention_bf16, bf16_t, bf16_load, bf16_store, bf16_t, no_stage, bf16_t,
                     bf16_load, group_scores_bf16, group_pv_bf16)
DEFINE_DECODE_KERNEL(kiln_paged_decode_attention_f32_i8, float, f32_load, f32_store, int8_t, stage_i8_f32, float,
                     f32_load, group_scores_f32, no_group_pv)
DEFINE_DECODE_KERNEL(kiln_paged_decode_attention_bf16_i8, bf16_t, bf16_load, bf16_store, int8_t, stage_i8_bf16,
                     bf16_t, bf16_load, group_scores_bf16, group_pv_bf16)
DEFINE_DECODE_KERNEL(kiln_paged_decode_attention_f32_f8, float, f32_load, f32_store, fp8_t, stage_f8_f32, float,
                     f32_load, group_scores_f32, no_group_pv)
DEFINE_DECODE_KERNEL(kiln_paged_decode_attention_bf16_f8, bf16_t, bf16_load, bf16_store, fp8_t, stage_f8_bf16,
                     bf16_t, bf16_load, group_scores_bf16, group_pv_bf16)

/* The cache code conversions the kernels use, exported so tests can hold them against
 * PyTorch's: the codes of x [n] with 1 / scale in a cache of `kind` (what decode_step.c
 * writes), and the values of float8 codes [n] as the kernels stage them (16 at a time, the
 * rest of a row one by one). */
void kiln_kv_quantize(const float *x, int64_t n, float inv_scale, int64_t kind, void *codes) {
    for (int64_t i = 0; i < n; ++i) kv_store(codes, i, x[i] * inv_scale, kind);
}

void kiln_fp8_to_f32(const fp8_t *codes, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, load16_f8(codes + i));
#endif
    for (; i < n; ++i) out[i] = fp8_load(codes[i]);
}
