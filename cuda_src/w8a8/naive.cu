// W8A8 rung 0: Q8_1 activations x Q8_0 weights, one thread per output, byte-by-byte.
// Q8_0 has no offset, so the block result is just d_w d_a sumi (s_a is not needed).
#include "common/quant_dot.cuh"

extern "C" __global__ void w8a8_naive(const block_q8_1* __restrict__ A, const block_q8_0* __restrict__ W,
                                      float* __restrict__ C, int M, int N, int K) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (m >= M || n >= N) return;
    const int nb = K / QK;
    const block_q8_1* a = A + (size_t)m * nb;
    const block_q8_0* w = W + (size_t)n * nb;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b)
        acc += __half2float(w[b].d) * __half2float(a[b].d) * (float)sumi_q8_0_q8_1_scalar(&w[b], &a[b]);
    C[(size_t)m * N + n] = acc;
}
