/* quant_linear.c's GEMV over weight-only quantized codes, for the kernels that run it on parts
 * of stacked weights (moe_experts.c: the chosen experts of a mixture-of-experts block). */
#ifndef KILN_QUANT_GEMV_H
#define KILN_QUANT_GEMV_H

#include <stdint.h>

#include "dtypes.h"

/* A weight in the engine layout of quant_linear.c. */
typedef struct {
    const uint8_t *codes;            /* see quant_linear.c's layouts */
    const float *channel_scales;     /* int8 per channel: [n]; else NULL */
    const uint16_t *scales;          /* per group: float16 [n / 16][groups][16] (super: see below) */
    const uint16_t *offsets;         /* per group: float16 [n / 16][groups][16] (or super), or NULL */
    int64_t n, k, group, bits;       /* group: k for per-channel scales; bits 8, 6 or 4 */
    int e2m1;                        /* 4-bit codes are MXFP4's E2M1 nibbles */
    int super;                       /* scales and offsets as super-blocks (quant_linear.c) */
} kiln_qweight;

/* x prepared for the GEMV (kiln_quant_gemv_prepare): 16-bit codes and a scale per row (int8
 * weights), or int8 codes and a scale per span of 32 (4-bit); the sum of each span's x as the
 * kernel sees it. */
typedef struct {
    const int16_t *x16;
    const int8_t *x8;
    const float *xscale, *xsum;  /* xscale: per row (int8 weights) or per span (4-bit) */
    const int32_t *isum;         /* 4- and 6-bit: each span's sum of the int8 x */
    int64_t spans;
} kiln_gemv_input;

/* The integer GEMV takes AVX512-VNNI (quant_linear.c) or else AVX2 (quant_gemv_avx2.c); with
 * neither the functions below are absent. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KILN_QUANT_GEMV_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KILN_QUANT_GEMV_AVX2 1
#endif

/* Up to this many rows of x the GEMV beats dequantized tiles (quant_linear.c). With AVX2 alone
 * the tiles run on FMAs of bf16 widened to fp32, and the GEMV wins further: one 8192 x 2048
 * Q4_0 linear on a Zen 3, GEMV / tiles 5.6 / 8.5 ms at 16 rows, 10.5 / 11.9 at 32, even at 48. */
#ifdef KILN_QUANT_GEMV_AVX2
#define KILN_QUANT_GEMV_MAX_ROWS 32
#else
#define KILN_QUANT_GEMV_MAX_ROWS 12
#endif
#if defined(KILN_QUANT_GEMV_AVX512) || defined(KILN_QUANT_GEMV_AVX2)
#define KILN_HAVE_QUANT_GEMV 1
/* m rows of x [m, W->k] as a GEMV against any weight of W's format reads them; returns the one
 * allocation to free (NULL: out of memory). */
void *kiln_quant_gemv_prepare(const bf16_t *x, const kiln_qweight *W, int64_t m, kiln_gemv_input *in);
/* Output blocks a work unit takes (a 4-bit panel: 2; int8: 4), the last unit fewer. */
int64_t kiln_quant_gemv_unit(const kiln_qweight *W);
/* Rows t0 .. t0 + mt - 1 (mt 1-4) of the prepared x against output blocks nb0 .. nb0 + blocks - 1
 * (one unit): x W^T in fp32 (no bias) into out[t * 64 + 16 * b + c]. */
void kiln_quant_gemv_tile(const kiln_qweight *W, const kiln_gemv_input *in, int64_t t0, int mt, int64_t nb0,
                          int blocks, float *out);
/* Rows past the GEMV's, up to KILN_QUANT_AMX_MAX_ROWS (beyond it dequantized tiles win), on
 * AMX int8 tiles with the GEMV's numbers (quant_amx.c): 4- and 6-bit codes. Returns 0 when it does not take the call (no AMX,
 * int8 codes, too many rows, out of memory), and the caller dequantizes instead. */
#define KILN_QUANT_AMX_MAX_ROWS 32
int kiln_quant_amx_linear(const bf16_t *x, const kiln_qweight *W, const bf16_t *bias, bf16_t *y, int64_t m,
                          int num_threads);
#endif

#endif
