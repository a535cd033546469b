#include <math.h>
#include <stdint.h>

extern "C" void gemv(const float* a, const float* x, float* y, int64_t m, int64_t k) {
    #pragma omp parallel for
    for (int64_t i = 0; i < m; i++) {
        float sum = 0.0f;
        for (int64_t p = 0; p < k; p++) {
            sum += a[i * k + p] * x[p];
        }
        y[i] = sum;
    }
}
