#include <math.h>
#include <stdint.h>

__global__ void prefix_sum_kernel(const float* x, float* y, int64_t n) {
    __shared__ float totals[1024];
    int64_t t = threadIdx.x;
    int64_t chunk = (n + blockDim.x - 1) / blockDim.x;
    int64_t start = t * chunk < n ? t * chunk : n;
    int64_t end = start + chunk < n ? start + chunk : n;
    float sum = 0.0f;
    for (int64_t i = start; i < end; i++) {
        sum += x[i];
        y[i] = sum;
    }
    totals[t] = sum;
    __syncthreads();
    float offset = 0.0f;
    for (int64_t s = 0; s < t; s++) {
        offset += totals[s];
    }
    for (int64_t i = start; i < end; i++) {
        y[i] += offset;
    }
}

extern "C" void prefix_sum(const float* x, float* y, int64_t n) {
    prefix_sum_kernel<<<1, 1024>>>(x, y, n);
}
