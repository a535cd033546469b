#include <math.h>
#include <stdint.h>

extern "C" void transpose(const float* x, float* y, int64_t m, int64_t n) {
    for (int64_t s = 0; s < 8; s++) {
        for (int64_t i = s; i < m; i += 8) {
            for (int64_t j = 0; j < n; j++) {
                y[j * m + i] = x[i * n + j];
            }
        }
    }
}
