#include <math.h>
#include <stdint.h>

extern "C" void prefix_sum(const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int64_t k = 0; k <= i; k++) {
            sum += x[k];
        }
        y[i] = sum;
    }
}
