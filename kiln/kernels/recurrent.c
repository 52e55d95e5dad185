/* Decode steps of the recurrent layers of hybrid models: one token for each of m sequences, each
 * reading its state from slot read[t] (zeros when fresh[t]) and writing the next state to slot
 * write[t] (kiln.runtime.state_slots), each state read and written once.
 *
 * kiln_gated_delta_decode_*: Gated DeltaNet (kiln.layers.gated_delta_net) from its projections'
 * outputs to out_proj's input. Per token: the causal convolution of the q, k, v channels over the
 * carried last K-1 inputs (conv_state [slots, K-1, channels], the model dtype) then silu, rounded
 * to the model dtype; per value head h (key head h / r, or h % key_heads when tiled): q and k
 * L2-normalised (q times key_dim^-1/2), beta = sigmoid(b) (rounded to the model dtype),
 * g = -exp(A_log) softplus(a + dt_bias), and on the float32 state S (delta_state [slots, heads,
 * key_dim, value_dim]):
 *
 *   S = exp(g) S;  u = beta (v - k^T S);  S += k u^T;  o = q^T S
 *
 * then o (rounded to the model dtype) RMS-normalised over the head, times the norm weight and
 * silu(z): out [m, heads * value_dim].
 *
 * kiln_short_conv_decode_*: LFM2's block from in_proj's output [m, 3 hidden] (b | c | x) to
 * out_proj's input: c * conv(b * x), the convolution over the carried last K-1 gated inputs.
 *
 * kiln_mamba2_decode_*: Mamba2 (kiln.layers.mamba2) from in_proj's output [m, inner | conv | heads]
 * to the SSM output y (float32 [m, inner], before the gated norm): silu(conv(x | B | C)) over the
 * carried last K-1 inputs (rounded to the model dtype), then per head h (group g = h / (heads /
 * groups)) dt = clamp(softplus(dt + dt_bias), dt_min, dt_max), A = -exp(A_log) and on the float32
 * state S (ssm_state [slots, heads, head_dim, state_size]):
 *
 *   S = exp(dt A) S + dt x B_g^T;  y = S C_g + D x
 *
 * Both round where the PyTorch path (kiln.layers.*) rounds, so the two agree to float rounding.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "dtypes.h"

/* A row of the next state written past the caches (non-temporal stores): the write slot is not
 * the read slot, so plain stores would first read every line they write (read for ownership),
 * a third pass over the largest thing a decode step touches; the next step reads the row from
 * memory anyway. Plain copies where the row is not aligned or there are no such stores. */
static inline void store_state_row(float *dst, const float *src, int64_t n) {
#if defined(__AVX512F__)
    if (((uintptr_t)dst & 63) == 0 && n % 16 == 0) {
        for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
        return;
    }
#elif defined(__AVX__)
    if (((uintptr_t)dst & 31) == 0 && n % 8 == 0) {
        for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
        return;
    }
#endif
    memcpy(dst, src, sizeof(float) * n);
}

/* Non-temporal stores are weakly ordered: each thread fences its own before the region ends. */
static inline void state_rows_stored(void) {
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence();
#endif
}

static inline float silu(float x) { return x / (1.f + expf(-x)); }
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

#define DEFINE_RECURRENT(SUFFIX, T, LOAD, STORE)                                                   \
                                                                                                   \
/* The convolution of one token's channels c0 .. c1 - 1 (input: channel c0's input; the window is  \
 * the state's rows, then the input), written as float32 rounded through the model dtype to       \
 * out[c - c0]; the state's rows move up one into next_state, the input last. */                  \
