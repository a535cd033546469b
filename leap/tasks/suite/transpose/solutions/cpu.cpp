#include <math.h>
#include <stdint.h>

extern "C" void transpose(const float* x, float* y, int64_t m, int64_t n) {
    #pragma omp parallel for
    for (int64_t j = 0; j < n; j++) {
        for (int64_t i = 0; i < m; i++) {
            y[j * m + i] = x[i * n + j];
        }
    }
}
