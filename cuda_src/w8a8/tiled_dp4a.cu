// W8A8 rung 2: tiles in shared memory + 4x4 register blocking + DP4A (common/dp4a_tile.cuh).
#include "common/dp4a_tile.cuh"

extern "C" __global__ void __launch_bounds__(DT_THREADS)
w8a8_tiled_dp4a(const block_q8_1* __restrict__ A, const block_q8_0* __restrict__ W, float* __restrict__ C,
                int M, int N, int K) {
    dt_gemm<DTQ8_0>(A, W, C, M, N, K);
}
