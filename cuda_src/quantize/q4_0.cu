// Weights X[M,K] (float32, float16 or bfloat16) -> ggml Q4_0 blocks Y[M, K/32], byte for byte
// ggml's quantize_row_q4_0_ref of the values as float32: a model's float checkpoint quantized at
// load in milliseconds instead of numpy's seconds (common/quantize_weights.cuh has the why).
#include "common/quantize_weights.cuh"

extern "C" __global__ void __launch_bounds__(QW_THREADS)
quantize_q4_0(const float* __restrict__ X, block_q4_0* __restrict__ Y, int M, int K, int* __restrict__ status) {
    quantize_weight_blocks<qw_q4_0>(X, Y, M, K, status);
}

extern "C" __global__ void __launch_bounds__(QW_THREADS)
quantize_q4_0_f16(const __half* __restrict__ X, block_q4_0* __restrict__ Y, int M, int K, int* __restrict__ status) {
    quantize_weight_blocks<qw_q4_0>(X, Y, M, K, status);
}

extern "C" __global__ void __launch_bounds__(QW_THREADS)
quantize_q4_0_bf16(const __nv_bfloat16* __restrict__ X, block_q4_0* __restrict__ Y, int M, int K, int* __restrict__ status) {
    quantize_weight_blocks<qw_q4_0>(X, Y, M, K, status);
}
