#include <math.h>
#include <stdint.h>

extern "C" void gather(const float* table, const int64_t* idx, float* out, int64_t v, int64_t d, int64_t m) {
    for (int64_t j = 0; j < d; j++) {
        for (int64_t i = 0; i < m; i++) {
            out[i * d + j] = table[idx[i] * d + j];
        }
    }
}
