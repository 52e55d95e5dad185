/* Element types shared by the kernels: bfloat16 stored as its 16 bits, and loads/stores that
 * convert to and from the fp32 the kernels compute in. */
#ifndef KILN_KERNELS_DTYPES_H
#define KILN_KERNELS_DTYPES_H

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

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#endif
