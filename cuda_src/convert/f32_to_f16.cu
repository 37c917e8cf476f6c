// float32 activations -> float16 (round to nearest even, __float2half_rn), 8 values per thread
// with 16-byte loads and stores where the row allows. The prologue of the fp16 tensor-core paths:
// `convert.f16` writes [M, K] as it is; `convert.f16k` (CV_KPERM=1) writes the kperm16 layout the
// Hopper prefill kernels read (k deinterleaved inside every 16: common/convert.cuh).
// `status` bit 0: a non-finite input; bit 1: a finite value beyond half's range (it would become inf).
// Programmatic dependent launch (common/pdl.cuh): the GEMM queued behind this kernel may start
// its weight copies at once unless it splits K (it waits for this grid before reading Y; see
// convert_begin), and this kernel itself may
// be launched while the previous op finishes: it waits for that before it reads X (the previous
// op's output) or writes Y (a staging buffer the previous op's GEMM may still be reading).
// The body is convert_to_f16 (common/convert.cuh), shared with bfloat16 input (convert/bf16_to_f16.cu).
#include "common/convert.cuh"

extern "C" __global__ void __launch_bounds__(256)
convert_f32_to_f16(const float* __restrict__ X, __half* __restrict__ Y, int M, int K, int* __restrict__ status,
                   float* __restrict__ Z, long long nz) {
    convert_to_f16(X, Y, M, K, status, Z, nz);
}
