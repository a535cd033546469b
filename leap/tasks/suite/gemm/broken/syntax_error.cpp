#include <math.h>
#include <stdint.h>

extern "C" void gemm(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
    #pragma omp parallel for
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            c[i * n + j] = 0.0f;
        }
        for (int64_t p = 0; p < k; p++) {
            float av = a[i * k + p]
            for (int64_t j = 0; j < n; j++) {
                c[i * n + j] += av * b[p * n + j];
            }
        }
    }
}
