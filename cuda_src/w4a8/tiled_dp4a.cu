// Step 4, rung 3: W4A8 tiles in shared memory + 4x4 register blocking + DP4A (common/dp4a_tile.cuh).
#include "common/dp4a_tile.cuh"

extern "C" __global__ void __launch_bounds__(DT_THREADS)
w4a8_tiled_dp4a(const block_q8_1* __restrict__ A, const block_q4_0* __restrict__ W, float* __restrict__ C,
                int M, int N, int K) {
    dt_gemm<DTQ4_0>(A, W, C, M, N, K);
}
