// Mustafar key kernel, fp16 non-zeros (counts + values): scores = q . K^T (fp16 out).
// The work is in common/mustafar.cuh (layouts: qgemm/kvcache.py, docs/mustafar.md).
#include "common/mustafar.cuh"

extern "C" __global__ void __launch_bounds__(MF_THREADS, MF_MIN_CTAS) mustafar_key_fp16(MF_PARAMS) {
    MF_KEY<16, false>(MF_ARGS);
}
