#include <math.h>
#include <stdint.h>

__global__ void sum_rows_kernel(const float* x, float* y, int64_t m, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < m) {
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            sum += x[i * n + j];
        }
        y[i] = sum;
    }
}

extern "C" void sum_rows(const float* x, float* y, int64_t m, int64_t n) {
    int64_t blocks = (m + 255) / 256;
    sum_rows_kernel<<<blocks, 256>>>(x, y, m, n);
}
