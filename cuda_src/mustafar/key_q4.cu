// Mustafar key kernel, 4-bit codes, float32 scale/zero, int32 tile offsets: scores = q . K^T (fp16 out).
// The work is in common/mustafar.cuh (layouts: qgemm/kvcache.py, docs/mustafar.md).
#include "common/mustafar.cuh"

extern "C" __global__ void __launch_bounds__(MF_THREADS, MF_MIN_CTAS) mustafar_key_q4(MF_PARAMS) {
    MF_KEY<4, false>(MF_ARGS);
}
