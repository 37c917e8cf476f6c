// Production prefill on Hopper (sm_90a), one kernel for the whole op: float32 activations x Q8_0
// weights (skinny layout, repacked once by qgemm.packing). w8a16.wgmma_rs with the activations'
// float32 -> fp16 kperm16 conversion done by its copying warpgroup, a few stages ahead of the
// copies, instead of by a prologue kernel in front of it (RS_FUSE in common/wgmma_rs_f16.cuh).
// Y: the [M, K] fp16 staging buffer; sync: 2 + cdiv(K, 128) words, zero at launch (and left zero).
#include "common/wgmma_rs_f16.cuh"

extern "C" __global__ void __launch_bounds__(RS_BLOCK, RS_MINB)
w8a16_wgmma_rs_fused(const float* __restrict__ X, const unsigned char* __restrict__ W, float* __restrict__ C, int M, int N,
                     int K, __half* Y, unsigned* sync, int* status) {
    wgmma_rs_f16_gemm<SkQ8_0>(Y, W, C, M, N, K, RsFuseArgs{X, Y, sync, status});
}
