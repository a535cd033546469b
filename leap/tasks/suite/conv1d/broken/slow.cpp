#include <math.h>
#include <stdint.h>

extern "C" void conv1d(const float* x, const float* w, float* y, int64_t n, int64_t kw) {
    for (int64_t i = 0; i < n - kw + 1; i++) {
        y[i] = 0.0f;
    }
    for (int64_t t = 0; t < kw; t++) {
        for (int64_t i = 0; i < n - kw + 1; i++) {
            y[i] += x[i + t] * w[t];
        }
    }
}
