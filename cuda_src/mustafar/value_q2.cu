// Mustafar value kernel, 2-bit codes, float32 scale/zero, int32 tile offsets: out += p . V (fp32 out, accumulated).
// The work is in common/mustafar.cuh (layouts: qgemm/kvcache.py, docs/mustafar.md).
#include "common/mustafar.cuh"

extern "C" __global__ void __launch_bounds__(MF_THREADS, MF_MIN_CTAS) mustafar_value_q2(MF_PARAMS) {
    MF_VALUE<2, false>(MF_ARGS);
}
