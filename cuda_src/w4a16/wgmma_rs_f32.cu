// Production prefill on Hopper (sm_90a), float32 activations x Q4_0 weights (skinny layout): the
// register-A wgmma kernel of common/wgmma_rs_f16.cuh with the activations rounded to fp16 by the
// kernel while it stages them, so qgemm.matmul needs no prologue kernel.
#define RS_XF32 1
#include "common/wgmma_rs_f16.cuh"

extern "C" __global__ void __launch_bounds__(RS_THREADS)
w4a16_wgmma_rs_f32(const float* __restrict__ A, const unsigned char* __restrict__ W, float* __restrict__ C, int M, int N, int K) {
    wgmma_rs_f16_gemm<SkQ4_0>(A, W, C, M, N, K);
}
