// Production decode / small batch: float32 activations (float16 / bfloat16 by SK_X:
// common/skinny_common.cuh) x Q4_0 weights (repacked once by qgemm.packing into the skinny layout)
// on fp16 tensor cores with the tokens on the MMA's N side (common/skinny_f16.cuh).
// float32 X by plain loads (fewer address instructions than `__ldg`'s): 2-9% faster at 2-8 tokens
// hot, level or faster cold (SK_XLD32 in common/skinny_common.cuh has the figures and the why);
// the 16-bit variants always load that way.
#ifndef SK_XLD32
#define SK_XLD32 1
#endif
#include "common/skinny_f16.cuh"

extern "C" __global__ void SK_LAUNCH_BOUNDS
w4a16_skinny(const sk_x_t* __restrict__ X, const unsigned char* __restrict__ W, float* __restrict__ C, int M, int N, int K) {
    skinny_f16<SkQ4_0>(X, W, C, M, N, K);
}
