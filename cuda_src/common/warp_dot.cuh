// The "dp4a" rungs: DP4A without shared memory. A warp computes a 4x4 block of C (4 rows of A x
// 4 rows of W) and its 32 lanes split K: lane l takes int-pair (l % 4) of block (l / 4) of each
// run of 8 blocks, so a warp's loads walk *consecutive* bytes of the same rows (coalesced), the
// way llama.cpp's mmvq kernels read.
//
// Why 4x4 per warp: DP4A is cheap, loads are not. With one output per warp every dp4a needs its
// own A and W loads and the kernel is bound by L1 load wavefronts; with 4x4, each loaded A
// fragment is reused for 4 W rows and vice versa (24 loads per 32 dp4a, against 3 per dp4a with
// one output: a0, a1, d/s and the two 16-bit halves of the W int plus its d for 2 dp4a).
// The -8 compensation is linear in sumi, so each of the 4 lanes of a block applies its share,
// 8/4 = 2 s_a (ggml: 8*vdr/QI4_0).
#pragma once
#include "common/quant_dot.cuh"

#define WD_ROWS 4    // rows of A per warp
#define WD_COLS 4    // rows of W per warp
#define WD_WARPS 4   // warps per CTA, side by side along N
#define WD_LANES_PER_BLOCK 4
#define WD_BLOCKS_PER_ITER (32 / WD_LANES_PER_BLOCK)

// Q4_0: a lane's part of a block is packed int i (qs bytes 4i..4i+3) -> low nibbles pair with A's
// int i, high nibbles with A's int i + 4.
struct WarpDotQ4_0 {
    typedef block_q4_0 block_w;
    static constexpr bool offset8 = true;
    static __device__ __forceinline__ int a_int(int i, int h) { return i + 4 * h; }
    static __device__ __forceinline__ void load(const block_q4_0* w, int i, int& x0, int& x1) {
        q4_0_split(load_int_b2(w->qs, i), x0, x1);
    }
};

// Q8_0: a lane's part of a block is ints 2i and 2i + 1, pairing with A's ints 2i and 2i + 1.
struct WarpDotQ8_0 {
    typedef block_q8_0 block_w;
    static constexpr bool offset8 = false;
    static __device__ __forceinline__ int a_int(int i, int h) { return 2 * i + h; }
    static __device__ __forceinline__ void load(const block_q8_0* w, int i, int& x0, int& x1) {
        x0 = load_int_b2(w->qs, 2 * i);
        x1 = load_int_b2(w->qs, 2 * i + 1);
    }
};

template <typename Fmt>
static __device__ __forceinline__ void warp_dot_gemm(const block_q8_1* __restrict__ A,
                                                     const typename Fmt::block_w* __restrict__ W,
                                                     float* __restrict__ C, int M, int N, int K) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = (blockIdx.x * WD_WARPS + warp) * WD_COLS;
    const int m0 = blockIdx.y * WD_ROWS;
    if (n0 >= N) return;  // whole warp
    const int nb = K / QK;
    // rows past the edge are clamped to the last one (loads stay in bounds) and never stored
    const block_q8_1* a_rows[WD_ROWS];
    const typename Fmt::block_w* w_rows[WD_COLS];
#pragma unroll
    for (int r = 0; r < WD_ROWS; ++r) a_rows[r] = A + (size_t)min(m0 + r, M - 1) * nb;
#pragma unroll
    for (int c = 0; c < WD_COLS; ++c) w_rows[c] = W + (size_t)min(n0 + c, N - 1) * nb;

    float acc[WD_ROWS][WD_COLS];
#pragma unroll
    for (int r = 0; r < WD_ROWS; ++r)
#pragma unroll
        for (int c = 0; c < WD_COLS; ++c) acc[r][c] = 0.0f;

    const int i = lane % WD_LANES_PER_BLOCK;
    for (int b = lane / WD_LANES_PER_BLOCK; b < nb; b += WD_BLOCKS_PER_ITER) {
        int a0[WD_ROWS], a1[WD_ROWS], w0[WD_COLS], w1[WD_COLS];
        float2 ds[WD_ROWS];
        float dw[WD_COLS];
#pragma unroll
        for (int r = 0; r < WD_ROWS; ++r) {
            const block_q8_1* blk = a_rows[r] + b;
            a0[r] = load_int_b4(blk->qs, Fmt::a_int(i, 0));
            a1[r] = load_int_b4(blk->qs, Fmt::a_int(i, 1));
            ds[r] = __half22float2(*(const __half2*)&blk->d);  // d and s in one 4-byte load
        }
#pragma unroll
        for (int c = 0; c < WD_COLS; ++c) {
            Fmt::load(w_rows[c] + b, i, w0[c], w1[c]);
            dw[c] = __half2float(w_rows[c][b].d);
        }
#pragma unroll
        for (int r = 0; r < WD_ROWS; ++r)
#pragma unroll
            for (int c = 0; c < WD_COLS; ++c) {
                const int sumi = dp4a(w1[c], a1[r], dp4a(w0[c], a0[r], 0));
                acc[r][c] += Fmt::offset8 ? dw[c] * (ds[r].x * (float)sumi - (8.0f / WD_LANES_PER_BLOCK) * ds[r].y)
                                          : dw[c] * ds[r].x * (float)sumi;
            }
    }
#pragma unroll
    for (int r = 0; r < WD_ROWS; ++r)
#pragma unroll
        for (int c = 0; c < WD_COLS; ++c)
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], off);

    // every lane holds all 16 sums; lane r*4+c stores (m0+r, n0+c)
    if (lane < WD_ROWS * WD_COLS) {
        const int r = lane / WD_COLS, c = lane % WD_COLS;
        float v = 0.0f;
#pragma unroll
        for (int rr = 0; rr < WD_ROWS; ++rr)
#pragma unroll
            for (int cc = 0; cc < WD_COLS; ++cc) v = (rr == r && cc == c) ? acc[rr][cc] : v;
        if (m0 + r < M && n0 + c < N) C[(size_t)(m0 + r) * N + n0 + c] = v;
    }
}
