/* Element types shared by the kernels: bfloat16 stored as its 16 bits, and loads/stores that
 * convert to and from the fp32 the kernels compute in. */
#ifndef KILN_KERNELS_DTYPES_H
#define KILN_KERNELS_DTYPES_H

#include <math.h>
#include <stdint.h>

typedef uint16_t bf16_t;

static inline float bf16_load(bf16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline bf16_t bf16_store(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40u); /* quiet NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (bf16_t)(v.u >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bf16 values as fp32 lanes (exact: a shift). */
static inline __m512 load16_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}
#endif

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

/* Quantized KV cache codes (kiln.step.attention.quantize_kv computes the same ones): the
 * value written is v = x * (1 / scale) in fp32, stored as int8 round(v) clamped to +-127, or
 * as float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, subnormals below
 * 2^-6, no infinities, 0x7F/0xFF NaN) saturated to +-448 and rounded to nearest even. v must
 * be finite. nearbyintf rounds half to even under the default rounding mode, as torch.round. */
typedef uint8_t fp8_t;

static inline int8_t i8_store(float v) {
    const float r = nearbyintf(v);
    return (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
}

static inline float i8_load(int8_t x) { return (float)x; }

static inline fp8_t fp8_store(float v) {
    union { float f; uint32_t u; } b = {v};
    const uint32_t sign = (b.u >> 24) & 0x80u;
    b.u &= 0x7fffffffu;
    if (b.f > 448.f) return (fp8_t)(sign | 0x7eu); /* saturate: 448 is e4m3's largest finite value */
    if (b.u < (121u << 23)) /* below 2^-6: subnormal, a uniform step of 2^-9 (code 8 is 2^-6 itself) */
        return (fp8_t)(sign | (uint32_t)nearbyintf(b.f * 512.f));
    /* Round the fp32 mantissa to 3 bits, nearest even (a carry moves into the exponent), then
     * rebias the exponent from 127 to 7. */
    const uint32_t rounded = b.u + 0x7ffffu + ((b.u >> 20) & 1u);
    return (fp8_t)(sign | ((rounded >> 20) - (120u << 3)));
}

/* The kinds of KV cache element (kiln_decoder_dims.kv_kind; kiln.kernels.KV_KINDS). */
enum { KILN_KV_FLOAT = 0, KILN_KV_INT8 = 1, KILN_KV_FP8 = 2 };

/* Element i of a quantized cache of `kind` set to the code of v (= x / scale). */
static inline void kv_store(void *codes, int64_t i, float v, int64_t kind) {
    if (kind == KILN_KV_INT8) ((int8_t *)codes)[i] = i8_store(v);
    else ((fp8_t *)codes)[i] = fp8_store(v);
}

/* Exact for every code but NaN: normals by rebasing the exponent field (+120), subnormals as
 * their mantissa times 2^-9. No step goes through an fp32 subnormal, so a thread running with
 * denormals-are-zero still reads the right values. */
static inline float fp8_load(fp8_t x) {
    const uint32_t mag = x & 0x7fu;
    union { float f; uint32_t u; } v;
    if (mag < 8u) v.f = (float)mag * 0x1p-9f;
    else v.u = (mag << 20) + (120u << 23);
    v.u |= (uint32_t)(x & 0x80u) << 24;
    return v.f;
}

#endif
