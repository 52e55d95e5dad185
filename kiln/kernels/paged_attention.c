/* Decode attention straight from the paged KV cache (one query token per sequence).
 *
 * The PyTorch reference backend copies every sequence's K/V blocks into a padded tensor
 * before each layer's attention; on a CPU that copy costs as much as the attention itself.
 * Here each sequence walks its block table and reads K/V in place, with a block-wise online
 * softmax, so the cache is read once per layer.
 *
 * Layouts (row-major, contiguous):
 *   q, out        [num_tokens, num_heads, head_size]   rows picked by token_index; q's rows
 *                 may be strided (q_stride elements apart: a view into the fused qkv output)
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_size]
 *   block_tables  [num_seqs, max_blocks] int64
 *   seq_lens      [num_seqs] int64  (tokens in the cache, the new one included)
 * Query heads are grouped onto KV heads as in GQA: head h reads KV head h / (H / KVH).
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

/* Scores q . k for as many whole groups of 16 tokens as the block has; returns how many
 * tokens it scored (the caller finishes the rest). A dot product per token ends in a
 * horizontal sum, which dominated the kernel; here 16 tokens' partial-sum vectors are
 * reduced together by a transpose-and-add tree (~3 instructions a token instead of ~10). */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
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
        const float *q, const T *kb, int64_t token_stride, int64_t ntok, const int64_t D, float *out) { \
    if (D % 16 != 0) return 0;                                                                     \
    int64_t t = 0;                                                                                 \
    for (; t + 16 <= ntok; t += 16) {                                                              \
        __m512 v[16];                                                                              \
        for (int j = 0; j < 16; ++j) {                                                             \
            const T *kt = kb + (t + j) * token_stride;                                             \
            __m512 acc = _mm512_setzero_ps();                                                      \
            for (int64_t d = 0; d < D; d += 16)                                                    \
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_##SUFFIX(kt + d), acc);      \
            v[j] = acc;                                                                            \
        }                                                                                          \
        _mm512_storeu_ps(out + t, reduce16(v));                                                    \
    }                                                                                              \
    return t;                                                                                      \
}
DEFINE_SCORES16(f32, float)
DEFINE_SCORES16(bf16, bf16_t)
#else
#define scores16_f32(q, kb, stride, ntok, D, out) ((int64_t)0)
#define scores16_bf16(q, kb, stride, ntok, D, out) ((int64_t)0)
#endif

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

/* Attention state of one (sequence, KV head) over a range of its blocks, unnormalised: per
 * query head of the group the running max, the running sum of exp(score - max), and the
 * exp-weighted sum of values. Ranges of one sequence merge exactly (see merge_parts).
 * Inlined with a constant head size where possible, so the d-loops unroll and q/acc stay in
 * vector registers across the token loops. */
