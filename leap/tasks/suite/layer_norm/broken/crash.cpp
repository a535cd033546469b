#include <math.h>
#include <stdint.h>

extern "C" void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t m, int64_t n) {
    #pragma omp parallel for
    for (int64_t i = 0; i < m; i++) {
        float mean = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            mean += x[i * n + j];
        }
        mean /= n;
        float var = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            float d = x[i * n + j] - mean;
            var += d * d;
        }
        float scale = 1.0f / sqrtf(var / n + 1e-5f);
        for (int64_t j = 0; j < n; j++) {
            y[i * n + j + 1] = (x[i * n + j] - mean) * scale * gamma[j] + beta[j];
        }
    }
}
