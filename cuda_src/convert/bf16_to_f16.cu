// bfloat16 activations -> float16 (round to nearest even), the prologue of the fp16 tensor-core
// paths for a bfloat16 model: `convert.f16_bf16` writes [M, K] as it is, `convert.f16k_bf16`
// (CV_KPERM=1) the kperm16 layout of the Hopper prefill kernels. Every bfloat16 is exactly a
// float32, so Y is bit for bit convert.f16 / convert.f16k of the same values as float32 --
// including `status` bit 1 for values past half's 65504, which bfloat16 holds and float16 cannot.
// Body, PDL and status: convert_to_f16 (common/convert.cuh).
#include "common/convert.cuh"

extern "C" __global__ void __launch_bounds__(256)
convert_bf16_to_f16(const __nv_bfloat16* __restrict__ X, __half* __restrict__ Y, int M, int K, int* __restrict__ status,
                    float* __restrict__ Z, long long nz) {
    convert_to_f16(X, Y, M, K, status, Z, nz);
}
