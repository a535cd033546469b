#include <math.h>
#include <stdint.h>

extern "C" void batched_gemm(const float* a, const float* b, float* c, int64_t batch, int64_t m, int64_t n, int64_t k) {
    for (int64_t s = 0; s < batch; s++) {
        for (int64_t j = 0; j < n; j++) {
            for (int64_t i = 0; i < m; i++) {
                float sum = 0.0f;
                for (int64_t p = 0; p < k; p++) {
                    sum += a[(s * m + i) * k + p] * b[(s * k + p) * n + j];
                }
                c[(s * m + i) * n + j] = sum;
            }
        }
    }
}
