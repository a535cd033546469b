#include <math.h>
#include <stdint.h>

extern "C" void matmul_relu(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
    for (int64_t j = 0; j < n; j++) {
        for (int64_t i = 0; i < m; i++) {
            float sum = 0.0f;
            for (int64_t p = 0; p < k; p++) {
                sum += a[i * k + p] * b[p * n + j];
            }
            c[i * n + j] = sum > 0.0f ? sum : 0.0f;
        }
    }
}