static void conv_token_##SUFFIX(const T *input, const T *conv_w, const T *conv_b, const T *state, \
                                T *next_state, int64_t channels, int64_t kernel, int64_t c0,      \
                                int64_t c1, int activation, float *out) {                         \
    for (int64_t c = c0; c < c1; ++c) {                                                            \
        float sum = 0.f;                                                                           \
        for (int64_t k = 0; k < kernel - 1; ++k) {                                                 \
            const T v = state ? state[k * channels + c] : STORE(0.f);                              \
            sum += LOAD(conv_w[c * kernel + k]) * LOAD(v);                                         \
            if (k > 0) next_state[(k - 1) * channels + c] = v;                                     \
        }                                                                                          \
        sum += LOAD(conv_w[c * kernel + kernel - 1]) * LOAD(input[c - c0]);                        \
        next_state[(kernel - 2) * channels + c] = input[c - c0];                                   \
        const float acc = (conv_b ? LOAD(conv_b[c]) : 0.f) + sum;                                  \
        out[c - c0] = LOAD(STORE(activation ? silu(acc) : acc));                                   \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* Every token's convolution with silu, channels in chunks spread over the threads of the         \
 * enclosing parallel region (an orphaned omp for): conv_out [m, channels] float32. */           \
static void conv_rows_##SUFFIX(const T *input, int64_t stride, const T *conv_w, const T *conv_b,  \
                               T *conv_state, const int64_t *read, const int64_t *write,          \
                               const uint8_t *fresh, int64_t m, int64_t channels, int64_t kernel, \
                               float *conv_out) {                                                 \
    const int64_t per_slot = (kernel - 1) * channels, chunk = 512;                                 \
    const int64_t chunks = (channels + chunk - 1) / chunk;                                         \
    _Pragma("omp for schedule(static)")                                                            \
    for (int64_t item = 0; item < m * chunks; ++item) {                                            \
        const int64_t t = item / chunks, c0 = item % chunks * chunk;                               \
        const int64_t c1 = c0 + chunk < channels ? c0 + chunk : channels;                          \
        conv_token_##SUFFIX(input + t * stride + c0, conv_w, conv_b,                               \
                            fresh[t] ? NULL : conv_state + read[t] * per_slot,                     \
                            conv_state + write[t] * per_slot, channels, kernel, c0, c1, 1,         \
                            conv_out + t * channels + c0);                                         \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
void kiln_short_conv_decode_##SUFFIX(const T *bcx, int64_t stride, const T *conv_w, const T *conv_b, \
                                     T *conv_state, const int64_t *read, const int64_t *write,    \
                                     const uint8_t *fresh, T *out, int64_t m, int64_t hidden,     \
                                     int64_t kernel, int num_threads) {                           \
    const int64_t per_slot = (kernel - 1) * hidden, chunk = 256;                                   \
    const int64_t chunks = (hidden + chunk - 1) / chunk;                                           \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                          \
    for (int64_t item = 0; item < m * chunks; ++item) {                                            \
        const int64_t t = item / chunks, c0 = item % chunks * chunk;                               \
        const int64_t c1 = c0 + chunk < hidden ? c0 + chunk : hidden;                              \
        const T *b = bcx + t * stride, *c = b + hidden, *x = c + hidden;                           \
        T gated[256];                                                                              \
        float y[256];                                                                              \
        for (int64_t j = c0; j < c1; ++j) gated[j - c0] = STORE(LOAD(b[j]) * LOAD(x[j]));          \
        conv_token_##SUFFIX(gated, conv_w, conv_b, fresh[t] ? NULL : conv_state + read[t] * per_slot, \
                            conv_state + write[t] * per_slot, hidden, kernel, c0, c1, 0, y);       \
        for (int64_t j = c0; j < c1; ++j) out[t * hidden + j] = STORE(LOAD(c[j]) * y[j - c0]);     \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
int kiln_gated_delta_decode_##SUFFIX(                                                              \
        const T *mixed, int64_t mixed_stride, const T *z, int64_t z_stride, const T *b, int64_t b_stride, \
        const T *a, int64_t a_stride, const T *conv_w, T *conv_state, float *delta_state,         \
        const T *a_log, const T *dt_bias, const T *norm_w, float eps, const int64_t *read,          \
        const int64_t *write, const uint8_t *fresh, T *out, int64_t m, int64_t key_heads,         \
        int64_t value_heads, int64_t key_dim, int64_t value_dim, int64_t kernel, int64_t tiled,   \
        int num_threads) {                                                                         \
    const int64_t keys = key_heads * key_dim, channels = 2 * keys + value_heads * value_dim;       \
    const int64_t state_size = key_dim * value_dim;                                                \
    float *conv_out = malloc(sizeof(float) * m * channels);                                        \
    if (!conv_out) return 1;                                                                       \
    _Pragma("omp parallel num_threads(num_threads)")                                               \
    {                                                                                              \
        conv_rows_##SUFFIX(mixed, mixed_stride, conv_w, NULL, conv_state, read, write, fresh, m,   \
                           channels, kernel, conv_out);                                            \
        _Pragma("omp for schedule(static)")                                                        \
        for (int64_t item = 0; item < m * value_heads; ++item) {                                   \
            const int64_t t = item / value_heads, h = item % value_heads;                          \
            const int64_t kh = tiled ? h % key_heads : h / (value_heads / key_heads);              \
            const float *row = conv_out + t * channels;                                            \
            const float *q_in = row + kh * key_dim, *k_in = row + keys + kh * key_dim;             \
            const float *v = row + 2 * keys + h * value_dim;                                       \
            float q[key_dim], k[key_dim], pred[value_dim], o[value_dim];                           \
            float qq = 0.f, kk = 0.f;                                                              \
            for (int64_t i = 0; i < key_dim; ++i) { qq += q_in[i] * q_in[i]; kk += k_in[i] * k_in[i]; } \
            const float q_scale = 1.f / sqrtf(qq + 1e-6f), k_scale = 1.f / sqrtf(kk + 1e-6f);       \
            const float head_scale = 1.f / sqrtf((float)key_dim);                                  \
            for (int64_t i = 0; i < key_dim; ++i) {                                                \
                q[i] = q_in[i] * q_scale * head_scale;                                             \
                k[i] = k_in[i] * k_scale;                                                          \
            }                                                                                      \
            const float beta = LOAD(STORE(1.f / (1.f + expf(-LOAD(b[t * b_stride + h])))));       \
            const float g = -expf(LOAD(a_log[h])) * softplus(LOAD(a[t * a_stride + h]) + LOAD(dt_bias[h])); \
            const float decay = expf(g);                                                           \
            const float *S = fresh[t] ? NULL : delta_state + (read[t] * value_heads + h) * state_size; \
            float *N = delta_state + (write[t] * value_heads + h) * state_size;                    \
            for (int64_t j = 0; j < value_dim; ++j) { pred[j] = 0.f; o[j] = 0.f; }                 \
            if (S)                                                                                 \
                for (int64_t i = 0; i < key_dim; ++i) {                                            \
                    const float ki = k[i] * decay;                                                 \
                    for (int64_t j = 0; j < value_dim; ++j) pred[j] += ki * S[i * value_dim + j];  \
                }                                                                                  \
            for (int64_t j = 0; j < value_dim; ++j) pred[j] = (v[j] - pred[j]) * beta;             \
            for (int64_t i = 0; i < key_dim; ++i) {                                                \
                const float ki = k[i], qi = q[i];                                                  \
                float n[value_dim];                                                                \
                for (int64_t j = 0; j < value_dim; ++j) {                                          \
                    n[j] = (S ? decay * S[i * value_dim + j] : 0.f) + ki * pred[j];                \
                    o[j] += qi * n[j];                                                             \
                }                                                                                  \
                store_state_row(N + i * value_dim, n, value_dim);                                  \
            }                                                                                      \
            /* The gated RMSNorm over the head, as kiln.layers.gated_delta_net.GatedRmsNorm. */    \
            float ss = 0.f;                                                                        \
            for (int64_t j = 0; j < value_dim; ++j) { o[j] = LOAD(STORE(o[j])); ss += o[j] * o[j]; } \
            const float inv = 1.f / sqrtf(ss / (float)value_dim + eps);                            \
            const T *zh = z + t * z_stride + h * value_dim;                                        \
            T *oh = out + t * value_heads * value_dim + h * value_dim;                              \
            for (int64_t j = 0; j < value_dim; ++j) {                                              \
                const float normed = LOAD(STORE(LOAD(STORE(o[j] * inv)) * LOAD(norm_w[j])));       \
                oh[j] = STORE(normed * silu(LOAD(zh[j])));                                         \
            }                                                                                      \
        }                                                                                          \
        state_rows_stored();                                                                       \
    }                                                                                              \
    free(conv_out);                                                                                \
    return 0;                                                                                      \
}                                                                                                  \
                                                                                                   \
