#include <math.h>
#include <stdint.h>

__global__ void matmul_relu_kernel(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
    int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t i = blockIdx.y * (int64_t)blockDim.y + threadIdx.y;
    if (i < m && j < n) {
        float sum = 0.0f;
        for (int64_t p = 0; p < k; p++) {
            sum += a[i * k + p] * b[p * n + j];
        }
        c[i * n + j] = sum > 0.0f ? sum : 0.0f;
    }
}

extern "C" void matmul_relu(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
    dim3 threads(16, 16);
    dim3 blocks((n + 15) / 16, (m + 15) / 16);
    matmul_relu_kernel<<<blocks, threads>>>(a, b, c, m, n, k);
}
