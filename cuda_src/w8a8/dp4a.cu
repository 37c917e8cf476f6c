// W8A8 rung 1: DP4A, a warp per 4x4 block of C, lanes splitting K with coalesced loads
// (common/warp_dot.cuh).
#include "common/warp_dot.cuh"

extern "C" __global__ void __launch_bounds__(32 * WD_WARPS)
w8a8_dp4a(const block_q8_1* __restrict__ A, const block_q8_0* __restrict__ W, float* __restrict__ C,
          int M, int N, int K) {
    warp_dot_gemm<WarpDotQ8_0>(A, W, C, M, N, K);
}
