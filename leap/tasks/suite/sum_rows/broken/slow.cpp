#include <math.h>
#include <stdint.h>

extern "C" void sum_rows(const float* x, float* y, int64_t m, int64_t n) {
    for (int64_t i = 0; i < m; i++) {
        y[i] = 0.0f;
    }
    for (int64_t j = 0; j < n; j++) {
        for (int64_t i = 0; i < m; i++) {
            y[i] += x[i * n + j];
        }
    }
}
