#include <math.h>
#include <stdint.h>

__global__ void gather_kernel(const float* table, const int64_t* idx, float* out, int64_t v, int64_t d, int64_t m) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t < m * d) {
        int64_t i = t / d;
        int64_t j = t % d;
        out[i * d + j] = table[idx[i] * d + j];
    }
}

extern "C" void gather(const float* table, const int64_t* idx, float* out, int64_t v, int64_t d, int64_t m) {
    int64_t blocks = (m * d + 255) / 256;
    gather_kernel<<<blocks, 256>>>(table, idx, out, v, d, m);
}
