// What the skinny decode kernels (common/skinny_f16.cuh, common/skinny_i8.cuh and, through it,
// common/skinny_q8_1.cuh) share: the
// addressing of the packed "skinny" weight layout (qgemm.packing), the split of a CTA's K groups
// among its warps and of K among CTAs (gridDim.y), the software-pipelined weight loads, and the
// cross-warp reduction and store of the C fragments. Include it after SK_R, SK_WARPS, SK_UNROLL
// and SK_PDL_EARLY have their values.
#pragma once
#include <cuda_bf16.h>
#include "common/mma_gemm.cuh"
#include "common/pdl.cuh"
#include "common/zero_output.cuh"  // qgemm_zero_output: zeroes C before a launch with SK_GSPLIT > 1

// SK_MINB: resident CTAs per SM the kernel is compiled for (__launch_bounds__' second argument).
// Not an occupancy knob here so much as a code-generation one: at (R, WARPS, UNROLL) = (1, 8, 2),
// 2 lets ptxas keep a group's four MMAs independent (118 registers instead of 97, still two CTAs
// per SM), which measured faster at M = 1 (qgemm.registry._skinny_i8_config).
#ifndef SK_MINB
#define SK_MINB 1
#endif
#if SK_MINB > 1
#define SK_LAUNCH_BOUNDS __launch_bounds__(SK_WARPS * 32, SK_MINB)
#else
#define SK_LAUNCH_BOUNDS __launch_bounds__(SK_WARPS * 32)
#endif

// SK_X: the element type of the activations X the kernel reads: 0 float32, 1 float16, 2 bfloat16
// (registry variants `*.skinny_f16`, `*.skinny_bf16`). The kernels work in float32 from the load
// on: every float16 and bfloat16 value is exactly a float32, so a 16-bit X gives bit for bit the
// result of the same values passed as float32 in the same configuration. The conversion a caller
// would otherwise run as a kernel of its own (one more launch and round trip per decode op) costs
// one or two instructions per value here.
#ifndef SK_X
#define SK_X 0
#endif
#if SK_X == 0
typedef float sk_x_t;
#elif SK_X == 1
typedef __half sk_x_t;
#elif SK_X == 2
typedef __nv_bfloat16 sk_x_t;
#else
#error "SK_X must be 0 (float32), 1 (float16) or 2 (bfloat16)"
#endif

