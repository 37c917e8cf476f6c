// Step 4, rung 1: W4A8 with shared-memory tiles, still byte-by-byte integer arithmetic.
//
// A 16x16 CTA computes a 16x16 tile of C, one output per thread. Per K step (one block of 32)
// the CTA stages 16 Q8_1 rows and 16 Q4_0 rows into shared memory, Q4_0 nibbles unpacked into
// element order, so each block is fetched from global memory once per CTA instead of once per
// thread. Rows are padded by 4 bytes (36 = 9 words): the 16 tx of a warp then read banks 9 tx mod
// 32, all distinct (9 is odd); with 32-byte rows (8 words) tx, tx + 4, tx + 8 and tx + 12 would
// share a bank (a 4-way conflict).
#include "common/quant_dot.cuh"

#define T 16
#define ROW (QK + 4)

extern "C" __global__ void __launch_bounds__(T * T)
w4a8_tiled(const block_q8_1* __restrict__ A, const block_q4_0* __restrict__ W, float* __restrict__ C,
           int M, int N, int K) {
    __shared__ __align__(4) qg_i8 As[T][ROW];
    __shared__ __align__(4) qg_u8 Ws[T][ROW];
    __shared__ float As_d[T], As_s[T], Ws_d[T];

    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * T + tx;
    const int m0 = blockIdx.y * T, n0 = blockIdx.x * T;
    const int nb = K / QK;
    float acc = 0.0f;

    for (int b = 0; b < nb; ++b) {
        // 256 threads: row r = tid / 16, two values each (element 2c, 2c+1 of the row)
        const int r = tid / T, c = tid % T;
        {
            const int m = m0 + r;
            const block_q8_1* blk = A + (size_t)(m < M ? m : 0) * nb + b;
            As[r][2 * c] = m < M ? blk->qs[2 * c] : 0;
            As[r][2 * c + 1] = m < M ? blk->qs[2 * c + 1] : 0;
            if (c == 0) {
                As_d[r] = m < M ? __half2float(blk->d) : 0.0f;
                As_s[r] = m < M ? __half2float(blk->s) : 0.0f;
            }
        }
        {
            const int n = n0 + r;
            const block_q4_0* blk = W + (size_t)(n < N ? n : 0) * nb + b;
            const int q = n < N ? blk->qs[c] : 0x88;  // byte c: elements c (low) and c+16 (high)
            Ws[r][c] = q & 0x0F;
            Ws[r][c + QK / 2] = q >> 4;
            if (c == 0) Ws_d[r] = n < N ? __half2float(blk->d) : 0.0f;
        }
        __syncthreads();
        int sumi = 0;
#pragma unroll
        for (int k = 0; k < QK; ++k) sumi += (int)As[ty][k] * (int)Ws[tx][k];
        acc += w4a8_block(Ws_d[tx], As_d[ty], As_s[ty], sumi);
        __syncthreads();
    }
    const int m = m0 + ty, n = n0 + tx;
    if (m < M && n < N) C[(size_t)m * N + n] = acc;
}
