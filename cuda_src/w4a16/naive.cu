// Step 3, rung 0: W4A16. float32 activations A[M,K] x Q4_0 weights W[N, K/32] -> float32 C[M,N].
// One thread per output; each Q4_0 block is unpacked on the fly:
//     qs[j] low nibble -> element j,  high nibble -> element j + 16,   x = d * (nibble - 8)
// (ggml's layout: the two halves of a block share a byte, not adjacent elements).
#include "common/blocks.cuh"

extern "C" __global__ void w4a16_naive(const float* __restrict__ A, const block_q4_0* __restrict__ W,
                                       float* __restrict__ C, int M, int N, int K) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (m >= M || n >= N) return;
    const int nb = K / QK;
    const float* a = A + (size_t)m * K;
    const block_q4_0* w = W + (size_t)n * nb;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        const float d = __half2float(w[b].d);
        const float* ab = a + b * QK;
        float blk = 0.0f;
#pragma unroll
        for (int j = 0; j < QK / 2; ++j) {
            const int q = w[b].qs[j];
            blk = fmaf(ab[j], (float)((q & 0x0F) - 8), blk);
            blk = fmaf(ab[j + QK / 2], (float)((q >> 4) - 8), blk);
        }
        acc = fmaf(d, blk, acc);
    }
    C[(size_t)m * N + n] = acc;
}
