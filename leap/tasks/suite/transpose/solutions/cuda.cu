#include <math.h>
#include <stdint.h>

__global__ void transpose_kernel(const float* x, float* y, int64_t m, int64_t n) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t < m * n) {
        int64_t i = t % m;
        int64_t j = t / m;
        y[j * m + i] = x[i * n + j];
    }
}

extern "C" void transpose(const float* x, float* y, int64_t m, int64_t n) {
    int64_t blocks = (m * n + 255) / 256;
    transpose_kernel<<<blocks, 256>>>(x, y, m, n);
}
