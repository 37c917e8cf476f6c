// Mustafar key kernel, 2-bit codes, compact metadata (fp16 dq constants, one offset per 16 tiles): scores = q . K^T (fp16 out).
// The work is in common/mustafar.cuh (layouts: qgemm/kvcache.py, docs/mustafar.md).
#include "common/mustafar.cuh"

extern "C" __global__ void __launch_bounds__(MF_THREADS, MF_MIN_CTAS) mustafar_key_q2c(MF_PARAMS) {
    MF_KEY<2, true>(MF_ARGS);
}
