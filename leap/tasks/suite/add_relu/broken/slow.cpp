#include <math.h>
#include <stdint.h>

extern "C" void add_relu(const float* a, const float* b, float* y, int64_t n) {
    for (int64_t s = 0; s < 16; s++) {
        for (int64_t i = s; i < n; i += 16) {
            float v = a[i] + b[i];
            y[i] = v > 0.0f ? v : 0.0f;
        }
    }
}
