/* bf16 linear layers on AMX tiles: y = x W^T + b for any number of rows.
 *
 * AVX512-BF16 dot products top out near 110 GFLOP/s a core here, so a decode step of more
 * than one token became compute-bound in the skinny GEMM; AMX's tile multiply does ~16x
 * more per instruction. The weight is repacked once into the tile layout TDPBF16PS wants
 * ("VNNI": pairs of consecutive k of 16 output columns side by side):
 *
 *   packed[nb][kb][p][c][e] = w[nb * 16 + c][kb * 32 + 2 * p + e]     (p, c < 16; e < 2)
 *
 * so the B tile of output block nb and k block kb is 1 KiB of contiguous memory. Each task
 * owns a panel of two output blocks and walks every 16-row block of x through it, so the
 * panel's weights come from memory once and from L1/L2 after.
 * Needs n % 16 == 0 and k % 32 == 0 (kiln_amx_supported); rows of x past m are zero-padded.
 * A panel's tiles come from a panel function: the packed weight itself, or (quant_linear.c) a
 * quantized weight dequantized into a per-thread scratch that stays in L2 for every row block.
 *
 * Linux grants a process AMX tile state only on request (arch_prctl); kiln_amx_available
 * makes it once and reports whether the CPU and kernel allow it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_disabled;  /* KILN_AMX=0: kiln_set_amx(0) */

int kiln_amx_available(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state && !amx_disabled;
}

void kiln_set_amx(int enabled) { amx_disabled = !enabled; }

