#include <math.h>
#include <stdint.h>

__global__ void dot_kernel(const float* x, const float* y, float* out, int64_t n) {
    __shared__ float partial[256];
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    partial[threadIdx.x] = i < n ? x[i] * y[i] : 0.0f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if (threadIdx.x < s) {
            partial[threadIdx.x] += partial[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicAdd(out, partial[0]);
    }
}

extern "C" void dot(const float* x, const float* y, float* out, int64_t n) {
    cudaMemset(out, 0, sizeof(float));
    int64_t blocks = (n + 255) / 256;
    dot_kernel<<<blocks, 256>>>(x, y, out, n);
}
