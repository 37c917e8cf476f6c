// bfloat16 activations X[M,K] -> Q8_1 blocks: every bfloat16 is exactly a float, so the result
// equals quantize_q8_1 of the same values converted to float32 (common/quantize_q8_1.cuh).
#include "common/quantize_q8_1.cuh"

extern "C" __global__ void __launch_bounds__(Q8_1_THREADS)
quantize_q8_1_bf16(const __nv_bfloat16* __restrict__ X, block_q8_1* __restrict__ Y, int M, int K, int* __restrict__ status) {
    quantize_q8_1_rows(X, Y, M, K, status);
}
