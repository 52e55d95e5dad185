/* y = x W^T + b (bf16) for any number of rows, from a weight handed over panel by panel in
 * the VNNI tile layout of amx_linear.c:
 *
 *   tile[nb][kb][p][c][e] = w[nb * 16 + c][kb * 32 + 2 * p + e]     (p, c < 16; e < 2)
 *
 * The panel function gives the tiles of a few output blocks: a packed bf16 weight's own
 * memory, or (quant_linear.c) codes dequantized into a per-thread scratch. The multiply runs
 * on AMX tiles where the CPU has them (amx_linear.c), else on AVX512-BF16 dot products, else
 * in plain C. In the tile layout, tile row p is exactly one VDPBF16PS operand: lane c holds
 * column c's pair of k, so a row of x contributes its k pair broadcast to all lanes. A task
 * owns a panel of PANEL_BLOCKS output blocks and walks every tile of ROW_TILE rows of x
 * through it: the panel comes from memory once and from L1/L2 after, and each weight vector
 * loaded feeds ROW_TILE multiplies.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define PANEL_BLOCKS 2  /* 32 columns: n = 576 splits evenly over two threads (18 panels) */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ROW_TILE 12  /* 12 rows x 2 blocks = 24 accumulators, 2 weight vectors, 1 broadcast */

/* MT rows of x (a constant once inlined) against NB (1 or 2) blocks of the panel at w:
 * out[t][b * 16 + c] = sum over k of x[t][k] w[b * 16 + c][k]. */
static inline __attribute__((always_inline)) void dot_tile(const bf16_t *x, int64_t k, int MT, const bf16_t *w,
                                                          int NB, int64_t wstride, int64_t kblocks,
                                                          float out[ROW_TILE][PANEL_BLOCKS * 16]) {
    __m512 acc[ROW_TILE][PANEL_BLOCKS];
    for (int t = 0; t < MT; ++t)
        for (int b = 0; b < NB; ++b) acc[t][b] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kblocks; ++kb) {
        const bf16_t *tile = w + kb * 512;
        for (int p = 0; p < 16; ++p) {
            __m512bh wv[PANEL_BLOCKS];
            for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(tile + b * wstride + p * 32);
            const bf16_t *xp = x + kb * 32 + 2 * p;
            for (int t = 0; t < MT; ++t) {
                int32_t pair;
                memcpy(&pair, xp + t * k, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                for (int b = 0; b < NB; ++b) acc[t][b] = _mm512_dpbf16_ps(acc[t][b], wv[b], xv);
            }
        }
    }
    for (int t = 0; t < MT; ++t)
        for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out[t] + b * 16, acc[t][b]);
}

static void dot_linear_panels(const bf16_t *x, kiln_panel_fn get_panel, const void *weight, const bf16_t *bias,
                              const float *col_scale, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads, int streams) {
    const int64_t nblocks = n / 16, kblocks = k / 32, wstride = kblocks * 512;
    const int64_t panels = (nblocks + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        bf16_t *scratch = streams ? NULL : aligned_alloc(64, sizeof(bf16_t) * KILN_MAX_PANEL_BLOCKS * wstride);
        float out[ROW_TILE][PANEL_BLOCKS * 16];
        _Pragma("omp for schedule(static)")
        for (int64_t panel = 0; panel < panels; ++panel) {
            const int64_t nb0 = panel * PANEL_BLOCKS;
            const int blocks = (int)min64(nblocks - nb0, PANEL_BLOCKS);
            const bf16_t *w = get_panel(weight, nb0, blocks, kblocks, scratch);
            for (int64_t t0 = 0; t0 < m; t0 += ROW_TILE) {
                const int mt = (int)min64(m - t0, ROW_TILE);
                const bf16_t *xt = x + t0 * k;
#define CASE(MT)                                                                                   \
                case MT:                                                                           \
                    if (blocks == 2) dot_tile(xt, k, MT, w, 2, wstride, kblocks, out);             \
                    else dot_tile(xt, k, MT, w, 1, wstride, kblocks, out);                         \
                    break;
                switch (mt) {
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11)
                default: CASE(12)
                }
#undef CASE
                for (int t = 0; t < mt; ++t)
                    for (int c = 0; c < 16 * blocks; ++c) {
                        const int64_t col = nb0 * 16 + c;
                        const float v = col_scale ? out[t][c] * col_scale[col] : out[t][c];
                        y[(t0 + t) * n + col] = bf16_store(v + (bias ? bf16_load(bias[col]) : 0.f));
                    }
            }
        }
        free(scratch);
    }
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BF16__)) && defined(__AVX2__) && defined(__FMA__)
#define FMA_ROWS 4  /* 4 rows x 2 halves = 8 accumulators (FMA latency x throughput), 4 weight vectors, 2 broadcasts */

