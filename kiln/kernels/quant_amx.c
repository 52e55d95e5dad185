/* Weight-only quantized linears for a few more rows than the GEMV takes (batched decode,
 * verifying proposals), on AMX int8 tiles, computing exactly what the GEMV computes.
 *
 * Past the GEMV's rows, a panel was dequantized to bf16 for the bf16 tile kernel, and that
 * conversion (~10 instructions a 32 weights) cost as much as the multiply until ~48 rows. Here
 * x is prepared as the GEMV prepares it (int8 blocks of 32 with a scale each), and the codes go
 * into TDPBSUD (signed x bytes times unsigned code bytes) unconverted: a 4-bit chunk's 64 bytes
 * masked (or shifted) are one B tile row of 4 k for 16 columns as they stand. Each span of k
 * (a block of x: 32; 6-bit codes: a group of 16) is one tile multiply per 16 rows and output
 * block, and its int32 sums are flushed to fp32 as the GEMV flushes them (zero code folded in
 * integers, times the group's scale and x's block scale, then a stored offset times the block's
 * sum of x, in the same order), so every row comes out bit for bit as a GEMV row would:
 * whatever the batch, a quantized engine's row depends on that row only.
 *
 * That flush, a few instructions per 16 outputs per span, grows with the rows where the
 * dequantization did not; KILN_QUANT_AMX_MAX_ROWS is where the two meet (quant_gemv.h). On the
 * AMX Xeon of docs/benchmark-log.md, a Q4_0 16384 x 2048 linear at 16 / 24 / 32 / 40 / 64 rows:
 * 1.5 / 2.3 / 2.6 / 3.6 / 5.0 ms here, 3.0 / 3.3 / 3.4 / 3.9 / 4.0 ms dequantized.
 *
 * Tiles: 0-3 the sums of two row tiles times a panel's two output blocks; 4, 5 the row tiles'
 * x in the span; 6, 7 the blocks' codes there. Rows of x past m are zero up to the tile.
 */
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"
#include "quant_gemv.h"
#include "quant_layout.h"

#if defined(KILN_HAVE_QUANT_GEMV) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <immintrin.h>

static void configure_int8_tiles(int64_t span) {
    kiln_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {  /* 0-3: sums; 4, 5: 16 rows of x in a span; 6, 7: two blocks' codes there */
        cfg.rows[t] = t < 6 ? 16 : (uint8_t)(span / 4);
        cfg.colsb[t] = t == 4 || t == 5 ? (uint16_t)span : 64;
    }
    _tile_loadconfig(&cfg);
}

/* The codes of output block nb for span s as a B tile (span / 4 rows of 64 bytes: row q holds
 * each column's 4 codes of k 4q .. 4q + 3 of the span). */
static inline void span_codes(const kiln_qweight *W, int64_t nb, int64_t s, int64_t span, uint8_t *tile) {
    const __m512i mask = _mm512_set1_epi8(0x0f), table = e2m1_table();
    const int64_t chunks = span / 8, next_panel = 16 * W->k;  /* this thread's next panel, a panel on */
    __m512i hb = _mm512_setzero_si512();
    if (W->bits == 6) hb = _mm512_loadu_si512(W->codes + high_bits_at(W->n, W->k, nb, s));
    for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t *chunk = W->codes + chunk_at(W->n, W->k, nb, s * chunks + c);
        _mm_prefetch((const char *)(chunk + next_panel), _MM_HINT_T0);
        const __m512i bytes = _mm512_loadu_si512(chunk);
        __m512i low = _mm512_and_si512(bytes, mask), high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
        if (W->e2m1) {
            low = _mm512_shuffle_epi8(table, low);
            high = _mm512_shuffle_epi8(table, high);
        }
        if (W->bits == 6) {
            low = _mm512_or_si512(low, high_pair(hb, 2 * (int)c));
            high = _mm512_or_si512(high, high_pair(hb, 2 * (int)c + 1));
        }
        _mm512_storeu_si512(tile + 2 * c * 64, low);
        _mm512_storeu_si512(tile + (2 * c + 1) * 64, high);
    }
}

/* The int32 sums of 16 rows (`rows` of them real) x a panel's blocks in one span, flushed
 * into fp32 totals (row stride 32 floats): the GEMV's flush, operation for operation. */
static inline __attribute__((always_inline)) void flush_sums(const kiln_qweight *W, const kiln_gemv_input *in,
                                                             const int32_t (*sums)[256], int blocks, int64_t r0,
                                                             int64_t rows, int64_t s, const __m512 *sv,
                                                             const __m512 *ov, int32_t zero, float *total) {
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t at = (r0 + t) * in->spans + s;
        const __m512 xs = _mm512_set1_ps(in->xscale[at]), xsum = _mm512_set1_ps(in->xsum[at]);
        const __m512i shift = _mm512_set1_epi32(zero * in->isum[at]);
        for (int b = 0; b < blocks; ++b) {
            __m512i acc = _mm512_load_si512(sums[b] + t * 16);
            if (zero) acc = _mm512_sub_epi32(acc, shift);
            float *tot = total + (r0 + t) * 32 + b * 16;
            __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sv[b], xs), _mm512_loadu_ps(tot));
            if (W->offsets) v = _mm512_fmadd_ps(ov[b], xsum, v);
            _mm512_storeu_ps(tot, v);
        }
    }
}

