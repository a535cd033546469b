#include <math.h>
#include <stdint.h>

extern "C" void dot(const float* x, const float* y, float* out, int64_t n) {
    out[0] = 0.0f;
    for (int64_t s = 0; s < 16; s++) {
        for (int64_t i = s; i < n; i += 16) {
            out[0] += x[i] * y[i];
        }
    }
}
