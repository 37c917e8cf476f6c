// Step 1, rung 1: shared-memory tiled FP32 GEMM (64x64 tile per CTA, 4x4 outputs per thread).
// Any M, N, K: the stagers zero-fill past the edges.
#include "common/tile_gemm.cuh"

extern "C" __global__ void __launch_bounds__(TILE_THREADS)
fp32_tiled(const float* __restrict__ A, const float* __restrict__ W, float* __restrict__ C,
           int M, int N, int K) {
    auto load_a = [&](float (*As)[TILE_M + TILE_PAD], int m0, int k0, int tid) {
        stage_f32_rows(As, A, M, K, m0, k0, tid);
    };
    auto load_w = [&](float (*Ws)[TILE_N + TILE_PAD], int n0, int k0, int tid) {
        stage_f32_rows(Ws, W, N, K, n0, k0, tid);
    };
    tile_gemm(load_a, load_w, C, M, N, K);
}
