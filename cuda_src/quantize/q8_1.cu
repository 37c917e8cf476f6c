// float32 activations X[M,K] -> Q8_1 blocks Y[M, K/32], as ggml-cuda/quantize.cu's quantize_q8_1.
//
// One thread per value, one warp per block of 32 (K is a multiple of 32, so a warp never straddles
// two rows). amax and the sum are warp reductions; the sum uses the __shfl_xor_sync butterfly
// (offsets 16, 8, 4, 2, 1) so every lane holds the same bits, and qgemm.formats.warp_sum_32
// mirrors that tree to make the CPU quantizer byte-identical.
//
// `status` reports what the Python caller must turn into a ValueError (a kernel cannot raise):
//   bit 0: a non-finite input value;  bit 1: d or s overflows half.
#include "common/blocks.cuh"

#define Q8_1_THREADS 256

extern "C" __global__ void __launch_bounds__(Q8_1_THREADS)
quantize_q8_1(const float* __restrict__ X, block_q8_1* __restrict__ Y, int M, int K,
              int* __restrict__ status) {
    const int row = blockIdx.y;
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= M || k >= K) return;  // whole warps exit together: K % 32 == 0

    const float xi = X[(size_t)row * K + k];
    float amax = fabsf(xi);
    float sum = xi;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }

    const float d = amax / 127.0f;
    const qg_i8 q = amax == 0.0f ? 0 : (qg_i8)roundf(xi / d);

    block_q8_1* y = Y + (size_t)row * (K / QK) + k / QK;
    const int lane = k % QK;
    y->qs[lane] = q;
    if (lane != 0) return;

    y->d = __float2half_rn(d);
    y->s = __float2half_rn(sum);
    int bad = 0;
    if (!isfinite(amax) || !isfinite(sum)) bad |= 1;
    else if (isinf(__half2float(y->d)) || isinf(__half2float(y->s))) bad |= 2;
    if (bad) atomicOr(status, bad);
}
