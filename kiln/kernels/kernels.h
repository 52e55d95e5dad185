/* The kernels one kernel file calls in another (the fused decode step calls them all). */
#ifndef KILN_KERNELS_H
#define KILN_KERNELS_H

#include <stdint.h>

#include "dtypes.h"

#define DECLARE_KERNELS(SUFFIX, T)                                                                 \
void kiln_rmsnorm_##SUFFIX(const T *x, int64_t x_stride, const T *weight, T *out, int64_t rows,    \
                          int64_t dim, float eps, int num_threads);                                \
void kiln_silu_mul_##SUFFIX(const T *gu, int64_t gu_stride, T *out, int64_t rows, int64_t inter,   \
                           int num_threads);                                                       \
void kiln_rotary_##SUFFIX(T *x, int64_t token_stride, const float *cos, const float *sin,           \
                         int64_t tokens, int64_t heads, int64_t head_size, int64_t rot_dim,       \
                         int num_threads);                                                         \
void kiln_skinny_gemm_##SUFFIX(const T *x, const T *w, const T *bias, T *y, int64_t m, int64_t n,  \
                               int64_t k, int num_threads);                                        \
void kiln_head_gemm_##SUFFIX(const T *x, int64_t x_row, int64_t x_head, const T *w, T *y,          \
                             int64_t y_row, int64_t y_head, int64_t heads, int64_t m, int64_t n,   \
                             int64_t k, int num_threads);                                          \
int kiln_paged_decode_attention_##SUFFIX(const T *q, int64_t q_stride, const T *k_cache,          \
                                        const T *v_cache, const int64_t *token_index,             \
                                        const int64_t *block_tables, const int64_t *seq_lens,     \
                                        T *out, int64_t num_seqs, int64_t num_heads,              \
                                        int64_t num_kv_heads, int64_t head_size,                  \
                                        int64_t block_size, int64_t max_blocks, float scale,      \
                                        int64_t window, const float *alibi_slopes, float softcap, \
                                        const float *sinks, float k_scale, float v_scale,         \
                                        int num_threads);

int kiln_amx_available(void);
/* An AMX tile configuration (LDTILECFG's 64 bytes, palette 1): each tile's rows and bytes a row. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kiln_tile_config;
void kiln_set_amx(int enabled);
/* The bf16 tiles of output blocks nb0 .. nb0 + blocks - 1 (16 columns each; kblocks k-blocks of
 * 512 elements per block, block-major), from `weight`, using `scratch` (room for
 * KILN_MAX_PANEL_BLOCKS blocks) if needed. */
#define KILN_MAX_PANEL_BLOCKS 4
typedef const bf16_t *(*kiln_panel_fn)(const void *weight, int64_t nb0, int blocks, int64_t kblocks,
                                       bf16_t *scratch);
void kiln_amx_linear_panels(const bf16_t *x, kiln_panel_fn get_panel, const void *weight, const bf16_t *bias,
                            const float *col_scale, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads);
/* y[t][c] = (x W^T)[t][c] * col_scale[c] (no scale when NULL) + bias[c] (when not NULL): AMX
 * where available (and not turned off), else AVX512-BF16 dot products, else plain C
 * (panel_linear.c). */
void kiln_linear_panels(const bf16_t *x, kiln_panel_fn get_panel, const void *weight, const bf16_t *bias,
                        const float *col_scale, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads);
/* A GEMV tile: rows t0 .. t0 + mt - 1 (mt 1-4) against output blocks nb0 .. nb0 + blocks - 1
 * (blocks 1-4), fp32 sums into out[t * 64 + 16 * b + c]. */
typedef void (*kiln_gemv_tile_fn)(const void *ctx, int64_t t0, int mt, int64_t nb0, int blocks, float *out);
/* In a tile function: ROWS(MT) with MT the constant (1-4) that mt is, so the tile's loops are
 * compiled for each row count. */
#define KILN_GEMV_ROWS(mt, ROWS)                                                                   \
    switch (mt) {                                                                                  \
    case 1: ROWS(1) break;                                                                         \
    case 2: ROWS(2) break;                                                                         \
    case 3: ROWS(3) break;                                                                         \
    default: ROWS(4) break;                                                                        \
    }
/* y[t][c] = tile sums * col_scale[c] (none when NULL) + bias[c] (when not NULL): each thread
 * takes an equal run of whole units of `unit` output blocks (the weight layout's panel; 1 when
 * blocks stand alone) and walks it in tiles of one unit (up to four blocks when unit is 1), rows
 * in tiles of four, so a panel's weights stay in L1/L2 between row tiles (panel_linear.c). */
void kiln_gemv_panels(kiln_gemv_tile_fn tile, const void *ctx, const bf16_t *bias, const float *col_scale,
                      bf16_t *y, int64_t m, int64_t n, int64_t unit, int num_threads);
void kiln_packed_linear_bf16(const bf16_t *x, const bf16_t *packed, const bf16_t *bias, bf16_t *y, int64_t m,
                             int64_t n, int64_t k, int num_threads);