static void configure_tiles(void) {
    kiln_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {  /* 0-3: accumulators, 4: x block, 5-7: weight blocks */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* The first row block streams the panel's weights from memory (later ones find them in L2):
 * ask for the tiles PREFETCH_AHEAD k-blocks on of the panel's output blocks while these multiply.
 * May point past the weight: prefetches never fault. */
#define PREFETCH_AHEAD 2
static inline void prefetch_tiles(const bf16_t *w, int64_t wstride, int blocks) {
    for (int b = 0; b < blocks; ++b)
        for (int line = 0; line < 16; ++line) _mm_prefetch((const char *)(w + b * wstride) + 64 * line, _MM_HINT_T0);
}

/* The fp32 tile sums of rows [0, rows) and columns [0, 16 * blocks) to bf16 y (times the column
 * scales, + bias), 16 columns a vector (round to nearest even, as bf16_store). */
static void store_rows(const float *acc, int64_t rows, int blocks, const bf16_t *bias, const float *col_scale,
                       bf16_t *y, int64_t n) {
    for (int b = 0; b < blocks; ++b) {
        __m512 bv = _mm512_setzero_ps();
        if (bias)
            bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + b * 16))), 16));
        const __m512 sv = col_scale ? _mm512_loadu_ps(col_scale + b * 16) : _mm512_set1_ps(1.f);
        for (int64_t r = 0; r < rows; ++r) {
            const __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(acc + (b * 16 + r) * 16), sv, bv);
            _mm256_storeu_si256((__m256i *)(y + r * n + b * 16), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* The panel function of a packed bf16 weight: its tiles are already in place. */
static const bf16_t *packed_panel(const void *weight, int64_t nb0, int blocks, int64_t kblocks, bf16_t *scratch) {
    (void)blocks;
    (void)scratch;
    return (const bf16_t *)weight + nb0 * kblocks * 512;
}

/* One row block of x (up to 16 rows) against a panel of up to four output blocks: four
 * accumulators share each A tile. */
static void one_row_block(const bf16_t *a, const bf16_t *w0, int blocks, int64_t kblocks, int64_t k, int stream,
                          float *acc) {
    const int64_t tile_elems = 512, wstride = kblocks * tile_elems;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (blocks == 4) {
        for (int64_t kb = 0; kb < kblocks; ++kb) {
            const bf16_t *w = w0 + kb * tile_elems;
            if (stream) prefetch_tiles(w + PREFETCH_AHEAD * tile_elems, wstride, 4);
            _tile_loadd(4, a + kb * 32, k * sizeof(bf16_t));
            _tile_loadd(5, w, 64);
            _tile_loadd(6, w + wstride, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(7, w + 2 * wstride, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, w + 3 * wstride, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, acc, 64);
        _tile_stored(1, acc + 256, 64);
        _tile_stored(2, acc + 512, 64);
        _tile_stored(3, acc + 768, 64);
        return;
    }
    for (int b = 0; b < blocks; ++b) {  /* a last panel of 1-3 blocks: one accumulator at a time */
        _tile_zero(0);
        for (int64_t kb = 0; kb < kblocks; ++kb) {
            _tile_loadd(4, a + kb * 32, k * sizeof(bf16_t));
            _tile_loadd(5, w0 + b * wstride + kb * tile_elems, 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, acc + b * 256, 64);
    }
}

/* Two row blocks against a panel of one or two output blocks: four accumulators, and each A
 * and B tile load feeds two multiplies. `two_rows`: a1 is a real second row block. */
static void two_row_blocks(const bf16_t *a0, const bf16_t *a1, int two_rows, const bf16_t *w0, int blocks,
                           int64_t kblocks, int64_t k, int stream, float *acc0, float *acc1) {
    const int64_t tile_elems = 512, wstride = kblocks * tile_elems;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
        const bf16_t *w = w0 + kb * tile_elems;
        if (stream) prefetch_tiles(w + PREFETCH_AHEAD * tile_elems, wstride, blocks);
        _tile_loadd(4, a0 + kb * 32, k * sizeof(bf16_t));
        _tile_loadd(6, w, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (blocks == 2) {
            _tile_loadd(7, w + wstride, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_rows) {
            _tile_loadd(5, a1 + kb * 32, k * sizeof(bf16_t));
            _tile_dpbf16ps(2, 5, 6);
            if (blocks == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc0, 64);
    _tile_stored(1, acc0 + 256, 64);
    _tile_stored(2, acc1, 64);
    _tile_stored(3, acc1 + 256, 64);
}

/* One row block (decode steps up to 16 tokens): panels of four output blocks. More: panels
 * of two walked by pairs of row blocks, whose loads go twice as far (and whose 576-column
 * matmuls split evenly over two threads, which panels of four did not). */
void kiln_amx_linear_panels(const bf16_t *x, kiln_panel_fn get_panel, const void *weight, const bf16_t *bias,
                            const float *col_scale, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t nblocks = n / 16, kblocks = k / 32, mblocks = (m + 15) / 16;
    const int panel_blocks = mblocks == 1 ? 4 : 2;
    const int64_t panels = (nblocks + panel_blocks - 1) / panel_blocks;
    const int stream = get_panel == packed_panel;  /* weights straight from memory: prefetch them */
    _Pragma("omp parallel num_threads(num_threads)")
    {
        configure_tiles();
        float acc[2][4 * 256];  /* per row block: [block][row][column] */
        bf16_t *tail = NULL;  /* the last, partial, row block of x, zero-padded to 16 rows */
        if (m % 16) {
            tail = calloc(16 * k, sizeof(bf16_t));
            memcpy(tail, x + (m - m % 16) * k, sizeof(bf16_t) * (m % 16) * k);
        }
        bf16_t *scratch = stream ? NULL : aligned_alloc(64, sizeof(bf16_t) * KILN_MAX_PANEL_BLOCKS * kblocks * 512);
        _Pragma("omp for schedule(static)")
        for (int64_t panel = 0; panel < panels; ++panel) {
            const int64_t nb0 = panel * panel_blocks;
            const int blocks = nblocks - nb0 < panel_blocks ? (int)(nblocks - nb0) : panel_blocks;
            const bf16_t *w0 = get_panel(weight, nb0, blocks, kblocks, scratch);
            const bf16_t *panel_bias = bias ? bias + nb0 * 16 : NULL;
            const float *panel_scale = col_scale ? col_scale + nb0 * 16 : NULL;
            for (int64_t mb = 0; mb < mblocks; mb += 2) {
                const int64_t rows0 = m - mb * 16 < 16 ? m - mb * 16 : 16;
                const bf16_t *a0 = rows0 == 16 ? x + mb * 16 * k : tail;
                if (mblocks == 1) {
                    one_row_block(a0, w0, blocks, kblocks, k, stream, acc[0]);
                    store_rows(acc[0], rows0, blocks, panel_bias, panel_scale, y + nb0 * 16, n);
                    break;
                }
                const int two_rows = mb + 1 < mblocks;
                const int64_t rows1 = two_rows ? (m - (mb + 1) * 16 < 16 ? m - (mb + 1) * 16 : 16) : 0;
                const bf16_t *a1 = rows1 == 16 ? x + (mb + 1) * 16 * k : tail;
                two_row_blocks(a0, a1, two_rows, w0, blocks, kblocks, k, stream && mb == 0, acc[0], acc[1]);
                store_rows(acc[0], rows0, blocks, panel_bias, panel_scale, y + mb * 16 * n + nb0 * 16, n);
                if (two_rows) store_rows(acc[1], rows1, blocks, panel_bias, panel_scale, y + (mb + 1) * 16 * n + nb0 * 16, n);
            }
        }
        free(scratch);
        free(tail);
        _tile_release();
    }
}

void kiln_amx_linear_bf16(const bf16_t *x, const bf16_t *packed, const bf16_t *bias, bf16_t *y, int64_t m,
                          int64_t n, int64_t k, int num_threads) {
    kiln_amx_linear_panels(x, packed_panel, packed, bias, NULL, y, m, n, k, num_threads);
}
#else
int kiln_amx_available(void) { return 0; }

void kiln_set_amx(int enabled) { (void)enabled; }

/* Never called: callers ask kiln_amx_available() first. */
void kiln_amx_linear_panels(const bf16_t *x, kiln_panel_fn get_panel, const void *weight, const bf16_t *bias,
                            const float *col_scale, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)x; (void)get_panel; (void)weight; (void)bias; (void)col_scale; (void)y; (void)m; (void)n; (void)k; (void)num_threads;
    abort();
}

void kiln_amx_linear_bf16(const bf16_t *x, const bf16_t *packed, const bf16_t *bias, bf16_t *y, int64_t m,
                          int64_t n, int64_t k, int num_threads) {
    (void)x; (void)packed; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)num_threads;
    abort();
}
#endif
