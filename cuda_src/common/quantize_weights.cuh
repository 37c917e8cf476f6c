// ggml's reference weight quantizers on the GPU: float32 / float16 / bfloat16 X[M,K] -> Q4_0 or
// Q8_0 blocks Y[M, K/32], byte for byte what qgemm.formats.quantize_q4_0 / quantize_q8_0 (and
// gguf's numpy quantizer, and ggml's quantize_row_q4_0_ref / quantize_row_q8_0_ref) write.
// Shared by quantize/q4_0.cu and quantize/q8_0.cu.
//
// One thread per block of 32, the block walked in ggml's own order. Both quantizers are a
// handful of float operations per value, so exactness is the whole difficulty:
//   - no FMA: x * id + 8.5f (Q4_0) must round twice, as the C and numpy code do, and NVRTC
//     contracts a*b+c into one FFMA by default (-fmad=true), so the products are __fmul_rn /
//     __fadd_rn;
//   - id = 1 / d is a true IEEE division (NVRTC's default -prec-div=true), then a multiply,
//     never x / d (ggml multiplies by the reciprocal; the Q8_1 activation quantizer divides);
//   - Q4_0's d = max / -8 takes the value of largest magnitude *with its sign*, the first one
//     when several tie (ggml's strict '<'; numpy's argmax): the scan starts from x[0] itself,
//     so a block of zeros keeps x[0]'s sign of zero, as numpy's argmax does;
//   - below |max| ~ 2.4e-38 (Q4_0) or amax ~ 3.7e-37 (Q8_0) d is nonzero but 1 / d overflows,
//     and the products are +-inf or NaN; ggml and numpy then cast them to an integer, which on
//     x86 gives INT_MIN: q = 0 after Q4_0's clamp, and 0 in Q8_0's low byte. Those blocks store
//     d = 0 in half, so the codes do not change a dequantized value; q = 0 keeps the bytes equal.
//   - roundf rounds half away from zero (Q8_0), as C's roundf; rintf would round half to even.
//
// `status` (an int the Python caller turns into a ValueError, as in quantize_q8_1.cuh):
//   bit 0: a non-finite input value;  bit 1: d overflows half (a |value| >= 524160 for Q4_0, 8321040 for Q8_0).
//
// Loads: a block is 128 bytes of float32 or 64 of a 16-bit type, read as 16-byte vectors when X
// is 16-byte aligned (then every block is) and value by value otherwise (a view at an odd
// offset). Stores: see quantize_weight_blocks at the end.
#pragma once
#include <cuda_bf16.h>
#include "common/blocks.cuh"

#define QW_THREADS 256

static __device__ __forceinline__ float qw_widen(float v) { return v; }
static __device__ __forceinline__ float qw_widen(__half v) { return __half2float(v); }
static __device__ __forceinline__ float qw_widen(__nv_bfloat16 v) { return __bfloat162float(v); }

// the 32 values of the block at p, widened exactly to float
template <typename T>
static __device__ __forceinline__ void qw_load_block(const T* __restrict__ p, bool aligned16, float v[QK]) {
    constexpr int per_vec = 16 / sizeof(T);
    if (aligned16) {
#pragma unroll
        for (int i = 0; i < QK / per_vec; ++i) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + i);
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int j = 0; j < per_vec; ++j) v[i * per_vec + j] = qw_widen(e[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < QK; ++j) v[j] = qw_widen(p[j]);
    }
}

// x * id as the integer cast sees it: a non-finite product (1 / d overflowed) casts to 0 (see above)
static __device__ __forceinline__ int qw_trunc_or_zero(float t) { return isfinite(t) ? (int)t : 0; }

static __device__ __forceinline__ void qw_flag(int* status, bool finite, __half d) {
    if (!finite) atomicOr(status, 1);
    else if (__hisinf(d)) atomicOr(status, 2);
}

