#include <math.h>
#include <stdint.h>

__global__ void gemv_kernel(const float* a, const float* x, float* y, int64_t m, int64_t k) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < m) {
        float sum = 0.0f;
        for (int64_t p = 0; p < k; p++) {
            sum += a[i * k + p] * x[p];
        }
        y[i] = sum;
    }
}

extern "C" void gemv(const float* a, const float* x, float* y, int64_t m, int64_t k) {
    int64_t blocks = (m + 255) / 256;
    gemv_kernel<<<blocks, 256>>>(a, x, y, m, k);
}
