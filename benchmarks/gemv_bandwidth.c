/* The quantized GEMV's weight bandwidth against a plain read of memory, in one process.
 *
 * Every linear of a SmolLM2-135M decode step (30 layers of qkv 960x576, dense 576x576, fused
 * gate/up 3072x576, down 576x1536) as kiln_quant_linear_bf16 runs them at batch 1, each
 * call after the last as in the native decode step, alternated with a 2-thread read of a
 * 64 MB buffer: the memory bandwidth the machine gives at that moment, the GEMV's ceiling.
 * Codes are constant bytes (speed does not depend on them); 4-bit with group 64 and zero
 * points. Prints GB/s of weights (codes, scales, zeros) and the ratio, per round and mean.
 *
 *   cc -O3 -march=native -ffast-math -fopenmp -Ikiln/kernels benchmarks/gemv_bandwidth.c \
 *       kiln/kernels/[a-z]*.c -o /tmp/gemv_bandwidth -lm
 *   /tmp/gemv_bandwidth [bits 4|8] [rows] [rounds]
 *
 * To compare two versions of quant_linear.c, build this twice (or link both under renamed
 * symbols) and run them alternately.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

void kiln_quant_linear_bf16(const bf16_t *x, const uint8_t *codes, const void *scales, const void *zeros,
                            int64_t bits, int64_t group, const bf16_t *bias, bf16_t *y, int64_t m, int64_t n,
                            int64_t k, int num_threads);

enum { LAYERS = 30, LINEARS = 4, GROUP = 64, STEPS = 10 };
static const int64_t SHAPES[LINEARS][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};

static int64_t read_all(const void *p, size_t bytes) {
    int64_t total = 0;
    _Pragma("omp parallel num_threads(2) reduction(+:total)")
    {
        __m512i a = _mm512_setzero_si512();
        _Pragma("omp for schedule(static)")
        for (size_t i = 0; i < bytes / 64; ++i) a = _mm512_xor_si512(a, _mm512_load_si512((const char *)p + i * 64));
        total += _mm512_reduce_add_epi32(a);
    }
    return total;
}

int main(int argc, char **argv) {
    const int bits = argc > 1 ? atoi(argv[1]) : 4, rows = argc > 2 ? atoi(argv[2]) : 1;
    const int rounds = argc > 3 ? atoi(argv[3]) : 12;
    void *codes[LAYERS][LINEARS], *scales[LAYERS][LINEARS], *zeros[LAYERS][LINEARS];
    double bytes = 0;
    for (int l = 0; l < LAYERS; ++l)
        for (int s = 0; s < LINEARS; ++s) {
            const int64_t n = SHAPES[s][0], k = SHAPES[s][1], groups = n * k / GROUP;
            codes[l][s] = aligned_alloc(64, n * k * bits / 8);
            memset(codes[l][s], 0x37, n * k * bits / 8);
            if (bits == 8) {
                float *f = aligned_alloc(64, n * sizeof(float));
                for (int64_t i = 0; i < n; ++i) f[i] = 0.01f;
                scales[l][s] = f;
                zeros[l][s] = NULL;
                bytes += n * k + n * sizeof(float);
                continue;
            }
            uint16_t *h = aligned_alloc(64, groups * sizeof(uint16_t));
            for (int64_t i = 0; i < groups; ++i) h[i] = 0x2000;  /* float16 2^-7 */
            scales[l][s] = h;
            zeros[l][s] = aligned_alloc(64, groups);
            memset(zeros[l][s], 8, groups);
            bytes += n * k / 2 + groups * 3;
        }
    const size_t big_bytes = 64 << 20;
    void *big = aligned_alloc(2 << 20, big_bytes);
    memset(big, 1, big_bytes);
    bf16_t *x = malloc(sizeof(bf16_t) * rows * 1536), *y = malloc(sizeof(bf16_t) * rows * 3072);
    for (int i = 0; i < rows * 1536; ++i) x[i] = (bf16_t)(0x3f80 + i % 7);
    volatile int64_t sink = 0;
    double sum_read = 0, sum_gemv = 0;
    for (int r = 0; r < rounds; ++r) {
        double t = omp_get_wtime();
        for (int i = 0; i < STEPS; ++i) sink += read_all(big, big_bytes);
        const double read = big_bytes * (double)STEPS / (omp_get_wtime() - t) / 1e9;
        t = omp_get_wtime();
        for (int i = 0; i < STEPS; ++i)
            for (int l = 0; l < LAYERS; ++l)
                for (int s = 0; s < LINEARS; ++s)
                    kiln_quant_linear_bf16(x, codes[l][s], scales[l][s], zeros[l][s], bits,
                                           bits == 4 ? GROUP : SHAPES[s][1], NULL, y, rows, SHAPES[s][0],
                                           SHAPES[s][1], 2);
        const double gemv = bytes * STEPS / (omp_get_wtime() - t) / 1e9;
        printf("round %2d: read %.1f GB/s, %d-bit GEMV %.1f GB/s (%.0f%%)\n", r, read, bits, gemv, 100 * gemv / read);
        if (r >= 2) { sum_read += read; sum_gemv += gemv; }  /* the first two warm up */
    }
    if (rounds > 2)
        printf("mean of rounds 2-%d: read %.1f GB/s, GEMV %.1f GB/s (%.0f%%)\n", rounds - 1, sum_read / (rounds - 2),
               sum_gemv / (rounds - 2), 100 * sum_gemv / sum_read);
    return 0;
}
