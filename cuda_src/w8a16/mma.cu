// Production W8A16: fp16 activations x Q8_0 weights on fp16 tensor cores (mma.sync m16n8k16),
// the block scale folded into the weights while they are dequantized (common/mma_f16.cuh).
#include "common/mma_f16.cuh"

extern "C" __global__ void MMA_LAUNCH_BOUNDS
w8a16_mma(const __half* __restrict__ A, const block_q8_0* __restrict__ W, float* __restrict__ C, int M, int N, int K) {
    mma_f16_gemm<HfQ8_0>(A, W, C, M, N, K);
}
