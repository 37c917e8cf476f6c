// Mustafar value kernel, fp16 non-zeros (counts + values): out += p . V (fp32 out, accumulated).
// The work is in common/mustafar.cuh (layouts: qgemm/kvcache.py, docs/mustafar.md).
#include "common/mustafar.cuh"

extern "C" __global__ void __launch_bounds__(MF_THREADS, MF_MIN_CTAS) mustafar_value_fp16(MF_PARAMS) {
    MF_VALUE<16, false>(MF_ARGS);
}