/* AVX2 without bf16 arithmetic: a tile row's bf16 pairs as two fp32 vectors (even k: the low
 * halves shifted up; odd k: the high halves masked), each multiplied by its k of x broadcast.
 * MT rows of x (fp32) against one block: out[t][c] = sum over k of x[t][k] w[c][k]. */
static inline __attribute__((always_inline)) void fma_tile(const float *x, int64_t k, int MT, const bf16_t *w,
                                                          int64_t kblocks, float out[FMA_ROWS][16]) {
    __m256 acc[FMA_ROWS][2];
    for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
        const bf16_t *tile = w + kb * 512;
        for (int p = 0; p < 16; ++p) {
            __m256 even[2], odd[2];
            for (int h = 0; h < 2; ++h) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(tile + p * 32 + 16 * h));
                even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            }
            const float *xp = x + kb * 32 + 2 * p;
            for (int t = 0; t < MT; ++t) {
                const __m256 xe = _mm256_broadcast_ss(xp + t * k), xo = _mm256_broadcast_ss(xp + t * k + 1);
                for (int h = 0; h < 2; ++h)
                    acc[t][h] = _mm256_fmadd_ps(odd[h], xo, _mm256_fmadd_ps(even[h], xe, acc[t][h]));
            }
        }
    }
    for (int t = 0; t < MT; ++t) {
        _mm256_storeu_ps(out[t], acc[t][0]);
        _mm256_storeu_ps(out[t] + 8, acc[t][1]);
    }
}

/* As dot_linear_panels, with x converted to fp32 once. */
static int fma_linear_panels(const bf16_t *x, kiln_panel_fn get_panel, const void *weight, const bf16_t *bias,
                             const float *col_scale, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t nblocks = n / 16, kblocks = k / 32, wstride = kblocks * 512;
    const int64_t panels = (nblocks + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
    float *xf = malloc(sizeof(float) * m * k);
    if (xf == NULL) return 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < m * k; ++i) xf[i] = bf16_load(x[i]);
        bf16_t *scratch = aligned_alloc(64, sizeof(bf16_t) * KILN_MAX_PANEL_BLOCKS * wstride);
        float out[FMA_ROWS][16];
        _Pragma("omp for schedule(static)")
        for (int64_t panel = 0; panel < panels; ++panel) {
            const int64_t nb0 = panel * PANEL_BLOCKS;
            const int blocks = (int)min64(nblocks - nb0, PANEL_BLOCKS);
            const bf16_t *w = get_panel(weight, nb0, blocks, kblocks, scratch);
            for (int b = 0; b < blocks; ++b)
                for (int64_t t0 = 0; t0 < m; t0 += FMA_ROWS) {
                    const int mt = (int)min64(m - t0, FMA_ROWS);
                    const float *xt = xf + t0 * k;
                    const bf16_t *wb = w + b * wstride;
                    switch (mt) {
                    case 1: fma_tile(xt, k, 1, wb, kblocks, out); break;
                    case 2: fma_tile(xt, k, 2, wb, kblocks, out); break;
                    case 3: fma_tile(xt, k, 3, wb, kblocks, out); break;
                    default: fma_tile(xt, k, 4, wb, kblocks, out); break;
                    }
                    for (int t = 0; t < mt; ++t)
                        for (int c = 0; c < 16; ++c) {
                            const int64_t col = (nb0 + b) * 16 + c;
                            const float v = col_scale ? out[t][c] * col_scale[col] : out[t][c];
                            y[(t0 + t) * n + col] = bf16_store(v + (bias ? bf16_load(bias[col]) : 0.f));
                        }
                }
        }
        free(scratch);
    }
    free(xf);
    return 1;
}
#endif

