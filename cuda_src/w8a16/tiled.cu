// W8A16 on the Step 1 tile skeleton: the W tile is dequantized (d * q) while it is staged.
// 256 threads = 64 rows x 4 quarters; a quarter converts 8 of the block's 32 int8 values.
#include "common/blocks.cuh"
#include "common/tile_gemm.cuh"

extern "C" __global__ void __launch_bounds__(TILE_THREADS)
w8a16_tiled(const float* __restrict__ A, const block_q8_0* __restrict__ W, float* __restrict__ C,
            int M, int N, int K) {
    const int nb = K / QK;
    auto load_a = [&](float (*As)[TILE_M + TILE_PAD], int m0, int k0, int tid) {
        stage_f32_rows(As, A, M, K, m0, k0, tid);
    };
    auto load_w = [&](float (*Ws)[TILE_N + TILE_PAD], int n0, int k0, int tid) {
        const int r = tid / 4, quarter = tid % 4;
        const int n = n0 + r;
        const block_q8_0* blk = W + (size_t)(n < N ? n : 0) * nb + k0 / QK;
        const float d = n < N ? __half2float(blk->d) : 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int word = n < N ? load_int_b2(blk->qs, 2 * quarter + h) : 0;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                Ws[8 * quarter + 4 * h + j][r] = d * (float)(signed char)((word >> (8 * j)) & 0xFF);
        }
    };
    tile_gemm(load_a, load_w, C, M, N, K);
}