/* One panel (1 or 2 output blocks at nb0) for rows [0, m) of the prepared x (rows past m are
 * zero up to a multiple of 16): fp32 sums into total[t][b * 16 + c]. Rows go in pairs of row
 * tiles, so each A tile load serves both blocks and each B tile load both row tiles. */
static void panel_sums(const kiln_qweight *W, const kiln_gemv_input *in, int64_t m, int64_t nb0, int blocks,
                       float *total) {
    const int64_t k = W->k, span = flush_span(W), spans = k / span;
    const int32_t zero = (int32_t)folded_zero(W);
    uint8_t tiles[2][512] __attribute__((aligned(64)));
    int32_t sums[4][256] __attribute__((aligned(64)));
    memset(total, 0, sizeof(float) * ((m + 15) / 16 * 16) * 32);
    for (int64_t s = 0; s < spans; ++s) {
        __m512 sv[2], ov[2];
        for (int b = 0; b < blocks; ++b) {
            span_codes(W, nb0 + b, s, span, tiles[b]);
            load_block_scales(W, nb0 + b, s * span / W->group, &sv[b], &ov[b]);
        }
        _tile_loadd(6, tiles[0], 64);
        if (blocks == 2) _tile_loadd(7, tiles[1], 64);
        for (int64_t r0 = 0; r0 < m; r0 += 32) {
            const int two = r0 + 16 < m;
            _tile_zero(0);
            _tile_loadd(4, in->x8 + r0 * k + s * span, k);
            _tile_dpbsud(0, 4, 6);
            if (blocks == 2) {
                _tile_zero(1);
                _tile_dpbsud(1, 4, 7);
            }
            if (two) {
                _tile_zero(2);
                _tile_loadd(5, in->x8 + (r0 + 16) * k + s * span, k);
                _tile_dpbsud(2, 5, 6);
                if (blocks == 2) {
                    _tile_zero(3);
                    _tile_dpbsud(3, 5, 7);
                }
            }
            _tile_stored(0, sums[0], 64);
            if (blocks == 2) _tile_stored(1, sums[1], 64);
            if (two) {
                _tile_stored(2, sums[2], 64);
                if (blocks == 2) _tile_stored(3, sums[3], 64);
            }
            for (int h = 0; h <= two; ++h) {
                const int64_t rt = r0 + 16 * h, rows = m - rt < 16 ? m - rt : 16;
                if (blocks == 2) flush_sums(W, in, sums + 2 * h, 2, rt, rows, s, sv, ov, zero, total);
                else flush_sums(W, in, sums + 2 * h, 1, rt, rows, s, sv, ov, zero, total);
            }
        }
    }
}

int kiln_quant_amx_linear(const bf16_t *x, const kiln_qweight *W, const bf16_t *bias, bf16_t *y, int64_t m,
                          int num_threads) {
    if (!kiln_amx_available() || (W->bits != 4 && W->bits != 6) || m > KILN_QUANT_AMX_MAX_ROWS) return 0;
    const int64_t k = W->k, mp = (m + 15) / 16 * 16, nblocks = W->n / 16;
    bf16_t *padded = calloc(mp * k, sizeof(bf16_t));  /* whole tiles of rows: zeros past m */
    if (padded == NULL) return 0;
    memcpy(padded, x, sizeof(bf16_t) * m * k);
    kiln_gemv_input in;
    void *mem = kiln_quant_gemv_prepare(padded, W, mp, &in);
    free(padded);
    if (mem == NULL) return 0;
    const int64_t span = flush_span(W);
    _Pragma("omp parallel num_threads(num_threads)")
    {
        configure_int8_tiles(span);
        float *total = aligned_alloc(64, sizeof(float) * mp * 32);
        _Pragma("omp for schedule(static)")
        for (int64_t panel = 0; panel < (nblocks + 1) / 2; ++panel) {
            const int64_t nb0 = 2 * panel;
            const int blocks = nblocks - nb0 < 2 ? 1 : 2;
            panel_sums(W, &in, m, nb0, blocks, total);
            for (int b = 0; b < blocks; ++b) {
                const __m512 bv = bias ? load16_bf16(bias + (nb0 + b) * 16) : _mm512_setzero_ps();
                for (int64_t t = 0; t < m; ++t)
                    _mm256_storeu_si256((__m256i *)(y + t * W->n + (nb0 + b) * 16),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(total + t * 32 + b * 16), bv)));
            }
        }
        free(total);
        _tile_release();
    }
    free(mem);
    return 1;
}
#elif defined(KILN_HAVE_QUANT_GEMV)
int kiln_quant_amx_linear(const bf16_t *x, const kiln_qweight *W, const bf16_t *bias, bf16_t *y, int64_t m,
                          int num_threads) {
    (void)x; (void)W; (void)bias; (void)y; (void)m; (void)num_threads;
    return 0;
}
#endif
