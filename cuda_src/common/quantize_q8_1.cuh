// The Q8_1 activation quantizer shared by quantize/q8_1.cu (float32 input), quantize/q8_1_f16.cu
// (float16 input) and quantize/q8_1_bf16.cu (bfloat16), the 16-bit types converted exactly to float first.
//
// Lane l of a warp owns value l of a block of 32, exactly as in ggml: amax and the sum are warp
// reductions, the sum a __shfl_xor_sync butterfly (offsets 16, 8, 4, 2, 1) after which every lane
// holds the same bits; qgemm.formats.warp_sum_32 mirrors that tree, which is what makes the CPU
// quantizer byte-identical (float addition is not associative, so the order is part of the format).
//
// Unlike ggml's one-block-per-warp launch, each warp here quantizes Q8_1_BLOCKS_PER_WARP blocks
// that lie next to each other in the row, issuing all their loads before the first reduction.
// With one 4-byte load per thread a warp keeps too few bytes in flight to cover DRAM latency
// (Little's law); four independent loads per thread quadruple that without touching the
// per-block arithmetic, so the bytes written are the same.
//
// `status` reports what the Python caller must turn into a ValueError (a kernel cannot raise):
//   bit 0: a non-finite input value;  bit 1: d or s overflows half.
// A NaN value gives its block d = NaN (amax by qg_fmax_nan), so a device call, whose status nobody
// reads before the GEMM runs, still returns NaN where the block is used.
//
// Programmatic dependent launch (common/pdl.cuh): the GEMM behind this kernel may launch at once
// and stream its first weights (it waits for this grid before reading Y), and this kernel may be
// launched while the previous op finishes: it waits for that before reading X (possibly the
// previous op's output) or writing Y (a staging buffer the previous op's GEMM may still read).
#pragma once
#include <cuda_bf16.h>
#include "common/blocks.cuh"
#include "common/pdl.cuh"

#define Q8_1_THREADS 256
#define Q8_1_BLOCKS_PER_WARP 4
#define Q8_1_VALUES_PER_CTA (Q8_1_THREADS * Q8_1_BLOCKS_PER_WARP)

static __device__ __forceinline__ float q8_1_load(const float* p) { return *p; }
static __device__ __forceinline__ float q8_1_load(const __half* p) { return __half2float(*p); }
static __device__ __forceinline__ float q8_1_load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T>
static __device__ __forceinline__ void quantize_q8_1_rows(const T* __restrict__ X, block_q8_1* __restrict__ Y, int M, int K,
                                                          int* __restrict__ status) {
    // a CTA row per token; CUDA launches at most 65535 along y, so past that the launcher adds
    // grid.z (a long prompt in one GEMM). (A loop over rows instead -- row += gridDim.y -- was
    // scheduled differently by ptxas and measured up to 10% slower on the H100: docs/perf/NOTES.md.)
    const int row = blockIdx.y + blockIdx.z * gridDim.y;
    const int lane = threadIdx.x % QK;
    const int warp = threadIdx.x / QK;
    // first value of this warp's run of blocks within the row
    const int k0 = blockIdx.x * Q8_1_VALUES_PER_CTA + warp * (QK * Q8_1_BLOCKS_PER_WARP);
    pdl_launch_dependents();
    pdl_wait();
    if (row >= M) return;

    float xi[Q8_1_BLOCKS_PER_WARP];
#pragma unroll
    for (int b = 0; b < Q8_1_BLOCKS_PER_WARP; ++b) {
        const int k = k0 + b * QK + lane;
        xi[b] = k < K ? q8_1_load(X + (size_t)row * K + k) : 0.0f;  // K % 32 == 0: a block is all in or all out
    }

#pragma unroll
    for (int b = 0; b < Q8_1_BLOCKS_PER_WARP; ++b) {
        const int kb = k0 + b * QK;
        if (kb >= K) break;  // warp-uniform
        float amax = fabsf(xi[b]);
        float sum = xi[b];
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            amax = qg_fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        // A block whose amax is subnormal (below FLT_MIN) is all codes 0, as llama.cpp's
        // -use_fast_math build gives it (its flush to zero makes amax 0). In IEEE arithmetic d =
        // amax / 127 would be a subnormal of a few significant bits there, x / d could pass 127.5
        // (or be +-inf where d underflows to 0), and the (int8) conversion would wrap the code's
        // sign. From FLT_MIN up d keeps >= 16 significant bits, so |x / d| rounds to <= 127.
        // d and s stay as computed; both are 0 in half for such a block anyway.
        const float d = amax / 127.0f;
        const qg_i8 q = amax < 0x1p-126f ? 0 :  // FLT_MIN
                          (qg_i8)roundf(xi[b] / d);

        block_q8_1* y = Y + (size_t)row * (K / QK) + kb / QK;
        y->qs[lane] = q;
        if (lane == 0) {
            y->d = __float2half_rn(d);
            y->s = __float2half_rn(sum);
            // amax is non-finite exactly when a value is (qg_fmax_nan); a sum that overflows float32
            // from finite values overflows half too, and says so as bit 1
            int bad = 0;
            if (!isfinite(amax)) bad |= 1;
            else if (isinf(__half2float(y->d)) || isinf(__half2float(y->s))) bad |= 2;
            if (bad) atomicOr(status, bad);
        }
    }
}