// ggml's quantize_row_q4_0_ref for one block: d = max / -8, q = MIN(15, (int8_t)(x * id + 8.5f)),
// element j in the low nibble and j + 16 in the high nibble of qs[j]; y: the block's 9 16-bit words
struct qw_q4_0 {
    typedef block_q4_0 Block;
    static __device__ __forceinline__ void quantize(const float v[QK], unsigned short* y, int* status) {
        float amax = fabsf(v[0]), vmax = v[0];
        bool finite = isfinite(v[0]);
#pragma unroll
        for (int j = 1; j < QK; ++j) {
            finite &= isfinite(v[j]);
            if (amax < fabsf(v[j])) {
                amax = fabsf(v[j]);
                vmax = v[j];
            }
        }
        const float d = vmax / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __half hd = __float2half_rn(d);
        y[0] = __half_as_ushort(hd);
#pragma unroll
        for (int j = 0; j < QK / 2; j += 2) {
            unsigned int pair = 0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int lo = min(15, max(0, qw_trunc_or_zero(__fadd_rn(__fmul_rn(v[j + h], id), 8.5f))));
                const int hi = min(15, max(0, qw_trunc_or_zero(__fadd_rn(__fmul_rn(v[j + h + QK / 2], id), 8.5f))));
                pair |= (unsigned int)(lo | (hi << 4)) << (8 * h);
            }
            y[1 + j / 2] = (unsigned short)pair;
        }
        qw_flag(status, finite, hd);
    }
};

// ggml's quantize_row_q8_0_ref for one block: d = amax / 127, q = roundf(x * id); y: 17 words
struct qw_q8_0 {
    typedef block_q8_0 Block;
    static __device__ __forceinline__ void quantize(const float v[QK], unsigned short* y, int* status) {
        float amax = 0.0f;
        bool finite = true;
#pragma unroll
        for (int j = 0; j < QK; ++j) {
            finite &= isfinite(v[j]);
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __half hd = __float2half_rn(d);
        y[0] = __half_as_ushort(hd);
#pragma unroll
        for (int j = 0; j < QK; j += 2) {
            const int q0 = qw_trunc_or_zero(roundf(__fmul_rn(v[j], id)));
            const int q1 = qw_trunc_or_zero(roundf(__fmul_rn(v[j + 1], id)));
            y[1 + j / 2] = (unsigned short)((q0 & 0xFF) | ((q1 & 0xFF) << 8));
        }
        qw_flag(status, finite, hd);
    }
};

// A thread per block; rows are contiguous, so block b of the matrix is X[32 b ..] and Y[b]. The
// blocks go out through shared memory: a thread's own 18- or 34-byte block written straight to
// global memory is 9 or 17 two-byte stores, each of a warp's touching 18 or 32 sectors (the lanes
// are a block apart), so the stores, not the reads, bounded the kernel (Q8_0 at 26% of the copy
// bandwidth on an H100). Staged, a warp's 32 blocks are one contiguous run of 576 or 1088 bytes
// (a multiple of 16, so 16-byte aligned wherever Y is) written as 16-byte stores.
template <typename Q, typename T>
static __device__ __forceinline__ void quantize_weight_blocks(const T* __restrict__ X, typename Q::Block* __restrict__ Y, int M,
                                                              int K, int* __restrict__ status) {
    constexpr int words = sizeof(typename Q::Block) / 2;
    __shared__ __align__(16) unsigned short stage[QW_THREADS * words];
    const long long nblocks = (long long)M * (K / QK);
    const int lane = threadIdx.x % 32, warp_first = threadIdx.x - lane;
    const long long first = (long long)blockIdx.x * QW_THREADS + warp_first;  // the warp's first block
    const long long b = first + lane;
    const bool staged = (reinterpret_cast<size_t>(Y) & 15) == 0;  // else (an out= view) each thread stores its own
    if (b < nblocks) {
        float v[QK];
        qw_load_block(X + b * QK, (reinterpret_cast<size_t>(X) & 15) == 0, v);
        Q::quantize(v, staged ? stage + threadIdx.x * words : reinterpret_cast<unsigned short*>(Y + b), status);
    }
    if (!staged || first >= nblocks) return;  // uniform across the warp
    __syncwarp();
    const int bytes = (int)min(32LL, nblocks - first) * (int)sizeof(typename Q::Block);
    const unsigned short* src = stage + warp_first * words;
    unsigned short* dst = reinterpret_cast<unsigned short*>(Y + first);
    for (int i = lane; i < bytes / 16; i += 32)
        reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    for (int i = bytes / 16 * 8 + lane; i < bytes / 2; i += 32) dst[i] = src[i];  // a last partial warp's tail
}