#define DEFINE_DECODE_KERNEL(NAME, T, LOAD, STORE, VEC_SCORES)                                     \
static inline __attribute__((always_inline)) void NAME##_part(                                    \
        const T *q, const T *k_cache, const T *v_cache, const int64_t *table, int64_t len,        \
        int64_t b_begin, int64_t b_end, int64_t group, int64_t token_stride, int64_t kvh,         \
        int64_t block_size, float scale, const int64_t D, float *run_max, float *run_sum,         \
        float *acc) {                                                                             \
    float qf[group * D], scores[group * block_size];                                               \
    for (int64_t g = 0; g < group; ++g) {                                                          \
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = LOAD(q[g * D + d]) * scale;               \
        run_max[g] = -1e30f; /* finite (built with -ffast-math); exp(-1e30 - m) is 0 */           \
        run_sum[g] = 0.f;                                                                          \
    }                                                                                              \
    memset(acc, 0, sizeof(float) * group * D);                                                     \
    for (int64_t b = b_begin; b < b_end; ++b) {                                                    \
        const int64_t ntok = len - b * block_size < block_size ? len - b * block_size : block_size; \
        const T *kb = k_cache + table[b] * block_size * token_stride + kvh * D;                   \
        const T *vb = v_cache + table[b] * block_size * token_stride + kvh * D;                   \
        for (int64_t g = 0; g < group; ++g) {                                                      \
            const float *qg = qf + g * D;                                                          \
            float *sg = scores + g * block_size;                                                   \
            float m = run_max[g];                                                                  \
            int64_t t = VEC_SCORES(qg, kb, token_stride, ntok, D, sg);                             \
            for (; t < ntok; ++t) {                                                                \
                const T *kt = kb + t * token_stride;                                               \
                float dot = 0.f;                                                                   \
                _Pragma("omp simd reduction(+:dot)")                                               \
                for (int64_t d = 0; d < D; ++d) dot += qg[d] * LOAD(kt[d]);                        \
                sg[t] = dot;                                                                       \
            }                                                                                      \
            for (int64_t i = 0; i < ntok; ++i) m = sg[i] > m ? sg[i] : m;                          \
            const float rescale = expf(run_max[g] - m);                                            \
            float sum = 0.f;                                                                       \
            _Pragma("omp simd reduction(+:sum)")                                                   \
            for (int64_t i = 0; i < ntok; ++i) { sg[i] = expf(sg[i] - m); sum += sg[i]; }          \
            run_max[g] = m;                                                                        \
            run_sum[g] = run_sum[g] * rescale + sum;                                               \
            float *ag = acc + g * D;                                                               \
            float a[D];                                                                            \
            for (int64_t d = 0; d < D; ++d) a[d] = ag[d] * rescale;                                \
            for (int64_t i = 0; i < ntok; ++i) {                                                   \
                const T *vt = vb + i * token_stride;                                               \
                const float p = sg[i];                                                             \
                _Pragma("omp simd")                                                                \
                for (int64_t d = 0; d < D; ++d) a[d] += p * LOAD(vt[d]);                           \
            }                                                                                      \
            for (int64_t d = 0; d < D; ++d) ag[d] = a[d];                                          \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* NAME##_part with the head size as a compile-time constant for the common sizes. */            \
static void NAME##_part_any(const T *q, const T *k_cache, const T *v_cache, const int64_t *table, \
        int64_t len, int64_t b_begin, int64_t b_end, int64_t group, int64_t token_stride,         \
        int64_t kvh, int64_t block_size, float scale, int64_t D, float *run_max, float *run_sum,  \
        float *acc) {                                                                             \
    switch (D) {                                                                                   \
    case 64:                                                                                       \
        NAME##_part(q, k_cache, v_cache, table, len, b_begin, b_end, group, token_stride, kvh,     \
                    block_size, scale, 64, run_max, run_sum, acc);                                 \
        break;                                                                                     \
    case 128:                                                                                      \
        NAME##_part(q, k_cache, v_cache, table, len, b_begin, b_end, group, token_stride, kvh,     \
                    block_size, scale, 128, run_max, run_sum, acc);                                \
        break;                                                                                     \
    default:                                                                                       \
        NAME##_part(q, k_cache, v_cache, table, len, b_begin, b_end, group, token_stride, kvh,     \
                    block_size, scale, D, run_max, run_sum, acc);                                  \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
int NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                        \
         const int64_t *token_index, const int64_t *block_tables, const int64_t *seq_lens, T *out,\
         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,            \
         int64_t block_size, int64_t max_blocks, float scale, int num_threads) {                   \
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_size <= 0 || block_size <= 0)  \
        return 1;                                                                                  \
    const int64_t group = num_heads / num_kv_heads, D = head_size;                                 \
    const int64_t token_stride = num_kv_heads * D;                                                 \
    /* Few sequences cannot keep every thread busy: split each one's blocks into ranges and   \
     * merge them after (flash-decoding). Each task covers all KV heads of its range, so a    \
     * token row's cache lines (all KV heads) come from memory once and are reused from L2. */ \
    const int64_t splits = num_seqs >= 4 * num_threads ? 1 : (4 * num_threads + num_seqs - 1) / num_seqs; \
    const int64_t state = group * (D + 2); /* run_max, run_sum, acc[D] per query head */          \
    float *parts = scratch(sizeof(float) * num_seqs * splits * num_kv_heads * state);              \
    if (!parts) return 2;                                                                          \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")          \
    for (int64_t s = 0; s < num_seqs; ++s) {                                                       \
        for (int64_t sp = 0; sp < splits; ++sp) {                                                  \
            const int64_t nblocks = (seq_lens[s] + block_size - 1) / block_size;                   \
            const int64_t per = (nblocks + splits - 1) / splits;                                   \
            const int64_t b0 = sp * per, b1 = b0 + per < nblocks ? b0 + per : nblocks;            \
            for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {                                     \
                float *st = parts + ((s * splits + sp) * num_kv_heads + kvh) * state;              \
                const T *qs = q + token_index[s] * q_stride + kvh * group * D;                     \
                NAME##_part_any(qs, k_cache, v_cache, block_tables + s * max_blocks, seq_lens[s],  \
                                b0, b1, group, token_stride, kvh, block_size, scale, D, st,        \
                                st + group, st + 2 * group);                                       \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    merge_parts(parts, splits, num_seqs, num_kv_heads, group, D, out, token_index, num_heads,     \
                sizeof(T) == 2, num_threads);                                                      \
    return 0;                                                                                      \
}

/* out = the merged, normalised attention of each sequence's ranges: with M the largest
 * running max, sum = sum_s l_s e^(m_s - M) and acc = sum_s acc_s e^(m_s - M). */
static void merge_parts(const float *parts, int64_t splits, int64_t num_seqs, int64_t num_kv_heads,
                        int64_t group, int64_t D, void *out, const int64_t *token_index, int64_t num_heads,
                        int out_bf16, int num_threads) {
    const int64_t state = group * (D + 2);
    _Pragma("omp parallel for collapse(2) if(num_seqs * num_kv_heads >= 16) num_threads(num_threads)")
    for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
            for (int64_t g = 0; g < group; ++g) {
                float m = -1e30f;
                for (int64_t sp = 0; sp < splits; ++sp) {
                    const float *st = parts + ((s * splits + sp) * num_kv_heads + kvh) * state;
                    m = st[g] > m ? st[g] : m;
                }
                float sum = 0.f, acc[D];
                for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
                for (int64_t sp = 0; sp < splits; ++sp) {
                    const float *st = parts + ((s * splits + sp) * num_kv_heads + kvh) * state;
                    const float w = expf(st[g] - m);
                    sum += st[group + g] * w;
                    const float *a = st + 2 * group + g * D;
                    for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * w;
                }
                const float inv = sum > 0.f ? 1.f / sum : 0.f;
                const int64_t o = (token_index[s] * num_heads + kvh * group + g) * D;
                for (int64_t d = 0; d < D; ++d) {
                    if (out_bf16) ((bf16_t *)out)[o + d] = bf16_store(acc[d] * inv);
                    else ((float *)out)[o + d] = acc[d] * inv;
                }
            }
        }
    }
}

DEFINE_DECODE_KERNEL(kiln_paged_decode_attention_f32, float, f32_load, f32_store, scores16_f32)
DEFINE_DECODE_KERNEL(kiln_paged_decode_attention_bf16, bf16_t, bf16_load, bf16_store, scores16_bf16)
