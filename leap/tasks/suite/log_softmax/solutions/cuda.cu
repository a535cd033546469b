#include <math.h>
#include <stdint.h>

__global__ void log_softmax_kernel(const float* x, float* y, int64_t m, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < m) {
        float best = x[i * n];
        for (int64_t j = 1; j < n; j++) {
            best = fmaxf(best, x[i * n + j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            sum += expf(x[i * n + j] - best);
        }
        float shift = best + logf(sum);
        for (int64_t j = 0; j < n; j++) {
            y[i * n + j] = x[i * n + j] - shift;
        }
    }
}

extern "C" void log_softmax(const float* x, float* y, int64_t m, int64_t n) {
    int64_t blocks = (m + 255) / 256;
    log_softmax_kernel<<<blocks, 256>>>(x, y, m, n);
}
