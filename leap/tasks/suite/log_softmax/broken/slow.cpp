#include <math.h>
#include <stdint.h>

extern "C" void log_softmax(const float* x, float* y, int64_t m, int64_t n) {
    for (int64_t i = 0; i < m; i++) {
        float best = x[i * n];
        for (int64_t j = 1; j < n; j++) {
            best = fmaxf(best, x[i * n + j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            sum += expf(x[i * n + j] - best);
        }
        for (int64_t j = 0; j < n; j++) {
            y[i * n + j] = x[i * n + j] - best - logf(sum);
        }
    }
}
