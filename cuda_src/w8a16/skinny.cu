// Production decode / small batch: float32 activations (float16 / bfloat16 by SK_X:
// common/skinny_common.cuh) x Q8_0 weights (repacked once by qgemm.packing into the skinny layout)
// on fp16 tensor cores with the tokens on the MMA's N side (common/skinny_f16.cuh).
#include "common/skinny_f16.cuh"

extern "C" __global__ void SK_LAUNCH_BOUNDS
w8a16_skinny(const sk_x_t* __restrict__ X, const unsigned char* __restrict__ W, float* __restrict__ C, int M, int N, int K) {
    skinny_f16<SkQ8_0>(X, W, C, M, N, K);
}
