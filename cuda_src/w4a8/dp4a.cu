// Step 4, rung 2: W4A8 with DP4A: four int8 multiply-adds per instruction on the stored nibbles,
// a warp per 4x4 block of C (4 rows of A x 4 rows of W), lanes splitting K with coalesced loads
// (common/warp_dot.cuh explains).
#include "common/warp_dot.cuh"

extern "C" __global__ void __launch_bounds__(32 * WD_WARPS)
w4a8_dp4a(const block_q8_1* __restrict__ A, const block_q4_0* __restrict__ W, float* __restrict__ C,
          int M, int N, int K) {
    warp_dot_gemm<WarpDotQ4_0>(A, W, C, M, N, K);
}
