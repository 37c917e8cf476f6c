// Register-blocked shared-memory tiles + DP4A: the "tiled_dp4a" rungs (and vec_dp4a's compute).
//
// A CTA of 16x16 threads owns a 64x64 tile of C; each thread keeps a 4x4 block of float
// accumulators. Per stage, DT_BLOCKS quant blocks along K are staged k-major as int words:
//     As[word][m]  Q8_1 activations: word i of a block = elements 4i..4i+3
//     Ws[word][n]  weights re-ordered so that word i pairs with A's word i (Q4_0: the low nibbles
//                  of qs[4i..4i+3] go to word i (i < 4), the high nibbles to word i+4)
// plus the per-block scales. The inner loop reads one int4 of A and one int4 of W per word
// (16-byte shared loads; rows padded against the stagers' bank conflicts: DT_PAD) and issues 16 DP4A; a
// block's integer sums are then folded into the float accumulators with its scales:
//     W4A8: acc += d_w (d_a sumi - 8 s_a)        W8A8: acc += d_w d_a sumi
#pragma once
#include "common/quant_dot.cuh"

#define DT_TILE 64
#define DT_THREADS 256
#ifndef DT_BLOCKS
#define DT_BLOCKS 2                  // quant blocks per stage (a kernel may define more)
#endif
#define DT_WORDS (DT_BLOCKS * 8)     // int words per row per stage
// Row pad. The stagers write column-wise (a warp: 8 rows r x 4 parts, one word each): with 64-word
// rows the 4 parts of a row hit one bank (4-way conflicts), with 68 they spread over 16 banks
// (2-way at DT_BLOCKS = 2). 4 words, not 1, so each row stays 16-byte aligned for dt_compute's
// int4 loads.
#define DT_PAD 4

struct DTShared {
    int a[DT_WORDS][DT_TILE + DT_PAD];
    int w[DT_WORDS][DT_TILE + DT_PAD];
    float a_d[DT_BLOCKS][DT_TILE];
    float a_s[DT_BLOCKS][DT_TILE];
    float w_d[DT_BLOCKS][DT_TILE];
};

// Stage Q8_1 rows [r0, r0+64) x blocks [b0, b0+DT_BLOCKS): 4 threads per row, DT_WORDS/4 words each.
static __device__ __forceinline__ void dt_stage_q8_1(DTShared& sh, const block_q8_1* __restrict__ A,
                                                     int M, int nb, int r0, int b0, int tid) {
    const int r = tid / 4, part = tid % 4;
    const int m = r0 + r;
#pragma unroll
    for (int j = 0; j < DT_WORDS / 4; ++j) {
        const int word = part * (DT_WORDS / 4) + j, b = word / 8;
        const bool ok = m < M && b0 + b < nb;
        sh.a[word][r] = ok ? load_int_b4(A[(size_t)m * nb + b0 + b].qs, word % 8) : 0;
    }
    for (int b = part; b < DT_BLOCKS; b += 4) {
        const bool ok = m < M && b0 + b < nb;
        const block_q8_1* blk = &A[(size_t)(ok ? m : 0) * nb + (ok ? b0 + b : 0)];
        sh.a_d[b][r] = ok ? __half2float(blk->d) : 0.0f;
        sh.a_s[b][r] = ok ? __half2float(blk->s) : 0.0f;
    }
}

struct DTQ4_0 {
    typedef block_q4_0 block_w;
    static constexpr bool offset8 = true;
    // 4 threads per row; DT_BLOCKS * 4 packed ints per row -> DT_BLOCKS packed ints per thread
    static __device__ __forceinline__ void stage(DTShared& sh, const block_q4_0* __restrict__ W, int N, int nb,
                                                 int r0, int b0, int tid) {
        const int r = tid / 4, part = tid % 4;
        const int n = r0 + r;
#pragma unroll
        for (int j = 0; j < DT_BLOCKS * 4 / 4; ++j) {
            const int p = part * (DT_BLOCKS * 4 / 4) + j;  // packed int index in the row's stage
            const int b = p / 4, i = p % 4;
            const bool ok = n < N && b0 + b < nb;
            int lo = 0, hi = 0;
            if (ok) q4_0_split(load_int_b2(W[(size_t)n * nb + b0 + b].qs, i), lo, hi);
            sh.w[b * 8 + i][r] = lo;
            sh.w[b * 8 + i + 4][r] = hi;
        }
        for (int b = part; b < DT_BLOCKS; b += 4) {
            const bool ok = n < N && b0 + b < nb;
            sh.w_d[b][r] = ok ? __half2float(W[(size_t)n * nb + b0 + b].d) : 0.0f;
        }
    }
};

