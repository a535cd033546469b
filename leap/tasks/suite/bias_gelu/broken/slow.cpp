#include <math.h>
#include <stdint.h>

extern "C" void bias_gelu(const float* x, const float* b, float* y, int64_t m, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        for (int64_t i = 0; i < m; i++) {
            float v = x[i * n + j] + b[j];
            y[i * n + j] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
        }
    }
}
