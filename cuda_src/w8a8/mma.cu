// Production W8A8: Q8_1 x Q8_0 on int8 tensor cores (mma.sync m16n8k32), cp.async pipeline,
// block scales applied per 32-wide K step (common/mma_gemm.cuh).
#include "common/mma_gemm.cuh"

extern "C" __global__ void MMA_LAUNCH_BOUNDS
w8a8_mma(const block_q8_1* __restrict__ A, const block_q8_0* __restrict__ W, float* __restrict__ C,
         int M, int N, int K) {
    mma_gemm<MmaQ8_0>(A, W, C, M, N, K);
}
