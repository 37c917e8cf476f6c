// Decode GEMV (M <= 8): Q8_1 activations x Q4_0 / Q8_0 weights, every weight byte read once.
//
// A warp owns GEMV_COLS rows of W and all M (<= GEMV_M) activation rows; its 32 lanes split K
// exactly as in common/warp_dot.cuh (lane = 8 blocks x 4 int-pairs per iteration, coalesced), so
// each weight row is streamed once by one warp while the few activation rows (M x K x 1.125
// bytes, a few KB) stay in L1/L2. GEMV_M is a compile-time bound so the accumulators live in
// registers; rows past M are skipped.
#pragma once
#include "common/warp_dot.cuh"

#ifndef GEMV_M
#define GEMV_M 8
#endif
#ifndef GEMV_COLS
#define GEMV_COLS 2
#endif
#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif

template <typename Fmt>
static __device__ __forceinline__ void gemv(const block_q8_1* __restrict__ A, const typename Fmt::block_w* __restrict__ W,
                                            float* __restrict__ C, int M, int N, int K) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_COLS;
    if (n0 >= N) return;
    const int nb = K / QK;
    const int i = lane % WD_LANES_PER_BLOCK;
    const typename Fmt::block_w* w_rows[GEMV_COLS];
#pragma unroll
    for (int c = 0; c < GEMV_COLS; ++c) w_rows[c] = W + (size_t)min(n0 + c, N - 1) * nb;

    float acc[GEMV_M][GEMV_COLS];
#pragma unroll
    for (int r = 0; r < GEMV_M; ++r)
#pragma unroll
        for (int c = 0; c < GEMV_COLS; ++c) acc[r][c] = 0.0f;

    for (int b = lane / WD_LANES_PER_BLOCK; b < nb; b += WD_BLOCKS_PER_ITER) {
        int w0[GEMV_COLS], w1[GEMV_COLS];
        float dw[GEMV_COLS];
#pragma unroll
        for (int c = 0; c < GEMV_COLS; ++c) {
            Fmt::load(w_rows[c] + b, i, w0[c], w1[c]);
            dw[c] = __half2float(w_rows[c][b].d);
        }
#pragma unroll
        for (int r = 0; r < GEMV_M; ++r) {
            if (r >= M) break;
            const block_q8_1* blk = A + (size_t)r * nb + b;
            const int a0 = load_int_b4(blk->qs, Fmt::a_int(i, 0));
            const int a1 = load_int_b4(blk->qs, Fmt::a_int(i, 1));
            const float2 ds = __half22float2(*(const __half2*)&blk->d);
#pragma unroll
            for (int c = 0; c < GEMV_COLS; ++c) {
                const int sumi = dp4a(w1[c], a1, dp4a(w0[c], a0, 0));
                acc[r][c] += Fmt::offset8 ? dw[c] * (ds.x * (float)sumi - (8.0f / WD_LANES_PER_BLOCK) * ds.y)
                                          : dw[c] * ds.x * (float)sumi;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_M; ++r) {
        if (r >= M) break;
#pragma unroll
        for (int c = 0; c < GEMV_COLS; ++c) {
            float v = acc[r][c];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0 && n0 + c < N) C[(size_t)r * N + n0 + c] = v;
        }
    }
}
