// Production prefill on Hopper (sm_90a): fp16 activations in the kperm16 layout (written by
// convert.f16k) x Q8_0 weights (skinny layout, repacked once by qgemm.packing) through wgmma with
// the dequantized weights as the register A operand (common/wgmma_rs_f16.cuh).
#include "common/wgmma_rs_f16.cuh"

extern "C" __global__ void __launch_bounds__(RS_BLOCK, RS_MINB)
w8a16_wgmma_rs(const __half* __restrict__ A, const unsigned char* __restrict__ W, float* __restrict__ C, int M, int N, int K) {
    wgmma_rs_f16_gemm<SkQ8_0>(A, W, C, M, N, K);
}
