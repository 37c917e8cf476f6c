// W8A16: float32 activations x Q8_0 weights, one thread per output, dequantized on the fly.
#include "common/blocks.cuh"

extern "C" __global__ void w8a16_naive(const float* __restrict__ A, const block_q8_0* __restrict__ W,
                                       float* __restrict__ C, int M, int N, int K) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (m >= M || n >= N) return;
    const int nb = K / QK;
    const float* a = A + (size_t)m * K;
    const block_q8_0* w = W + (size_t)n * nb;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        float blk = 0.0f;
#pragma unroll
        for (int j = 0; j < QK; ++j) blk = fmaf(a[b * QK + j], (float)w[b].qs[j], blk);
        acc = fmaf(__half2float(w[b].d), blk, acc);
    }
    C[(size_t)m * N + n] = acc;
}
