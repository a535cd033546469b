#include <math.h>
#include <stdint.h>

__global__ void silu_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = x[i] / (1.0f + expf(-x[i]));
    }
}

extern "C" void silu(const float* x, float* y, int64_t n) {
    int64_t blocks = (n + 255) / 256;
    silu_kernel<<<blocks, 256>>>(x, y, n);
}
