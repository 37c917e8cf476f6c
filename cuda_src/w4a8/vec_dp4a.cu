// Step 4, rung 4: tiled_dp4a with 16-byte vector loads of the Q8_1 activations and 4 blocks per
// stage (half as many barriers per K).
//
// A Q8_1 block is 36 bytes = 9 words (1 header word {d, s} + 8 qs words), so 4 blocks are
// 144 bytes = 9 uint4: each 16-byte load brings 4 whole words, and word w of the row's stage
// belongs to block w / 9 at position w % 9 (0 = header). The loads are 16-byte aligned when the
// row and stage start are: 36 * (m * nb + b0) % 16 == 0 for every m iff nb % 4 == 0 (b0 is a
// multiple of 4). Otherwise this falls back to the 4-byte stager of tiled_dp4a.
// The weights keep tiled_dp4a's 2-byte stager: a Q4_0 block is 18 bytes, and a stage of them
// moves half the bytes of the activations.
#define DT_BLOCKS 4
#include "common/dp4a_tile.cuh"

#define VEC_ROW_U4 (DT_BLOCKS * 36 / 16)  // uint4 per row per stage (9)

struct DTStageAVec {
    static __device__ __forceinline__ void stage(DTShared& sh, const block_q8_1* __restrict__ A, int M, int nb,
                                                 int r0, int b0, int tid) {
        if ((nb % 4) != 0 || ((size_t)A & 15) != 0 || b0 + DT_BLOCKS > nb) {  // misaligned, or the K tail
            dt_stage_q8_1(sh, A, M, nb, r0, b0, tid);
            return;
        }
        for (int idx = tid; idx < DT_TILE * VEC_ROW_U4; idx += DT_THREADS) {
            const int r = idx / VEC_ROW_U4, j = idx % VEC_ROW_U4;
            const int m = r0 + r;
            int4 v = make_int4(0, 0, 0, 0);
            if (m < M) v = ((const int4*)(A + (size_t)m * nb + b0))[j];
            const int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const int w = 4 * j + t, b = w / 9, pos = w % 9;
                if (pos == 0) {
                    const __half2 ds = *(const __half2*)&words[t];
                    sh.a_d[b][r] = __low2float(ds);
                    sh.a_s[b][r] = __high2float(ds);
                } else {
                    sh.a[b * 8 + pos - 1][r] = words[t];
                }
            }
        }
    }
};

extern "C" __global__ void __launch_bounds__(DT_THREADS)
w4a8_vec_dp4a(const block_q8_1* __restrict__ A, const block_q4_0* __restrict__ W, float* __restrict__ C,
              int M, int N, int K) {
    dt_gemm<DTQ4_0, DTStageAVec>(A, W, C, M, N, K);
}
