// Production small batch on Hopper: float32 activations quantized to int8 per 32-block once per
// thread block cluster (each CTA a share, delivered into every CTA's shared memory) x Q4_0 weights
// (repacked once by qgemm.packing into the skinny layout) on int8 tensor cores, the tokens on the
// MMA's N side, the -8 compensated in integers: common/skinny_cq.cuh.
#include "common/skinny_cq.cuh"

extern "C" __global__ void SK_LAUNCH_BOUNDS
w4a8_skinny_cq(const float* __restrict__ X, const unsigned char* __restrict__ W, float* __restrict__ C, int M, int N, int K) {
    skinny_cq<SkI8Q4_0>(X, W, C, M, N, K);
}