// Four consecutive activations (at a 16-byte boundary for float32, 8 for the 16-bit types: K % 32
// == 0 and the launcher checks X's base): `raw` is what one load puts in registers (a float4, or
// the 8 bytes of four 16-bit values, half the registers), `load` issues it, and the conversions
// run where the values are used -- not at the load, whose latency they would then wait for:
// `f4` the four as floats (exact), `h2` as the fp16 pairs (v0, v2), (v1, v3) of the skinny fp16
// kernels' B fragments (their k permutation: common/skinny_f16.cuh), which for float16 input is
// two byte permutes and no conversion at all. Either way of loading -- a plain C++ load or the
// `__ldg` intrinsic -- becomes the same non-coherent load (LDG.E.128.CONSTANT, LDG.E.64.CONSTANT:
// NVVM proves a load through `const __restrict__` X read-only by itself, and X is read only after
// the programmatic-dependent-launch wait, with nothing writing it while the kernel runs). What
// differs is the address: `__ldg` is an inline-asm load that takes one 64-bit register per load,
// while the compiler's own load folds the constant part of the offset into the instruction
// (`[R106.64+0x40]` for the second 16 values of a block), so the plain form needs fewer LEA / IMAD:
// `qgemm compile w4a16.skinny --arch sm_90 --shape 16x4096x4096 --sass [-D SK_XLD32=0]` (NVRTC
// 13.5) counts 1375 instructions against 1455 with `__ldg` (LEA 129 / 161), w4a16.skinny_f16 2125
// against 2284 (LEA 197 / 261; its `__ldg` form is commit c535293's source). The 16-bit
// types are read the plain way, which measured faster in the fp16 kernels: H100, kernel alone,
// session 42 -- w4a16.skinny_f16 2 / 4 / 8 / 12 / 16 tokens 4.05 / 4.14 / 5.00 / 6.60 / 6.91 µs
// against 4.29 / 4.41 / 5.33 / 7.41 / 7.94 with `__ldg`, w8a16.skinny_f16 4 / 8 / 16 tokens 5.82
// / 6.27-6.81 / 7.80 against 6.16 / 6.78-7.13 / 8.42, bfloat16 0-12% faster; level in the int8
// kernels and at K = 14336 (w4a16.skinny_bf16 8x4096x14336 3% slower, w8a16.skinny_f16 3% faster).
// SK_XLD32: how float32 X is loaded -- 0 (the default) by `__ldg`, 1 the plain way. Each kernel
// source picks; only w4a16/skinny.cu takes 1. Plain against `__ldg`, kernel alone, H100,
// `tools/probe_defines.py KERNEL SHAPES base plain=SK_XLD32=1 --reps 3`, session 43 (session 42:
// level to 7% faster on a second H100, within -2% / +1% on a third):
// - w4a16.skinny hot: 2 / 3 / 4 / 8 tokens 4.13-4.20 / 4.26-4.29 / 4.37-4.42 / 4.79-4.85 against
//   4.56-4.65 / 4.36-4.44 / 4.47-4.53 / 4.91-5.05, 12 and 16 level, 8x4096x14336 18.04-18.15
//   against 18.26-18.33; cold 2x 5.16-5.19 against 5.39-5.42, 8x level, 16x 1% faster.
// - w8a16.skinny: hot 1% slower at 2-4 tokens, 1-2% faster at 8-16 and at K = 14336, cold 2%
//   slower (2x 8.39-8.47 against 8.25-8.27, 8x 8.71-8.74 / 8.56-8.59); a decode op reads its
//   weights cold in a model, so it keeps `__ldg`.
// - the int8 kernels at one token (w4a8.skinny, w8a8.skinny), hot and cold: level -- their SASS is
//   the same either way -- so they keep `__ldg`.
#ifndef SK_XLD32
#define SK_XLD32 0
#endif
template <typename T> struct SkX;
template <> struct SkX<float> {
    typedef float4 raw;
#if SK_XLD32
    static __device__ __forceinline__ raw load(const float* p) { return *reinterpret_cast<const float4*>(p); }
#else
    static __device__ __forceinline__ raw load(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
#endif
    static __device__ __forceinline__ float4 f4(const raw& v) { return v; }
    static __device__ __forceinline__ void h2(const raw& v, unsigned& lo, unsigned& hi) {
        const __half2 a = __floats2half2_rn(v.x, v.z), b = __floats2half2_rn(v.y, v.w);
        lo = *reinterpret_cast<const unsigned*>(&a), hi = *reinterpret_cast<const unsigned*>(&b);
    }
};
template <> struct SkX<__half> {
    typedef uint2 raw;
    static __device__ __forceinline__ raw load(const __half* p) { return *reinterpret_cast<const uint2*>(p); }
    static __device__ __forceinline__ float4 f4(const raw& v) {
        const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
        const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
        return make_float4(lo.x, lo.y, hi.x, hi.y);
    }
    static __device__ __forceinline__ void h2(const raw& v, unsigned& lo, unsigned& hi) {
        lo = __byte_perm(v.x, v.y, 0x5410), hi = __byte_perm(v.x, v.y, 0x7632);  // (v0 v2), (v1 v3)
    }
};
// A bfloat16 is the high half of a float32's bits, so widening a pair is a shift and a mask. Written
// out rather than cuda_bf16.h's __bfloat1622float2, which NVRTC 13.5 compiles here to more
// instructions (a PRMT and an IMAD.U32 where a LOP3 does): sm_90 SASS of the default configurations
// 739 -> 765 (w4a16.skinny_bf16, 8 tokens), 1452 -> 1516 (w8a16.skinny_bf16, 8 tokens), level for
// w4a8 (1142 / 1144 at one token); session 48's tree.
template <> struct SkX<__nv_bfloat16> {
    typedef uint2 raw;
    static __device__ __forceinline__ raw load(const __nv_bfloat16* p) { return *reinterpret_cast<const uint2*>(p); }
    static __device__ __forceinline__ float4 f4(const raw& v) {
        return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u), __uint_as_float(v.y << 16),
                           __uint_as_float(v.y & 0xFFFF0000u));
    }
    static __device__ __forceinline__ void h2(const raw& v, unsigned& lo, unsigned& hi) { SkX<float>::h2(f4(v), lo, hi); }
};
typedef SkX<sk_x_t> SkXT;

