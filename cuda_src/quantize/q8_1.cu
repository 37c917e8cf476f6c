// float32 activations X[M,K] -> Q8_1 blocks Y[M, K/32], as ggml-cuda/quantize.cu's quantize_q8_1
// (common/quantize_q8_1.cuh has the kernel body and the why).
#include "common/quantize_q8_1.cuh"

extern "C" __global__ void __launch_bounds__(Q8_1_THREADS)
quantize_q8_1(const float* __restrict__ X, block_q8_1* __restrict__ Y, int M, int K, int* __restrict__ status) {
    quantize_q8_1_rows(X, Y, M, K, status);
}
