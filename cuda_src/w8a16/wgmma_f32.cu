// Production prefill on Hopper (sm_90a): float32 activations x Q8_0 weights (skinny layout,
// repacked once by qgemm.packing) through wgmma, the activations rounded to fp16 in registers as
// the A operand, the weights dequantized into shared memory by a producer warpgroup as the B
// operand: no prologue kernel (common/wgmma_f32_f16.cuh).
#include "common/wgmma_f32_f16.cuh"

extern "C" __global__ void __launch_bounds__(XA_THREADS, 1)
w8a16_wgmma_f32(const float* __restrict__ X, const unsigned char* __restrict__ W, float* __restrict__ C, int M, int N, int K) {
    wgmma_f32_f16_gemm<SkQ8_0>(X, W, C, M, N, K);
}
