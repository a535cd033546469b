#include <math.h>
#include <stdint.h>

extern "C" void sigmoid(const float* x, float* y, int64_t n) {
    for (int64_t s = 0; s < 16; s++) {
        for (int64_t i = s; i < n; i += 16) {
            y[i] = 1.0f / (1.0f + expf(-x[i]));
        }
    }
}
