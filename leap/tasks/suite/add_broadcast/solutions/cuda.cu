#include <math.h>
#include <stdint.h>

__global__ void add_broadcast_kernel(const float* x, const float* b, float* y, int64_t m, int64_t n) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t < m * n) {
        int64_t j = t % n;
        int64_t i = t / n;
        y[i * n + j] = x[i * n + j] + b[j];
    }
}

extern "C" void add_broadcast(const float* x, const float* b, float* y, int64_t m, int64_t n) {
    int64_t blocks = (m * n + 255) / 256;
    add_broadcast_kernel<<<blocks, 256>>>(x, b, y, m, n);
}