// the four as floats at once (the skinny fp16 kernels' one-time staging of x in shared memory);
// float32's form exactly the 16-byte __ldg the staging always had, so its code is unchanged
static __device__ __forceinline__ float4 sk_load_f4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
template <typename T>
static __device__ __forceinline__ float4 sk_load_f4(const T* p) { return SkX<T>::f4(SkX<T>::load(p)); }

template <int PIECES>  // 16-byte pieces per lane per (tile, group): 2 (Q4_0), 4 (Q8_0)
struct SkSlice {
    static constexpr int GROUP_PIECES = PIECES * 32;  // uint4 per (tile, group)
    typedef uint4 WSet[SK_UNROLL][SK_R][PIECES];
    typedef uint4 DSet[SK_UNROLL][SK_R];
    int lane, warp, g, t, nb, ngroups, ntiles, tile0, gb, ge;
    const uint4* qs;
    const uint4* ds;

    // This warp's groups [gb, ge): the CTA's K range split among its warps, K split among the
    // gridDim.y CTAs of a tile (their partial sums meet in C through atomics)
    __device__ __forceinline__ SkSlice(const unsigned char* Wp, int N, int K) {
        lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        g = lane / 4, t = lane % 4;
        nb = K / QK, ngroups = (nb + 3) / 4, ntiles = (N + 15) / 16;
        qs = reinterpret_cast<const uint4*>(Wp);
        ds = qs + (size_t)ntiles * ngroups * GROUP_PIECES;
        tile0 = blockIdx.x * SK_R;
        const int slices = gridDim.y * SK_WARPS, slice = blockIdx.y * SK_WARPS + warp;
        gb = split_point(ngroups, slice, slices), ge = split_point(ngroups, slice + 1, slices);
    }

    // Groups [G, G + SK_UNROLL) of the CTA's SK_R tiles: every weight byte read once, by one lane, in
    // 16-byte loads (a warp load is 512 contiguous bytes). Past the warp's last group the loads are
    // clamped to it (in bounds; the math is skipped); tiles past N re-read the last tile (never stored).
    __device__ __forceinline__ void load(WSet& wq, DSet& wd, int G) const {
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u) {
            const int Gu = min(G + u, ge - 1);
#pragma unroll
            for (int r = 0; r < SK_R; ++r) {
                const size_t base = (size_t)min(tile0 + r, ntiles - 1) * ngroups + Gu;
#pragma unroll
                for (int p = 0; p < PIECES; ++p) wq[u][r][p] = ld_stream16(qs + base * GROUP_PIECES + p * 32 + lane);
                wd[u][r] = __ldg(ds + base * 8 + g);
            }
        }
    }
};

// The end of both kernels, after the main loop: the programmatic-dependent-launch trigger (unless
// SK_PDL_EARLY fired it at entry: common/skinny_f16.cuh says when each is better), then the CTA's C
// fragments -- frag(r, nt, i) is fragment element i of tile r and 8-token fragment nt in this lane:
// W row g + 8 (i >= 2), token 2t + (i & 1) -- written per warp to red, summed over the warps in a
// fixed order and stored, or added into C with atomics when K is split across CTAs (C zeroed by
// the launcher).
template <int MT, typename Frag>
static __device__ __forceinline__ void sk_reduce_store(float (&red)[SK_WARPS][SK_R * MT * 4][32], const Frag& frag,
                                                       float* __restrict__ C, int M, int N, int tile0) {
#if !SK_PDL_EARLY
    pdl_launch_dependents();  // this CTA's last weight load is issued
#endif
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int r = 0; r < SK_R; ++r)
#pragma unroll
        for (int nt = 0; nt < MT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][(r * MT + nt) * 4 + i][lane] = frag(r, nt, i);
    __syncthreads();
    const bool atomic = gridDim.y > 1;
    for (int idx = threadIdx.x; idx < SK_R * MT * 4 * 32; idx += SK_WARPS * 32) {
        const int l = idx % 32, i = (idx / 32) % 4, nt = (idx / 128) % MT, r = idx / (128 * MT);
        const int row = (tile0 + r) * 16 + l / 4 + (i >= 2 ? 8 : 0);
        const int tok = nt * 8 + (l % 4) * 2 + (i & 1);
        if (row >= N || tok >= M) continue;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < SK_WARPS; ++w) v += red[w][idx / 32][l];
        if (atomic)
            atomicAdd(C + (size_t)tok * N + row, v);
        else
            C[(size_t)tok * N + row] = v;
    }
}
