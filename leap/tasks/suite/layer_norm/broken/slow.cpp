#include <math.h>
#include <stdint.h>

extern "C" void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t m, int64_t n) {
    for (int64_t i = 0; i < m; i++) {
        float mean = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            mean += x[i * n + j];
        }
        mean /= n;
        for (int64_t j = 0; j < n; j++) {
            float var = 0.0f;
            for (int64_t k = 0; k < n; k++) {
                var += (x[i * n + k] - mean) * (x[i * n + k] - mean);
            }
            y[i * n + j] = (x[i * n + j] - mean) / sqrtf(var / n + 1e-5f) * gamma[j] + beta[j];
        }
    }
}
