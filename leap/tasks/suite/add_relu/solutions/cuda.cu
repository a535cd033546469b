#include <math.h>
#include <stdint.h>

__global__ void add_relu_kernel(const float* a, const float* b, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = a[i] + b[i];
        y[i] = v > 0.0f ? v : 0.0f;
    }
}

extern "C" void add_relu(const float* a, const float* b, float* y, int64_t n) {
    int64_t blocks = (n + 255) / 256;
    add_relu_kernel<<<blocks, 256>>>(a, b, y, n);
}
