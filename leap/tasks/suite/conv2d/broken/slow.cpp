#include <math.h>
#include <stdint.h>

extern "C" void conv2d(const float* x, const float* f, float* y, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh, int64_t kw) {
    int64_t oh = h - kh + 1;
    int64_t ow = w - kw + 1;
    for (int64_t t = 0; t < o * oh * ow; t++) {
        y[t] = 0.0f;
    }
    for (int64_t ch = 0; ch < c; ch++) {
        for (int64_t v = 0; v < kw; v++) {
            for (int64_t u = 0; u < kh; u++) {
                for (int64_t s = 0; s < ow; s++) {
                    for (int64_t r = 0; r < oh; r++) {
                        for (int64_t q = 0; q < o; q++) {
                            y[(q * oh + r) * ow + s] += x[(ch * h + r + u) * w + s + v] * f[((q * c + ch) * kh + u) * kw + v];
                        }
                    }
                }
            }
        }
    }
}
