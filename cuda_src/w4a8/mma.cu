// Production W4A8: Q8_1 x Q4_0 on int8 tensor cores (mma.sync m16n8k32), cp.async pipeline,
// Q4_0 unpacked in registers, block scales applied per 32-wide K step (common/mma_gemm.cuh).
// Tile sizes, warps, stages and split-K are #defines chosen per launch (qgemm/registry.py).
#include "common/mma_gemm.cuh"

extern "C" __global__ void MMA_LAUNCH_BOUNDS
w4a8_mma(const block_q8_1* __restrict__ A, const block_q4_0* __restrict__ W, float* __restrict__ C,
         int M, int N, int K) {
    mma_gemm<MmaQ4_0>(A, W, C, M, N, K);
}
