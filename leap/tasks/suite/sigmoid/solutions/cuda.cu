#include <math.h>
#include <stdint.h>

__global__ void sigmoid_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = 1.0f / (1.0f + expf(-x[i]));
    }
}

extern "C" void sigmoid(const float* x, float* y, int64_t n) {
    int64_t blocks = (n + 255) / 256;
    sigmoid_kernel<<<blocks, 256>>>(x, y, n);
}
