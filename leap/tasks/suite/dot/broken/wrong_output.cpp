#include <math.h>
#include <stdint.h>

extern "C" void dot(const float* x, const float* y, float* out, int64_t n) {
    float sum = 0.0f;
    #pragma omp parallel for reduction(+:sum)
    for (int64_t i = 0; i < n; i++) {
        sum += x[i] + y[i];
    }
    out[0] = sum;
}
