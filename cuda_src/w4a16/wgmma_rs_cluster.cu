// Production prefill on Hopper (sm_90a) without a prologue launch: float32 activations x Q4_0
// weights (skinny layout, repacked once by qgemm.packing) through the register-A wgmma kernel
// (common/wgmma_rs_f16.cuh), its copying warpgroup rounding the activations to fp16 itself. The
// RS_CLUSTER CTAs of a thread block cluster along N share that work: each rounds 1 / RS_CLUSTER of
// the activation tile and writes it into the shared memory of all of them.
#define RS_F32 1
#ifndef RS_WS
#define RS_WS 1
#endif
#ifndef RS_CLUSTER
#define RS_CLUSTER 2
#endif
#include "common/wgmma_rs_f16.cuh"

extern "C" __global__ void __cluster_dims__(RS_CLUSTER, 1, 1) __launch_bounds__(RS_BLOCK, RS_MINB)
w4a16_wgmma_rs_cluster(const float* __restrict__ A, const unsigned char* __restrict__ W, float* __restrict__ C, int M, int N, int K) {
    wgmma_rs_f16_gemm<SkQ4_0>(A, W, C, M, N, K);
}
