#include <math.h>
#include <stdint.h>

extern "C" void mean_cols(const float* x, float* y, int64_t m, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        y[j] = 0.0f;
        for (int64_t i = 0; i < m; i++) {
            y[j] += x[i * n + j] / m;
        }
    }
}
