#include <math.h>
#include <stdint.h>

__global__ void batched_gemm_kernel(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
    int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t i = blockIdx.y * (int64_t)blockDim.y + threadIdx.y;
    int64_t s = blockIdx.z;
    if (i < m && j < n) {
        float sum = 0.0f;
        for (int64_t p = 0; p < k; p++) {
            sum += a[(s * m + i) * k + p] * b[(s * k + p) * n + j];
        }
        c[(s * m + i) * n + j] = sum;
    }
}

extern "C" void batched_gemm(const float* a, const float* b, float* c, int64_t batch, int64_t m, int64_t n, int64_t k) {
    dim3 threads(16, 16);
    dim3 blocks((n + 15) / 16, (m + 15) / 16, batch);
    batched_gemm_kernel<<<blocks, threads>>>(a, b, c, m, n, k);
}
