#include <math.h>
#include <stdint.h>

extern "C" void gemv(const float* a, const float* x, float* y, int64_t m, int64_t k) {
    for (int64_t i = 0; i < m; i++) {
        y[i] = 0.0f;
    }
    for (int64_t p = 0; p < k; p++) {
        for (int64_t i = 0; i < m; i++) {
            y[i] += a[i * k + p] * x[p];
        }
    }
}
