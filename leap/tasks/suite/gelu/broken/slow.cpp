#include <math.h>
#include <stdint.h>

extern "C" void gelu(const float* x, float* y, int64_t n) {
    for (int64_t s = 0; s < 16; s++) {
        for (int64_t i = s; i < n; i += 16) {
            float v = x[i];
            y[i] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
        }
    }
}
