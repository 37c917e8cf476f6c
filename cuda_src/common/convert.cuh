// Shared by the activation prologues of the fp16 tensor-core paths (cuda_src/convert/).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "common/pdl.cuh"
#include "common/zero_output.cuh"

// The start of every prologue kernel. Z (nz floats, may be null): the split-K GEMM behind the
// prologue adds into it with atomics, so the prologue zeroes it (common/zero_output.cuh says why
// not a memset; these modules carry that file's qgemm_zero_output entry too, never launched).
// Programmatic dependent launch (common/pdl.cuh): the GEMM behind may launch now and copy its
// first weights -- unless it splits K (nz > 0): launched that early, the split-K wgmma_rs ran
// 2 us (64x4096x4096) to 12 us (64x4096x14336) slower per op on the H100 (docs/perf/NOTES.md;
// without the early trigger it still launches as a dependent when this grid ends, which is where
// its gain is). Then wait for the previous op before reading X (its output) or writing Y (a
// staging buffer its GEMM may still read), and zero Z.
static __device__ __forceinline__ void convert_begin(float* __restrict__ Z, long long nz) {
    if (nz == 0) pdl_launch_dependents();
    pdl_wait();
    if (nz > 0) zero_floats(Z, nz);
}

// Eight fp16 values of k = i .. i + 7 (i a multiple of 8, K of 16) stored in the kperm16 layout
// (qgemm.packing.kperm16): inside each 16-chunk the even k first, then the odd ones. Why the Hopper
// prefill kernels want it: with k permuted like this (in both operands: the product is unchanged)
// a lane's own qs word of the skinny layout is its natural wgmma A fragment, so the kernel needs
// no byte shuffle between lanes (common/wgmma_rs_f16.cuh).
//
// The two lanes of a chunk (i % 16 == 0 and 8: lanes 2c, 2c + 1, both running or both not: the
// launcher needs K % 16 == 0, one thread per 8 values, blockDim a multiple of 32) trade
// halves with one pair of shuffles so that each writes one whole 16-byte half of the chunk: the
// even lane the 8 even k, the odd lane the 8 odd k. Measured on the H100: storing each lane's 4
// evens and 4 odds directly (two 8-byte stores, each sector written half by two instructions)
// converted as fast alone but slowed the GEMM chained behind it by 1-2% at 512 tokens and up to
// 6% at 2048; 16 values per thread (two 16-byte stores without shuffles) made the conversion
// itself 30% slower (half the loads in flight). docs/perf/NOTES.md.
static __device__ __forceinline__ void store_kperm16(__half* __restrict__ Y, size_t i, size_t total, const __half (&h)[8]) {
    const unsigned* w = reinterpret_cast<const unsigned*>(h);  // (h0 h1) (h2 h3) (h4 h5) (h6 h7)
    const unsigned e0 = __byte_perm(w[0], w[1], 0x5410), e1 = __byte_perm(w[2], w[3], 0x5410);  // h0 h2, h4 h6
    const unsigned o0 = __byte_perm(w[0], w[1], 0x7632), o1 = __byte_perm(w[2], w[3], 0x7632);  // h1 h3, h5 h7
    const bool odd = (i & 8) != 0;  // the second lane of the chunk: it writes the odd k
    // the lanes still running: those with a chunk below `total` (the others returned). Named
    // exactly, not __activemask(), which need not include a partner that has not reconverged yet.
    const size_t i0 = i - (size_t)(threadIdx.x & 31) * 8, left = (total - i0) / 8;
    const unsigned mask = left >= 32 ? 0xFFFFFFFFu : (1u << left) - 1u;
    const unsigned r0 = __shfl_xor_sync(mask, odd ? e0 : o0, 1), r1 = __shfl_xor_sync(mask, odd ? e1 : o1, 1);
    const uint4 v = odd ? make_uint4(r0, r1, o0, o1) : make_uint4(e0, e1, r0, r1);
    __half* dst = Y + (i & ~(size_t)15) + (odd ? 8 : 0);
    if (((size_t)Y) & 15) {  // an out= buffer that is only 2-byte aligned
        const __half* hv = reinterpret_cast<const __half*>(&v);
#pragma unroll
        for (int j = 0; j < 8; ++j) dst[j] = hv[j];
        return;
    }
    *reinterpret_cast<uint4*>(dst) = v;
}

#ifndef CV_KPERM
#define CV_KPERM 0
#endif
#define CV_VALUES 8  // per thread: the registry's grid is M * K / 2048 CTAs of 256

static __device__ __forceinline__ float cv_float(float x) { return x; }
static __device__ __forceinline__ float cv_float(__nv_bfloat16 x) { return __bfloat162float(x); }  // exact

// CV_VALUES consecutive inputs from a 16-byte aligned p, in 16-byte loads
static __device__ __forceinline__ void cv_load_aligned(const float* p, float (&v)[CV_VALUES]) {
#pragma unroll
    for (int j = 0; j < CV_VALUES; j += 4) {
        const float4 a = *(const float4*)(p + j);
        v[j] = a.x, v[j + 1] = a.y, v[j + 2] = a.z, v[j + 3] = a.w;
    }
}
static __device__ __forceinline__ void cv_load_aligned(const __nv_bfloat16* p, float (&v)[CV_VALUES]) {
    // 8 bfloat16, each the high half of a float32's bits: a shift or a mask widens it (written out, as
    // in skinny_common.cuh's SkX: with __bfloat1622float2 NVRTC 13.5's sm_90 SASS of convert.f16_bf16
    // grows from 670 to 674 instructions, convert.f16k_bf16's from 723 to 727; session 48's tree)
    const uint4 a = *(const uint4*)p;
    const unsigned w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) v[2 * j] = __uint_as_float(w[j] << 16), v[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
}

// float32 or bfloat16 X[M, K] -> float16 Y (round to nearest even), [M, K] as it is or, with
// CV_KPERM, in the kperm16 layout; one thread per CV_VALUES values. `status` bit 0: a non-finite
// input; bit 1: a finite value beyond half's range (it would become inf: bfloat16 reaches 3.4e38
// as float32 does, float16 65504).
template <typename T>
static __device__ __forceinline__ void convert_to_f16(const T* __restrict__ X, __half* __restrict__ Y, int M, int K,
                                                      int* __restrict__ status, float* __restrict__ Z, long long nz) {
    convert_begin(Z, nz);  // PDL trigger and wait, the split-K output zeroed
    const size_t total = (size_t)M * K;
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * CV_VALUES;
    if (i >= total) return;
    int bad = 0;
    // the tail of an [M, K] with K not a multiple of 8 (convert.f16 alone: the kperm16 launcher
    // needs K % 16 == 0, so both lanes of every chunk reach the shuffles of store_kperm16)
    if (i + CV_VALUES > total) {
        for (size_t j = i; j < total; ++j) {
            const float x = cv_float(X[j]);
            const __half h = __float2half_rn(x);
            if (!isfinite(x)) bad |= 1;
            else if (isinf(__half2float(h))) bad |= 2;
            Y[j] = h;
        }
        if (bad) atomicOr(status, bad);
        return;
    }
    float v[CV_VALUES];
    if ((((size_t)(X + i)) & 15) == 0) {
        cv_load_aligned(X + i, v);
    } else {
#pragma unroll
        for (int j = 0; j < CV_VALUES; ++j) v[j] = cv_float(X[i + j]);
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
