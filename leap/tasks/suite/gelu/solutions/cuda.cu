#include <math.h>
#include <stdint.h>

__global__ void gelu_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
    }
}

extern "C" void gelu(const float* x, float* y, int64_t n) {
    int64_t blocks = (n + 255) / 256;
    gelu_kernel<<<blocks, 256>>>(x, y, n);
}
