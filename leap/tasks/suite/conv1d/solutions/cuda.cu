#include <math.h>
#include <stdint.h>

__global__ void conv1d_kernel(const float* x, const float* w, float* y, int64_t n, int64_t kw) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n - kw + 1) {
        float sum = 0.0f;
        for (int64_t t = 0; t < kw; t++) {
            sum += x[i + t] * w[t];
        }
        y[i] = sum;
    }
}

extern "C" void conv1d(const float* x, const float* w, float* y, int64_t n, int64_t kw) {
    int64_t blocks = (n - kw + 1 + 255) / 256;
    conv1d_kernel<<<blocks, 256>>>(x, w, y, n, kw);
}
