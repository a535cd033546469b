#include <math.h>
#include <stdint.h>

extern "C" void cumsum_rows(const float* x, float* y, int64_t m, int64_t n) {
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            float sum = 0.0f;
            for (int64_t k = 0; k <= j; k++) {
                sum += x[i * n + k];
            }
            y[i * n + j] = sum;
        }
    }
}
