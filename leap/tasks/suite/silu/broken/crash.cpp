#include <math.h>
#include <stdint.h>

extern "C" void silu(const float* x, float* y, int64_t n) {
    #pragma omp parallel for
    for (int64_t i = 0; i <= n; i++) {
        y[i] = x[i] / (1.0f + expf(-x[i]));
    }
}
