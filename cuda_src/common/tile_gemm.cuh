// Shared-memory tiled GEMM skeleton used by the Step 1 and Step 3 "tiled" rungs.
//
// A CTA of 16x16 threads owns a TILE_M x TILE_N = 64x64 tile of C; each thread accumulates a
// 4x4 micro-tile in registers. Per K step the CTA stages A[64][TILE_K] and W[64][TILE_K] in
// shared memory *transposed* (k-major), so the inner product loop reads 4 consecutive floats of
// each operand per k and every A/W element loaded from global memory is reused 64 times.
//
// The operand loader is a template parameter: fp32.tiled copies floats, w4a16.tiled dequantizes
// a Q4_0 block while it stages the W tile. TILE_K = 32 = one quant block, so a W row contributes
// exactly one block per K step.
#pragma once

#define TILE_M 64
#define TILE_N 64
#define TILE_K 32
#define TILE_THREADS 256
// Row padding. The inner loop reads float4 along m/n, so a row stride must stay a multiple of 4
// floats (16-byte aligned). The transposed stores (a warp writes 32 consecutive k of one row)
// then land on banks (k * 68) % 32: 8 distinct banks, a 4-way conflict. That is one store per
// 64 FMAs, so it is accepted; without the padding (stride 64) it would be a 32-way conflict.
#define TILE_PAD 4

template <typename LoadA, typename LoadW>
static __device__ __forceinline__ void tile_gemm(LoadA load_a, LoadW load_w, float* __restrict__ C,
                                                 int M, int N, int K) {
    __shared__ __align__(16) float As[TILE_K][TILE_M + TILE_PAD];
    __shared__ __align__(16) float Ws[TILE_K][TILE_N + TILE_PAD];

    const int tid = threadIdx.y * 16 + threadIdx.x;
    const int m0 = blockIdx.y * TILE_M;
    const int n0 = blockIdx.x * TILE_N;

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += TILE_K) {
        load_a(As, m0, k0, tid);  // fills As[k][m] (zeros past M or K)
        load_w(Ws, n0, k0, tid);  // fills Ws[k][n] (zeros past N or K)
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < TILE_K; ++k) {
            const float4 a = *(const float4*)&As[k][threadIdx.y * 4];
            const float4 w = *(const float4*)&Ws[k][threadIdx.x * 4];
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float wv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], wv[j], acc[i][j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = m0 + threadIdx.y * 4 + i;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + threadIdx.x * 4 + j;
            if (n < N) C[(size_t)m * N + n] = acc[i][j];
        }
    }
}

// Stage a [64 rows][TILE_K] slice of a row-major float matrix X[rows, K] as Xs[k][row].
// Consecutive threads take consecutive k of one row, so the global reads are coalesced.
static __device__ __forceinline__ void stage_f32_rows(float (*Xs)[TILE_M + TILE_PAD],
                                                      const float* __restrict__ X, int rows, int K,
                                                      int r0, int k0, int tid) {
#pragma unroll
    for (int i = 0; i < (TILE_M * TILE_K) / TILE_THREADS; ++i) {
        const int idx = i * TILE_THREADS + tid;
        const int r = idx / TILE_K, k = idx % TILE_K;
        const int gr = r0 + r, gk = k0 + k;
        Xs[k][r] = (gr < rows && gk < K) ? X[(size_t)gr * K + gk] : 0.0f;
    }
}
