#include <math.h>
#include <stdint.h>

extern "C" void batched_gemm(const float* a, const float* b, float* c, int64_t batch, int64_t m, int64_t n, int64_t k) {
    #pragma omp parallel for collapse(2)
    for (int64_t s = 0; s < batch; s++) {
        for (int64_t i = 0; i < m; i++) {
            const float* as = a + s * m * k;
            const float* bs = b + s * k * n;
            float* cs = c + s * m * n;
            for (int64_t j = 0; j < n; j++) {
                cs[i * n + j] = 0.0f;
            }
            for (int64_t p = 0; p < k; p++) {
                for (int64_t j = 0; j < n; j++) {
                    cs[i * n + j] += as[i * k + p] * bs[p * n + j];
                }
            }
        }
    }
}
