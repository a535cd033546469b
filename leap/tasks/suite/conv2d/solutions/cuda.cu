#include <math.h>
#include <stdint.h>

__global__ void conv2d_kernel(const float* x, const float* f, float* y, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh, int64_t kw) {
    int64_t oh = h - kh + 1;
    int64_t ow = w - kw + 1;
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t < o * oh * ow) {
        int64_t s = t % ow;
        int64_t r = (t / ow) % oh;
        int64_t q = t / (ow * oh);
        float sum = 0.0f;
        for (int64_t ch = 0; ch < c; ch++) {
            for (int64_t u = 0; u < kh; u++) {
                for (int64_t v = 0; v < kw; v++) {
                    sum += x[(ch * h + r + u) * w + s + v] * f[((q * c + ch) * kh + u) * kw + v];
                }
            }
        }
        y[t] = sum;
    }
}

extern "C" void conv2d(const float* x, const float* f, float* y, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh, int64_t kw) {
    int64_t total = o * (h - kh + 1) * (w - kw + 1);
    conv2d_kernel<<<(total + 255) / 256, 256>>>(x, f, y, c, h, w, o, kh, kw);
}
