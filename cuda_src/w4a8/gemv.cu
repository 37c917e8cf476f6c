// Decode W4A8 GEMV for M <= 8: Q8_1 x Q4_0, each weight row streamed once by one warp
// (common/gemv.cuh).
#include "common/gemv.cuh"

extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
w4a8_gemv(const block_q8_1* __restrict__ A, const block_q4_0* __restrict__ W, float* __restrict__ C,
          int M, int N, int K) {
    gemv<WarpDotQ4_0>(A, W, C, M, N, K);
}