void kiln_amx_linear_bf16(const bf16_t *x, const bf16_t *packed, const bf16_t *bias, bf16_t *y, int64_t m,
                          int64_t n, int64_t k, int num_threads);

void kiln_fit_offset_groups(const float *x, const float *importance, int64_t rows, int64_t cols, int64_t group,
                            const float *stretch, int64_t num_stretch, float *scale_out, float *offset_out,
                            int num_threads);
void kiln_quant_pack(const uint8_t *codes, uint8_t *out, int64_t n, int64_t k, int64_t bits, int num_threads);
/* Or'd into kiln_quant_linear_bf16's bits: 4-bit codes are MXFP4's E2M1 nibbles (quant_linear.c). */
#define KILN_CODES_E2M1 0x100
/* Or'd in too: group scales and offsets are int8 codes times a float16 per super-block of
 * KILN_SUPER_K inputs (GGUF's K-quants), in KILN_SUPER_BYTES(group) per block of 16 columns. */
#define KILN_SCALES_SUPER 0x200
#define KILN_SUPER_K 256
#define KILN_SUPER_BYTES(group) ((KILN_SUPER_K / (group)) * 16 + 16 * 2)
void kiln_quant_linear_bf16(const bf16_t *x, const uint8_t *codes, const void *scales, const void *offsets,
                            int64_t bits, int64_t group, const bf16_t *bias, bf16_t *y, int64_t m, int64_t n,
                            int64_t k, int num_threads);

void kiln_fp8_quantize_rows(const bf16_t *x, int64_t m, int64_t k, const float *prequant, float act_scale,
                            bf16_t *out, int num_threads);
void kiln_fp8_linear_bf16(const bf16_t *x, const uint8_t *codes, const float *w_scale, float act_scale,
                          const float *prequant, const bf16_t *bias, bf16_t *y, int64_t m, int64_t n, int64_t k,
                          int num_threads);
void kiln_prepare_quant_input(const bf16_t *x, int64_t m, int64_t k, const float *prequant, float act_scale,
                              bf16_t *out, int num_threads);

/* One projection of every expert: expert e's codes at codes + e * codes_stride (bytes), its
 * scales and offsets (or NULL) likewise; bias [E, n] bf16 or NULL. bits as kiln_quant_linear_bf16
 * takes them (8, 6 or 4, flags or'd in); group 0: int8 with float32 scales per output channel. */
typedef struct {
    const uint8_t *codes;
    const uint8_t *scales, *offsets;
    const bf16_t *bias;
    int64_t codes_stride, scales_stride, offsets_stride;
    int64_t bits, group, n, k;
} kiln_experts;

enum { KILN_ACT_SILU = 0, KILN_ACT_CLAMPED_SWIGLU = 1 };
/* Routing and the chosen experts of a mixture-of-experts block (moe_experts.c). */
void kiln_moe_route(const void *logits, int64_t is_bf16, int64_t m, int64_t E, int64_t top_k, int64_t normalize,
                    int64_t *ids, float *weights);
int kiln_moe_experts_bf16(const bf16_t *x, int64_t m, int64_t top_k, const int64_t *ids, const float *weights,
                          int64_t num_experts, const kiln_experts *fc, const kiln_experts *proj,
                          const kiln_experts *shared_fc, const kiln_experts *shared_proj, const float *shared_weights,
                          int64_t act, float alpha, float limit, bf16_t *out, int num_threads);

int kiln_w8a8_supported(int64_t n, int64_t k);
void kiln_w8a8_linear_bf16(const bf16_t *x, const int8_t *codes, const float *w_scale, const float *prequant,
                           const bf16_t *bias, bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads);

DECLARE_KERNELS(f32, float)
DECLARE_KERNELS(bf16, bf16_t)

/* Decode attention over a quantized cache (int8 or float8 e4m3 codes, dequantized by
 * k_scale / v_scale); otherwise as kiln_paged_decode_attention_f32 / _bf16. */
#define DECLARE_QUANTIZED_KV_ATTENTION(NAME, T, KT)                                               \
int NAME(const T *q, int64_t q_stride, const KT *k_cache, const KT *v_cache,                       \
         const int64_t *token_index, const int64_t *block_tables, const int64_t *seq_lens, T *out, \
         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,             \
         int64_t block_size, int64_t max_blocks, float scale, int64_t window,                      \
         const float *alibi_slopes, float softcap, const float *sinks, float k_scale, float v_scale,\
         int num_threads);
DECLARE_QUANTIZED_KV_ATTENTION(kiln_paged_decode_attention_f32_i8, float, int8_t)
DECLARE_QUANTIZED_KV_ATTENTION(kiln_paged_decode_attention_bf16_i8, bf16_t, int8_t)
DECLARE_QUANTIZED_KV_ATTENTION(kiln_paged_decode_attention_f32_f8, float, fp8_t)
DECLARE_QUANTIZED_KV_ATTENTION(kiln_paged_decode_attention_bf16_f8, bf16_t, fp8_t)

#endif