int kiln_mamba2_decode_##SUFFIX(                                                                   \
        const T *proj, int64_t stride, const T *conv_w, const T *conv_b, T *conv_state, float *ssm_state, \
        const T *a_log, const T *dt_bias, const T *d_skip, const int64_t *read, const int64_t *write, \
        const uint8_t *fresh, float *y, int64_t m, int64_t heads, int64_t head_dim, int64_t state_size, \
        int64_t groups, int64_t kernel, float dt_min, float dt_max, int num_threads) {              \
    const int64_t inner = heads * head_dim, channels = inner + 2 * groups * state_size;            \
    const int64_t state_per_head = head_dim * state_size;                                          \
    float *conv_out = malloc(sizeof(float) * m * channels);                                        \
    if (!conv_out) return 1;                                                                       \
    _Pragma("omp parallel num_threads(num_threads)")                                               \
    {                                                                                              \
        conv_rows_##SUFFIX(proj + inner, stride, conv_w, conv_b, conv_state, read, write, fresh, m, \
                           channels, kernel, conv_out);                                            \
        _Pragma("omp for schedule(static)")                                                        \
        for (int64_t item = 0; item < m * heads; ++item) {                                         \
            const int64_t t = item / heads, h = item % heads, g = h / (heads / groups);            \
            const float *x = conv_out + t * channels + h * head_dim;                               \
            const float *B = conv_out + t * channels + inner + g * state_size;                     \
            const float *C = B + groups * state_size;                                              \
            float dt = softplus(LOAD(proj[t * stride + inner + channels + h]) + LOAD(dt_bias[h])); \
            dt = fminf(fmaxf(dt, dt_min), dt_max);                                                 \
            const float decay = expf(-expf(LOAD(a_log[h])) * dt), dh = LOAD(d_skip[h]);            \
            const float *S = fresh[t] ? NULL : ssm_state + (read[t] * heads + h) * state_per_head; \
            float *N = ssm_state + (write[t] * heads + h) * state_per_head;                        \
            float *out = y + t * inner + h * head_dim;                                             \
            for (int64_t p = 0; p < head_dim; ++p) {                                               \
                const float xdt = dt * x[p];                                                       \
                float acc = 0.f, row[state_size];                                                  \
                for (int64_t n = 0; n < state_size; ++n) {                                         \
                    const int64_t i = p * state_size + n;                                          \
                    row[n] = (S ? decay * S[i] : 0.f) + xdt * B[n];                                \
                    acc += row[n] * C[n];                                                          \
                }                                                                                  \
                store_state_row(N + p * state_size, row, state_size);                              \
                out[p] = acc + dh * x[p];                                                          \
            }                                                                                      \
        }                                                                                          \
        state_rows_stored();                                                                       \
    }                                                                                              \
    free(conv_out);                                                                                \
    return 0;                                                                                      \
}

DEFINE_RECURRENT(f32, float, f32_load, f32_store)
DEFINE_RECURRENT(bf16, bf16_t, bf16_load, bf16_store)
