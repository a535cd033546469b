#include <math.h>
#include <stdint.h>

extern "C" void rms_norm(const float* x, const float* w, float* y, int64_t m, int64_t n) {
    for (int64_t i = 0; i < m; i++) {
        float sq = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            sq += x[i * n + j] * x[i * n + j];
        }
        for (int64_t j = 0; j < n; j++) {
            y[i * n + j] = sq;
        }
    }
    for (int64_t j = 0; j < n; j++) {
        for (int64_t i = 0; i < m; i++) {
            y[i * n + j] = x[i * n + j] / sqrtf(y[i * n + j] / n + 1e-6f) * w[j];
        }
    }
}
