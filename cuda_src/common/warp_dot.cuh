// The "dp4a" rungs: a warp per (4 rows of A) x (1 row of W), lanes splitting K.
//
// Thread-per-output kernels make neighbouring lanes read different rows, so every load touches
// 32 cache lines. Here the 32 lanes of a warp read *consecutive* pieces of the same rows (lane l
// takes int (l % 4) of block (l / 4) of a run of 8 blocks), so loads are coalesced, and each W
// int is reused for 4 rows of A held in registers. This is how llama.cpp's mmvq kernels read.
// The per-block compensation is linear in sumi, so each lane applies its share: with 4 lanes per
// block, each subtracts 8/4 = 2 s_a (ggml: 8*vdr/QI4_0).
#pragma once
#include "common/quant_dot.cuh"

#define WD_ROWS 4    // rows of A per warp
#define WD_WARPS 4   // warps per CTA, each on its own row of W
#define WD_LANES_PER_BLOCK 4
#define WD_BLOCKS_PER_ITER (32 / WD_LANES_PER_BLOCK)

// Q4_0 weights: lane's int i of the block = packed qs bytes 4i..4i+3
struct WarpDotQ4_0 {
    typedef block_q4_0 block_w;
    static __device__ __forceinline__ void dot(const block_q4_0* w, const block_q8_1* a, int i, float* acc_row, float d_w) {
        int lo, hi;
        q4_0_split(load_int_b2(w->qs, i), lo, hi);
        const int sumi = dp4a(hi, load_int_b4(a->qs, i + 4), dp4a(lo, load_int_b4(a->qs, i), 0));
        const float2 ds = q8_1_ds(a);
        *acc_row += d_w * (ds.x * (float)sumi - (8.0f / WD_LANES_PER_BLOCK) * ds.y);
    }
};

// Q8_0 weights: lane's share is ints 2i and 2i+1 of the 8 in a block
struct WarpDotQ8_0 {
    typedef block_q8_0 block_w;
    static __device__ __forceinline__ void dot(const block_q8_0* w, const block_q8_1* a, int i, float* acc_row, float d_w) {
        int sumi = dp4a(load_int_b2(w->qs, 2 * i), load_int_b4(a->qs, 2 * i), 0);
        sumi = dp4a(load_int_b2(w->qs, 2 * i + 1), load_int_b4(a->qs, 2 * i + 1), sumi);
        *acc_row += d_w * __half2float(a->d) * (float)sumi;
    }
};

template <typename Dot>
static __device__ __forceinline__ void warp_dot_gemm(const block_q8_1* __restrict__ A,
                                                     const typename Dot::block_w* __restrict__ W,
                                                     float* __restrict__ C, int M, int N, int K) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n = blockIdx.x * WD_WARPS + warp;
    const int m0 = blockIdx.y * WD_ROWS;
    if (n >= N) return;  // whole warp
    const int nb = K / QK;
    const typename Dot::block_w* w = W + (size_t)n * nb;
    float acc[WD_ROWS];
#pragma unroll
    for (int r = 0; r < WD_ROWS; ++r) acc[r] = 0.0f;

    const int i = lane % WD_LANES_PER_BLOCK;
    for (int b = lane / WD_LANES_PER_BLOCK; b < nb; b += WD_BLOCKS_PER_ITER) {
        const float d_w = __half2float(w[b].d);
#pragma unroll
        for (int r = 0; r < WD_ROWS; ++r) {
            const int m = m0 + r;
            if (m < M) Dot::dot(&w[b], A + (size_t)m * nb + b, i, &acc[r], d_w);
        }
    }
#pragma unroll
    for (int r = 0; r < WD_ROWS; ++r) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    }
    if (lane < WD_ROWS && m0 + lane < M) {
        float v = acc[0];
#pragma unroll
        for (int r = 1; r < WD_ROWS; ++r) v = lane == r ? acc[r] : v;
        C[(size_t)(m0 + lane) * N + n] = v;
    }
}
