// Production small batch: Q8_1 activations (quantize.q8_1, once per op) x Q4_0 weights (repacked once
// by qgemm.packing into the skinny layout) on int8 tensor cores, the tokens on the MMA's N side:
// llama.cpp's per-block math with one MMA per block and 8 tokens (common/skinny_q8_1.cuh).
#include "common/skinny_q8_1.cuh"

extern "C" __global__ void __launch_bounds__(SK_WARPS * 32)
w4a8_skinny_q8_1(const block_q8_1* __restrict__ X, const unsigned char* __restrict__ W, float* __restrict__ C,
                 int M, int N, int K) {
    skinny_q8_1<SkI8Q4_0>(X, W, C, M, N, K);
}
