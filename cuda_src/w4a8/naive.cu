// Step 4, rung 0: W4A8, one thread per output, byte-by-byte integer arithmetic.
//   C[m,n] = sum over blocks b of d_w (d_a sumi_b - 8 s_a),  sumi_b = sum q_a * q_w (q_w in [0,15])
#include "common/quant_dot.cuh"

extern "C" __global__ void w4a8_naive(const block_q8_1* __restrict__ A, const block_q4_0* __restrict__ W,
                                      float* __restrict__ C, int M, int N, int K) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (m >= M || n >= N) return;
    const int nb = K / QK;
    const block_q8_1* a = A + (size_t)m * nb;
    const block_q4_0* w = W + (size_t)n * nb;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        const float2 ds = q8_1_ds(&a[b]);
        acc += w4a8_block(__half2float(w[b].d), ds.x, ds.y, sumi_q4_0_q8_1_scalar(&w[b], &a[b]));
    }
    C[(size_t)m * N + n] = acc;
}
