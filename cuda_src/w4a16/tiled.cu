// Step 3, rung 1: W4A16 on the Step 1 tile skeleton. The W tile is dequantized while it is
// staged: TILE_K = 32 is one Q4_0 block, so each of the 64 W rows of the tile contributes one
// 18-byte block per K step, and 4 threads per row unpack 8 values each: thread q reads qs bytes
// 4q..4q+3 (two 16-bit loads) and writes elements 4q..4q+3 (low nibbles) and 16+4q..16+4q+3
// (high nibbles).
#include "common/blocks.cuh"
#include "common/tile_gemm.cuh"

extern "C" __global__ void __launch_bounds__(TILE_THREADS)
w4a16_tiled(const float* __restrict__ A, const block_q4_0* __restrict__ W, float* __restrict__ C,
            int M, int N, int K) {
    const int nb = K / QK;
    auto load_a = [&](float (*As)[TILE_M + TILE_PAD], int m0, int k0, int tid) {
        stage_f32_rows(As, A, M, K, m0, k0, tid);
    };
    auto load_w = [&](float (*Ws)[TILE_N + TILE_PAD], int n0, int k0, int tid) {
        // 256 threads = 64 rows x 4 quarters; quarter q unpacks qs[4q .. 4q+3]
        const int r = tid / 4, quarter = tid % 4;
        const int n = n0 + r;
        if (n < N) {
            const block_q4_0* blk = W + (size_t)n * nb + k0 / QK;
            const float d = __half2float(blk->d);
            const int packed = load_int_b2(blk->qs, quarter);  // 4 bytes = 8 nibbles
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int q = (packed >> (8 * j)) & 0xFF;
                Ws[4 * quarter + j][r] = d * (float)((q & 0x0F) - 8);
                Ws[4 * quarter + j + QK / 2][r] = d * (float)((q >> 4) - 8);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                Ws[4 * quarter + j][r] = 0.0f;
                Ws[4 * quarter + j + QK / 2][r] = 0.0f;
            }
        }
    };
    tile_gemm(load_a, load_w, C, M, N, K);
}
