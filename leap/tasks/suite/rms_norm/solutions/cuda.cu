#include <math.h>
#include <stdint.h>

__global__ void rms_norm_kernel(const float* x, const float* w, float* y, int64_t m, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < m) {
        float sq = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            sq += x[i * n + j] * x[i * n + j];
        }
        float scale = 1.0f / sqrtf(sq / n + 1e-6f);
        for (int64_t j = 0; j < n; j++) {
            y[i * n + j] = x[i * n + j] * scale * w[j];
        }
    }
}

extern "C" void rms_norm(const float* x, const float* w, float* y, int64_t m, int64_t n) {
    int64_t blocks = (m + 255) / 256;
    rms_norm_kernel<<<blocks, 256>>>(x, w, y, m, n);
}