struct DTQ8_0 {
    typedef block_q8_0 block_w;
    static constexpr bool offset8 = false;
    static __device__ __forceinline__ void stage(DTShared& sh, const block_q8_0* __restrict__ W, int N, int nb,
                                                 int r0, int b0, int tid) {
        const int r = tid / 4, part = tid % 4;
        const int n = r0 + r;
#pragma unroll
        for (int j = 0; j < DT_WORDS / 4; ++j) {
            const int word = part * (DT_WORDS / 4) + j, b = word / 8;
            const bool ok = n < N && b0 + b < nb;
            sh.w[word][r] = ok ? load_int_b2(W[(size_t)n * nb + b0 + b].qs, word % 8) : 0;
        }
        for (int b = part; b < DT_BLOCKS; b += 4) {
            const bool ok = n < N && b0 + b < nb;
            sh.w_d[b][r] = ok ? __half2float(W[(size_t)n * nb + b0 + b].d) : 0.0f;
        }
    }
};

// The compute half of a stage: 16 DP4A per word per thread, then the block scales.
template <bool OFFSET8>
static __device__ __forceinline__ void dt_compute(const DTShared& sh, float (&acc)[4][4]) {
    const int ty = threadIdx.y, tx = threadIdx.x;
#pragma unroll
    for (int b = 0; b < DT_BLOCKS; ++b) {
        int sumi[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) sumi[i][j] = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int4 a = *(const int4*)&sh.a[b * 8 + k][ty * 4];
            const int4 w = *(const int4*)&sh.w[b * 8 + k][tx * 4];
            const int av[4] = {a.x, a.y, a.z, a.w};
            const int wv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) sumi[i][j] = dp4a(av[i], wv[j], sumi[i][j]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float d_a = sh.a_d[b][ty * 4 + i], s_a = sh.a_s[b][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float d_w = sh.w_d[b][tx * 4 + j];
                acc[i][j] += OFFSET8 ? w4a8_block(d_w, d_a, s_a, sumi[i][j]) : d_w * d_a * (float)sumi[i][j];
            }
        }
    }
}

static __device__ __forceinline__ void dt_store(const float (&acc)[4][4], float* __restrict__ C, int M, int N) {
    const int m0 = blockIdx.y * DT_TILE + threadIdx.y * 4, n0 = blockIdx.x * DT_TILE + threadIdx.x * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (m0 + i >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (n0 + j < N) C[(size_t)(m0 + i) * N + n0 + j] = acc[i][j];
    }
}

struct DTStageA {
    static __device__ __forceinline__ void stage(DTShared& sh, const block_q8_1* __restrict__ A, int M, int nb,
                                                 int r0, int b0, int tid) {
        dt_stage_q8_1(sh, A, M, nb, r0, b0, tid);
    }
};

template <typename WFmt, typename AStage = DTStageA>
static __device__ __forceinline__ void dt_gemm(const block_q8_1* __restrict__ A, const typename WFmt::block_w* __restrict__ W,
                                               float* __restrict__ C, int M, int N, int K) {
    __shared__ __align__(16) DTShared sh;
    const int tid = threadIdx.y * 16 + threadIdx.x;
    const int nb = K / QK;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int b0 = 0; b0 < nb; b0 += DT_BLOCKS) {
        AStage::stage(sh, A, M, nb, blockIdx.y * DT_TILE, b0, tid);
        WFmt::stage(sh, W, N, nb, blockIdx.x * DT_TILE, b0, tid);
        __syncthreads();
        dt_compute<WFmt::offset8>(sh, acc);
        __syncthreads();
    }
    dt_store(acc, C, M, N);
}
