// Decode GEMV (M <= 8): Q8_1 activations x Q4_0 / Q8_0 weights, every weight byte read once.
//
// A warp owns GEMV_COLS rows of W and all M (<= GEMV_M) activation rows; its 32 lanes split K
// as in common/warp_dot.cuh (8 blocks x 4 int-pairs per iteration, coalesced), so each weight
// row is streamed once, by one warp.
//
// The activations are tiny (M x K x 1.125 bytes) but every warp needs all of them: read from
// global memory, each block costs every lane 3 loads per activation row, and at M = 8 the kernel
// was bound by L1 load wavefronts (an early version: M = 8 took 4.5x the time of M = 1 for the
// same weight bytes). So the CTA first stages a chunk of GEMV_CHUNK blocks of all M rows in
// shared memory (16-byte loads when rows are aligned), and the warps read activations from
// there. Rows past M are skipped; GEMV_M is a compile-time bound so accumulators stay in
// registers.
#pragma once
#include "common/warp_dot.cuh"
#include "common/pdl.cuh"

#ifndef GEMV_M
#define GEMV_M 8
#endif
#ifndef GEMV_COLS
#define GEMV_COLS 2
#endif
#ifndef GEMV_WARPS
#define GEMV_WARPS 16
#endif
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 4  // iterations of weight loads in flight per lane
#endif
#ifndef GEMV_CHUNK
#define GEMV_CHUNK 128  // Q8_1 blocks of each activation row staged at a time
#endif
#define GEMV_ROW_BYTES (GEMV_CHUNK * 36)
// GEMV_EARLY: a chunk's first weight loads are issued before its activations are staged (they
// hold GEMV_UNROLL x GEMV_COLS x 3 registers across the staging).
// GEMV_PDL: launched with programmatic dependent launch behind its quantizer (quantize.q8_1,
// which releases it at entry): the CTAs start while the quantizer runs, request their first
// weights and wait (griddepcontrol.wait) only before staging the quantizer's output or writing C.
// This kernel never releases the next one early: a next GEMV resident beside this one measured
// much slower (session 29). Both on up to 4 tokens (qgemm.registry._gemv_early).
#ifndef GEMV_EARLY
#define GEMV_EARLY 0
#endif
#ifndef GEMV_PDL
#define GEMV_PDL 0
#endif

// Stage blocks [c0, c0 + cnt) of activation rows [0, M) into sh[r][...] (raw Q8_1 bytes).
static __device__ __forceinline__ void gemv_stage(unsigned char* sh, const block_q8_1* __restrict__ A, int M, int nb,
                                                  int c0, int cnt) {
    const int bytes = cnt * 36;
    const bool vec = (nb % 4) == 0 && (c0 % 4) == 0 && (((size_t)A) & 15) == 0;  // 36 * 4 = 144 = 9 x 16
    for (int r = 0; r < GEMV_M && r < M; ++r) {
        const unsigned char* src = (const unsigned char*)(A + (size_t)r * nb + c0);
        unsigned char* dst = sh + r * GEMV_ROW_BYTES;
        if (vec) {
            for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x)
                ((int4*)dst)[i] = ((const int4*)src)[i];
            // cnt * 36 bytes not a whole number of 16-byte pieces: only with a -D GEMV_CHUNK that
            // is not a multiple of 4 (under `vec`, nb % 4 == 0), and then in every chunk
            if (threadIdx.x < (bytes % 16) / 4)
                ((int*)dst)[bytes / 4 - (bytes % 16) / 4 + threadIdx.x] = ((const int*)src)[bytes / 4 - (bytes % 16) / 4 + threadIdx.x];
        } else {
            for (int i = threadIdx.x; i < bytes / 4; i += blockDim.x) ((int*)dst)[i] = ((const int*)src)[i];
        }
    }
}

template <typename Fmt>
static __device__ __forceinline__ void gemv(const block_q8_1* __restrict__ A, const typename Fmt::block_w* __restrict__ W,
                                            float* __restrict__ C, int M, int N, int K) {
    __shared__ __align__(16) unsigned char sh[GEMV_M * GEMV_ROW_BYTES];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_COLS;
    const bool active = n0 < N;  // idle warps still help stage and reach the barriers
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

    // GEMV_UNROLL iterations' weight loads are issued before any of them is used: one iteration
    // alone keeps too few bytes in flight per SM to cover DRAM/L2 latency. A chunk's first batch
    // is requested before its staging (the weights do not depend on it), so the staging's round
    // trip overlaps them (GEMV_EARLY).
    int w0[GEMV_UNROLL][GEMV_COLS], w1[GEMV_UNROLL][GEMV_COLS];
    float dw[GEMV_UNROLL][GEMV_COLS];
    auto load = [&](int c0, int bl0, int cnt) {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int b = c0 + min(bl0 + u * WD_BLOCKS_PER_ITER, cnt - 1);  // clamped: loads stay in bounds
#pragma unroll
            for (int c = 0; c < GEMV_COLS; ++c) {
                Fmt::load(w_rows[c] + b, i, w0[u][c], w1[u][c]);
                dw[u][c] = __half2float(w_rows[c][b].d);
            }
        }
    };
    for (int c0 = 0; c0 < nb; c0 += GEMV_CHUNK) {
        const int cnt = min(GEMV_CHUNK, nb - c0);
        const int first = lane / WD_LANES_PER_BLOCK;
        if (GEMV_EARLY && active && first < cnt) load(c0, first, cnt);
#if GEMV_PDL
        if (c0 == 0) pdl_wait();  // the quantizer's output (A) is read, and C written, only below
#endif
        __syncthreads();  // the previous chunk is no longer read
        gemv_stage(sh, A, M, nb, c0, cnt);
        __syncthreads();
        if (!active) continue;
        for (int bl0 = first; bl0 < cnt; bl0 += WD_BLOCKS_PER_ITER * GEMV_UNROLL) {
            if (!GEMV_EARLY || bl0 != first) load(c0, bl0, cnt);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int bl = bl0 + u * WD_BLOCKS_PER_ITER;
                if (bl >= cnt) break;
#pragma unroll
                for (int r = 0; r < GEMV_M; ++r) {
                    if (r >= M) break;
                    const unsigned char* blk = sh + r * GEMV_ROW_BYTES + bl * 36;
                    const int a0 = *(const int*)(blk + 4 + 4 * Fmt::a_int(i, 0));
                    const int a1 = *(const int*)(blk + 4 + 4 * Fmt::a_int(i, 1));
                    const float2 ds = __half22float2(*(const __half2*)blk);
#pragma unroll
                    for (int c = 0; c < GEMV_COLS; ++c) {
                        const int sumi = dp4a(w1[u][c], a1, dp4a(w0[u][c], a0, 0));
                        acc[r][c] += Fmt::offset8 ? dw[u][c] * (ds.x * (float)sumi - (8.0f / WD_LANES_PER_BLOCK) * ds.y)
                                                  : dw[u][c] * ds.x * (float)sumi;
                    }
                }
            }
        }
    }
    if (!active) return;
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
