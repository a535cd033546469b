#include <math.h>
#include <stdint.h>

__global__ void bias_gelu_kernel(const float* x, const float* b, float* y, int64_t m, int64_t n) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t < m * n) {
        int64_t j = t % n;
        int64_t i = t / n;
        float v = x[i * n + j] + b[j];
        y[i * n + j] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
    }
}

extern "C" void bias_gelu(const float* x, const float* b, float* y, int64_t m, int64_t n) {
    int64_t blocks = (m * n + 255) / 256;
    bias_gelu_kernel<<<blocks, 256>>>(x, b, y, m, n);
}
