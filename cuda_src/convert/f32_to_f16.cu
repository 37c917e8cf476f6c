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
#include "common/convert.cuh"

#ifndef CV_KPERM
#define CV_KPERM 0
#endif
#define CV_VALUES 8  // per thread: the registry's grid is M * K / 2048 CTAs of 256

extern "C" __global__ void __launch_bounds__(256)
convert_f32_to_f16(const float* __restrict__ X, __half* __restrict__ Y, int M, int K, int* __restrict__ status,
                   float* __restrict__ Z, long long nz) {
    convert_begin(Z, nz);  // PDL trigger and wait, the split-K output zeroed (common/convert.cuh)
    const size_t total = (size_t)M * K;
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * CV_VALUES;
    if (i >= total) return;
    int bad = 0;
    // the tail of an [M, K] with K not a multiple of 8 (convert.f16 alone: the kperm16 launcher
    // needs K % 16 == 0, so both lanes of every chunk reach the shuffles of store_kperm16)
    if (i + CV_VALUES > total) {
        for (size_t j = i; j < total; ++j) {
            const __half h = __float2half_rn(X[j]);
            if (!isfinite(X[j])) bad |= 1;
            else if (isinf(__half2float(h))) bad |= 2;
            Y[j] = h;
        }
        if (bad) atomicOr(status, bad);
        return;
    }
    float v[CV_VALUES];
    if ((((size_t)(X + i)) & 15) == 0) {
#pragma unroll
        for (int j = 0; j < CV_VALUES; j += 4) {
            const float4 a = *(const float4*)(X + i + j);
            v[j] = a.x, v[j + 1] = a.y, v[j + 2] = a.z, v[j + 3] = a.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < CV_VALUES; ++j) v[j] = X[i + j];
    }
    __align__(16) __half h[CV_VALUES];
#pragma unroll
    for (int j = 0; j < CV_VALUES; ++j) {
        h[j] = __float2half_rn(v[j]);
        if (!isfinite(v[j])) bad |= 1;
        else if (isinf(__half2float(h[j]))) bad |= 2;
    }
#if CV_KPERM
    store_kperm16(Y, i, total, h);
#else
    if ((((size_t)(Y + i)) & 15) == 0) {
        *(int4*)(Y + i) = *(const int4*)h;
    } else {
#pragma unroll
        for (int j = 0; j < CV_VALUES; ++j) Y[i + j] = h[j];
    }
#endif
    if (bad) atomicOr(status, bad);
}
