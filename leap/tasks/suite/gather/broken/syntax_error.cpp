#include <math.h>
#include <stdint.h>

extern "C" void gather(const float* table, const int64_t* idx, float* out, int64_t v, int64_t d, int64_t m) {
    #pragma omp parallel for
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < d; j++) {
            out[i * d + j] = table[idx[i] * d + j]
        }
    }
}
