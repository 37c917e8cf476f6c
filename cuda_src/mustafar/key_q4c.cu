// Mustafar key kernel, 4-bit codes, compact metadata (fp16 dq constants, one offset per 16 tiles): scores = q . K^T (fp16 out).
// The work is in common/mustafar.cuh (layouts: qgemm/kvcache.py, docs/mustafar.md).
#include "common/mustafar.cuh"

extern "C" __global__ void __launch_bounds__(MF_THREADS, MF_MIN_CTAS) mustafar_key_q4c(MF_PARAMS) {
    MF_KEY<4, true>(MF_ARGS);
}
