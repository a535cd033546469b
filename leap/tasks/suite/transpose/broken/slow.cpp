#include <math.h>
#include <stdint.h>

extern "C" void transpose(const float* x, float* y, int64_t m, int64_t n) {
    for (int64_t s = 0; s < 8; s++) {
        for (int64_t j = s; j < n; j += 8) {
            for (int64_t i = 0; i < m; i++) {
                y[j * m + i] = x[i * n + j];
            }
        }
    }
}