/* Plain C over the same panels (CPUs without AVX512-BF16 or AVX2). */
static void portable_linear_panels(const bf16_t *x, kiln_panel_fn get_panel, const void *weight,
                                   const bf16_t *bias, const float *col_scale, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t nblocks = n / 16, kblocks = k / 32, wstride = kblocks * 512;
    const int64_t panels = (nblocks + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        bf16_t *scratch = malloc(sizeof(bf16_t) * KILN_MAX_PANEL_BLOCKS * wstride);
        float *xf = malloc(sizeof(float) * k);
        _Pragma("omp for schedule(static)")
        for (int64_t panel = 0; panel < panels; ++panel) {
            const int64_t nb0 = panel * PANEL_BLOCKS;
            const int blocks = (int)min64(nblocks - nb0, PANEL_BLOCKS);
            const bf16_t *w = get_panel(weight, nb0, blocks, kblocks, scratch);
            for (int64_t t = 0; t < m; ++t) {
                for (int64_t i = 0; i < k; ++i) xf[i] = bf16_load(x[t * k + i]);
                for (int b = 0; b < blocks; ++b) {
                    float acc[16] = {0};
                    for (int64_t kb = 0; kb < kblocks; ++kb)
                        for (int p = 0; p < 16; ++p) {
                            const bf16_t *row = w + b * wstride + kb * 512 + p * 32;
                            const float x0 = xf[kb * 32 + 2 * p], x1 = xf[kb * 32 + 2 * p + 1];
                            for (int c = 0; c < 16; ++c)
                                acc[c] += x0 * bf16_load(row[2 * c]) + x1 * bf16_load(row[2 * c + 1]);
                        }
                    for (int c = 0; c < 16; ++c) {
                        const int64_t col = (nb0 + b) * 16 + c;
                        const float v = col_scale ? acc[c] * col_scale[col] : acc[c];
                        y[t * n + col] = bf16_store(v + (bias ? bf16_load(bias[col]) : 0.f));
                    }
                }
            }
        }
        free(xf);
        free(scratch);
    }
}

/* Whether the panels run on vector units here (AVX512-BF16 dot products, or AVX2 FMAs on bf16
 * widened to fp32) rather than in plain C. */
int kiln_vector_panels_available(void) {
#if (defined(__AVX512F__) && defined(__AVX512BF16__)) || defined(FMA_ROWS)
    return 1;
#else
    return 0;
#endif
}

static const bf16_t *packed_panel(const void *weight, int64_t nb0, int blocks, int64_t kblocks, bf16_t *scratch) {
    (void)blocks;
    (void)scratch;
    return (const bf16_t *)weight + nb0 * kblocks * 512;
}

void kiln_linear_panels(const bf16_t *x, kiln_panel_fn get_panel, const void *weight, const bf16_t *bias,
                        const float *col_scale, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (kiln_amx_available()) {
        kiln_amx_linear_panels(x, get_panel, weight, bias, col_scale, y, m, n, k, num_threads);
        return;
    }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    dot_linear_panels(x, get_panel, weight, bias, col_scale, y, m, n, k, num_threads, get_panel == packed_panel);
#else
#ifdef FMA_ROWS
    if (fma_linear_panels(x, get_panel, weight, bias, col_scale, y, m, n, k, num_threads)) return;
#endif
    portable_linear_panels(x, get_panel, weight, bias, col_scale, y, m, n, k, num_threads);
#endif
}

void kiln_packed_linear_bf16(const bf16_t *x, const bf16_t *packed, const bf16_t *bias, bf16_t *y, int64_t m,
                             int64_t n, int64_t k, int num_threads) {
    kiln_linear_panels(x, packed_panel, packed, bias, NULL, y, m, n, k, num_threads);
}

void kiln_gemv_panels(kiln_gemv_tile_fn tile, const void *ctx, const bf16_t *bias, const float *col_scale,
                      bf16_t *y, int64_t m, int64_t n, int64_t unit, int num_threads) {
    const int64_t nblocks = n / 16, units = (nblocks + unit - 1) / unit, width = unit == 1 ? 4 : unit;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t b_begin = units * me / threads * unit;
        const int64_t b_end = min64(units * (me + 1) / threads * unit, nblocks);
        for (int64_t nb0 = b_begin; nb0 < b_end; nb0 += width) {
            const int blocks = (int)min64(width, b_end - nb0);
            for (int64_t t0 = 0; t0 < m; t0 += 4) {
                const int mt = m - t0 < 4 ? (int)(m - t0) : 4;
                float out[4 * 64];
                tile(ctx, t0, mt, nb0, blocks, out);
                for (int t = 0; t < mt; ++t)
                    for (int c = 0; c < 16 * blocks; ++c) {
                        const int64_t col = nb0 * 16 + c;
                        const float scale = col_scale ? col_scale[col] : 1.f;
                        y[(t0 + t) * n + col] = bf16_store(out[t * 64 + c] * scale + (bias ? bf16_load(bias[col]) : 0.f));
                    }
            }
        }
    }
}

/* The plain-C loop, callable on any CPU (tests compare it with the vector paths). */
void kiln_portable_linear_bf16(const bf16_t *x, const bf16_t *packed, const bf16_t *bias, bf16_t *y, int64_t m,
                               int64_t n, int64_t k, int num_threads) {
    portable_linear_panels(x, packed_panel, packed, bias, NULL, y, m, n, k, num_threads);
}
