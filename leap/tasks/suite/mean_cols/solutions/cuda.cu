#include <math.h>
#include <stdint.h>

__global__ void mean_cols_kernel(const float* x, float* y, int64_t m, int64_t n) {
    int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (j < n) {
        float sum = 0.0f;
        for (int64_t i = 0; i < m; i++) {
            sum += x[i * n + j];
        }
        y[j] = sum / m;
    }
}

extern "C" void mean_cols(const float* x, float* y, int64_t m, int64_t n) {
    int64_t blocks = (n + 255) / 256;
    mean_cols_kernel<<<blocks, 256>>>(x, y, m, n);
}
