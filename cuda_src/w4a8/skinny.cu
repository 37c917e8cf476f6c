// Production decode: float32 activations (float16 / bfloat16 by SK_X: common/skinny_common.cuh),
// quantized to int8 per 32-block by the kernel itself, x Q4_0 weights (repacked once by
// qgemm.packing into the skinny layout) on int8 tensor cores with the tokens on the MMA's N side;
// the -8 of Q4_0 compensated in integers (common/skinny_i8.cuh).
#include "common/skinny_i8.cuh"

extern "C" __global__ void SK_LAUNCH_BOUNDS
w4a8_skinny(const sk_x_t* __restrict__ X, const unsigned char* __restrict__ W, float* __restrict__ C, int M, int N, int K) {
    skinny_i8<SkI8Q4_0>(X, W, C, M, N, K);
}
