/* The importance-weighted scale/offset search of W4A16_IMATRIX (kiln/quantization/imatrix.py,
 * whose fit_groups is the same search in PyTorch): per group of `group` weights, 16 levels
 * w ~ code * scale + offset. Candidates: codes of the group's range stretched over `stretch[i]`
 * steps; for each, the weighted least-squares scale and offset of those codes in closed form and
 * its weighted squared error from the same sums; the lowest error wins, the plain range (15 steps,
 * offset at the minimum) being the first candidate. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

void kiln_fit_offset_groups(const float *x, const float *importance, int64_t rows, int64_t cols, int64_t group,
                            const float *stretch, int64_t num_stretch, float *scale_out, float *offset_out,
                            int num_threads) {
    const int64_t per_row = cols / group, total = rows * per_row;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t gi = 0; gi < total; gi++) {
        const float *v = x + (gi / per_row) * cols + (gi % per_row) * group;
        const float *w = importance + (gi % per_row) * group;
        float low = v[0], high = v[0];
        double sw = 0, sx = 0, sxx = 0;
        for (int64_t j = 0; j < group; j++) {
            low = v[j] < low ? v[j] : low;
            high = v[j] > high ? v[j] : high;
            sw += w[j];
            sx += (double)w[j] * v[j];
            sxx += (double)w[j] * v[j] * v[j];
        }
        float span = high - low > 1e-12f ? high - low : 1e-12f;
        double best_scale = span / 15.0, best_offset = low, best_error = 0;
        for (int64_t j = 0; j < group; j++) {
            float c = rintf((v[j] - low) / (float)best_scale);
            c = c < 0 ? 0 : (c > 15 ? 15 : c);
            double e = c * best_scale + low - v[j];
            best_error += w[j] * e * e;
        }
        for (int64_t s = 0; s < num_stretch; s++) {
            const float inv = stretch[s] / span;
            double sc = 0, scc = 0, sxc = 0;
            for (int64_t j = 0; j < group; j++) {
                float c = rintf((v[j] - low) * inv);
                c = c < 0 ? 0 : (c > 15 ? 15 : c);
                sc += (double)w[j] * c;
                scc += (double)w[j] * c * c;
                sxc += (double)w[j] * v[j] * c;
            }
            const double det = sw * scc - sc * sc;
            if (!(det > 0)) continue;
            const double a = (sw * sxc - sx * sc) / det, b = (scc * sx - sc * sxc) / det;
            if (!(a > 0)) continue;
            const double error = sxx - 2 * a * sxc - 2 * b * sx + a * a * scc + 2 * a * b * sc + b * b * sw;
            if (error < best_error) {
                best_error = error;
                best_scale = a;
                best_offset = b;
            }
        }
        scale_out[gi] = (float)best_scale;
        offset_out[gi] = (float)best_offset;
    }
}
