// Mustafar: attention straight on a bitmap-sparse (fp16 / 4-bit / 2-bit) KV cache.
// Layouts: qgemm/kvcache.py and docs/mustafar.md. Tiles of 64 elements, a 64-bit occupancy bitmap
// each (bit i <-> element i); keys tiled along each token's D, values along S for each channel.
//
//   key kernel    scores[b*g+.., l, s] = sum_d q[.., l, d] K[s, d]        (fp16 out)
//   value kernel  out[b*g+.., l, d]   += sum_s p[.., l, s] V[s, d]        (fp32, accumulated)
//
// Work unit: a lane walks a whole token (keys: the D/32 words of its D/64 tiles) or a whole tile
// (values: the two words of one 64-token tile of a channel); a warp step = 32 lanes of
// consecutive tiles, whose codes / values are one contiguous byte range (the "window"), copied
// to shared memory with 16-byte cp.async one step ahead while the metadata of the step after is
// loaded into registers. Per word, the set bits are walked from the top (FLO), the codes from
// the last one down, dequantized two at a time (version 2: a shift, mask, IMAD spread and OR, then
// one HFMA2; version 3: one shift and one LOP3 -- plus a constant move where the constants are
// immediates, MF_CREG -- then one HFMA2) and multiplied with the R
// query / probability rows of their positions, gathered from shared memory:
//   keys:   the queries of the row block, REP copies interleaved so the lanes of a half-warp
//           (8-byte rows) or quarter-warp (16-byte rows) never hit the same bank;
//   values: the probabilities of the CTA's chunk, transposed to [pos][word][lane][row] so a
//           lane's reads always fall in its own bank.
// Products accumulate in half2 within a word (<= 32 terms), fp32 across words. Keys store their
// R fp16 scores per lane; values reduce-scatter a channel's R sums over the warp once per step
// and atomicAdd them (times the channel's output scale, osc below, where MF_OSC) into the fp32
// output (zeroed first, by mustafar_zero_output below).
//
// Compile-time configuration (-D from the launcher, qgemm.kvcache.plan_for):
//   MF_R      query rows per CTA: 4 or 8 (more rows: row blocks)
//   MF_D      head dim (64, 128, 256)
//   MF_REP    copies of the query rows in shared memory (key kernels: 16 for 4 rows, 8 for 8)
//   MF_WARPS  warps per CTA
//   MF_WIN2   bytes of one window stage (sized from the cache's largest step)
//   MF_V3     1 (default): version 3 (below; plan_for: the 4/2-bit layouts and the fp16 keys),
//             0: version 2 (plan_for: the fp16 values only)
//   MF_VMASK  version 2's fp16 values: 1 zeroes the values a lane reads past its own (mf_half_tile),
//             0 relies on the window's zeroed pad and finite data below (plan_for: by density)
//   MF_VTRIG  value kernels: when they release the next kernel (programmatic dependent launch):
//             1 at entry, 2 after their own wait, 0 at exit. H100, µs 1 / 2 / 0: 32x16384x128
//             value q2 24.0 / 24.1 / 25.6, 32x4096 value fp16 10.6 / 11.0 / 11.0, 32x1024 value q2
//             6.4 / 6.4 / 7.7. (Released at entry, later ops' grids may queue behind this one, as
//             the keys' did; here that measured no slower.)
//   MF_KTRIG  key kernels: when they release the next kernel (programmatic dependent launch):
//             1 right after their own wait, 2 at entry, 0 at exit. H100, µs 1 / 2 / 0: 32x1024x128
//             q4 3.25 / 5.66 / 4.48, 32x2048 q2 3.92 / 4.68 / 5.61, 32x16384 q2 19.5 / 19.5 / 21.9.
//             Released at entry, the next grid is released at its own entry too, and so on: the
//             waiting CTAs of several grids fill the SMs unevenly
//   MF_KEARLY key kernels, version 3: what the prologue reads of the cache above the PDL wait
//             (the cache: no qgemm kernel writes it), so that a CTA started under the previous
//             kernel's tail has those DRAM round trips behind it when the wait returns. 0: step
//             0's metadata; 1: and step 0's window (mf3_prep); 2: and step 1's metadata, which
//             the first loop iteration's prep needs before step 0's walk. Default 2 up to D = 128,
//             1 at D = 256 (not measured there; step 1's metadata, 20 registers for 4 tiles, held
//             over the queries' loads made the 4-bit keys spill 8 bytes with MF_CREG=1). H100,
//             32x16384x128, µs 0 / 1: fp16 25.4 / 22.5, q2 19.3 / 18.8, q4 22.6 / 21.8 at 70%; q2
//             26.0 / 25.2 at 50%; 32x4096 fp16 9.9 / 8.1, q4 6.4 / 6.5; plain launches the same (q2
//             21.8 / 21.9). 1 / 2 (another call): fp16 22.9 / 22.3, q2 18.8 / 18.5; 32x4096 fp16
//             8.0 / 7.8, q2 6.0 / 6.0
//   MF_VEARLY the same for the value kernels: 0 (default): step 0's metadata (version 2: and
//             step 1's); 1: and step 0's window (versions 2 and 3); 2 (version 3): and step 1's
//             metadata, without the window. Neither measured faster where it counts: H100,
//             32x16384x128, µs 1 / 0: q2 24.3 / 23.9 at 70%, 28.9 / 28.3 at 50%, 32k 44.9 / 44.2;
//             fp16 26.3 / 26.6, 50% 37.9 / 39.3, 32k 50.9 / 50.6. 2 / 0 (another call): q2 23.3 /
//             23.5 at 70%, 28.9 / 28.4 at 50%, 32k 50% 54.8 / 53.8, 32x1024 6.5 / 6.4; q4 24.0 /
//             24.6 at 70%, 29.8 / 30.5 at 50%; q2c 24.5 / 24.8, q4c 25.7 / 25.4 at 70%
//   MF_CREG   4/2-bit key kernels, version 3: 1 keeps the code mask and the 1.0 pair in registers
//             (one LOP3 per slot instead of a LOP3 and a constant move: mf3_code_consts), 0 lets them fold into
//             immediates, -1 (default): 1 for 2-bit, 0 for 4-bit. H100, 32x16384x128, µs 1 / 0:
//             q2 25.96 / 26.20 at 50%, 19.30 / 19.42 at 70%, 32x32768 50% 48.4 / 49.1; q4 28.70 /
//             28.52 at 50%, 22.43 / 22.25 at 70% (q2c and q4c alike)
//   MF_MMA    1: version 4 of the 4/2-bit value kernels (tensor cores on densely decoded tiles,
//             sm_80+; plan_for takes it above 8 query rows), with MF_NT row tiles of 8 per CTA
//   MF_OSC    value kernels: 1 multiplies each channel's sums by its output scale (osc, below)
//             before they are added to the output; 0 compiles that out. Set by the launcher from
//             the upload (1 where it scaled a channel: MustafarRunner.launch), never by a plan. 1
//             costs the 4/2-bit walks 1.4-2.6% (H200, 32x16384x128 cold, q2 23.16 -> 23.76 us,
//             q4c 25.01 -> 25.37; loaded after the walk instead: 23.94, 25.78), a register held
//             over the walk at the 64-register bound
#pragma once
#include <cuda_fp16.h>
#include "common/pdl.cuh"
// NVRTC has no <stdint.h>: the fixed-width types used here
typedef unsigned int uint32_t;
typedef unsigned char uint8_t;

#ifndef MF_R
#define MF_R 4
#endif
#ifndef MF_D
#define MF_D 128
#endif
#ifndef MF_REP
#define MF_REP 16
#endif
#ifndef MF_WARPS
#define MF_WARPS 8
#endif
#ifndef MF_VTRIG
#define MF_VTRIG 1
#endif
static_assert(MF_VTRIG >= 0 && MF_VTRIG <= 2, "MF_VTRIG: 0 (release at exit), 1 (at entry) or 2 (after the wait)");
#ifndef MF_CREG
#define MF_CREG -1
#endif
static_assert(MF_CREG >= -1 && MF_CREG <= 1, "MF_CREG: 1 (code constants in registers), 0 (immediates) or -1 (by bits)");
#ifndef MF_KTRIG
#define MF_KTRIG 1
#endif
#ifndef MF_KEARLY
#define MF_KEARLY (MF_D <= 128 ? 2 : 1)
#endif
#ifndef MF_VEARLY
#define MF_VEARLY 0
#endif
#ifndef MF_OSC
#define MF_OSC 0
#endif
static_assert(MF_OSC == 0 || MF_OSC == 1, "MF_OSC: 1 (the value kernels scale each channel's sums by osc) or 0");
static_assert(MF_KTRIG >= 0 && MF_KTRIG <= 2, "MF_KTRIG: 0 (release at exit), 1 (after the wait) or 2 (at entry)");
static_assert(MF_KEARLY >= 0 && MF_KEARLY <= 2, "MF_KEARLY: 0, 1 or 2 (what the key kernels read above the PDL wait)");
static_assert(MF_VEARLY >= 0 && MF_VEARLY <= 2, "MF_VEARLY: 0, 1 or 2 (what the value kernels read above the PDL wait)");
#ifndef MF_MIN_CTAS
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MF_MIN_CTAS 2
#else
// resident CTAs per SM the registers must allow: 4 CTAs of 8 warps (64 registers), 3 where a
// lane holds 4 tiles of metadata (D = 256) or 8 rows, 2 for both
#define MF_MIN_CTAS ((MF_R == 4 && MF_D <= 128) ? 4 : ((MF_R == 8 && MF_D == 256) ? 2 : 3))
#endif
#endif
#define MF_THREADS (MF_WARPS * 32)
#define MF_FULL 0xffffffffu

static_assert(MF_R == 4 || MF_R == 8, "MF_R must be 4 or 8 (more rows: row blocks)");
static_assert(MF_D == 64 || MF_D == 128 || MF_D == 256, "MF_D must be 64, 128 or 256");
static_assert(MF_REP >= 1 && MF_REP <= 16 && (MF_REP & (MF_REP - 1)) == 0, "MF_REP must be a power of 2 <= 16");

// zero bytes below each window stage of the value kernels and of version 3's keys (reads below a
// lane's first code / value stay finite); version 2's keys have none and mask their fp16 reads
#define MF_PAD 64

// Shared memory of the key kernel's query copies: [D/32 blocks][33 positions][REP][R] halfs
// (row 0 of every block is zeros, "position -1": lanes that ran out of non-zeros read it).
#define MF_XS_BYTES ((MF_D / 32) * 33 * MF_REP * MF_R * 2)

// Kernel parameters, the same for all ten entries:
//   bmp     bitmaps [B, T] (as pairs of 32-bit words, low word = elements 0..31)
//   offs    fp16: counts [B, T+1] (value index of each tile, then the end)
//           plain 4/2-bit: byte offset of each tile's codes [B, T]
//           compact: byte offset of each group of 16 tiles of a tile row [B, G+1]
//           (version 2 and the compact layouts read only the offset of each warp step's first
//           tile / group and rebuild the rest as prefix sums of the popcounts, which
//           validate_compressed guarantees; versions 3 and 4 read every plain / fp16 tile's own)
//   scl     plain: scales [B, T] float; compact: dq [B, T] half2 (mult, add); fp16: unused
//   zer     plain: zeros [B, T] float (zero points in code units); otherwise unused
//   data    packed codes (uint8) or fp16 values; 16-byte aligned and padded to a multiple of 16
//   x       key: queries [B, R, D] half; value: probabilities [B, R, S] half   (R = groups * Lq)
//   out     key: scores [B, R, S] half; value: output [B, R, D] float (accumulated: zero it first)
//   osc     value kernels compiled with MF_OSC=1: each channel's output scale [B, D] float, 2^-e.
//           The device copy of a value cache holds channel d of kv head b times 2^e (its fp16
//           values, scales or dq), e chosen so that a channel whose values all lie below 1 in
//           magnitude has its largest in [1, 2) (qgemm.kvcache.channel_exponents): a word's
//           half2 sums of products p x v, p near 1/S, then stay clear of fp16's subnormals however
//           small the cache's values are. The sums are multiplied by it before they are added to
//           the output. Otherwise unused (null: an upload with no channel scaled, and the keys)
//   S, R    tokens, query rows per kv head
//   per_cta key: warp steps (32 tokens) per CTA; value (versions 2 and 3): channels per CTA (a
//           multiple of MF_WARPS); value version 4: 64-token tiles per CTA (a multiple of 16)
// grid = (chunks * ceil(R / MF_R), B, 1) (keys) or (chunks * D / per_cta * ceil(R / MF_R), B, 1)
// (values, versions 2 and 3), the row block fastest; version 4: (ceil(tiles / per_cta) *
// D / (8 MF_WARPS) * ceil(R / (8 MF_NT)), B, 1).
#define MF_PARAMS                                                                                          \
    const uint32_t *__restrict__ bmp, const int *__restrict__ offs, const void *__restrict__ scl,          \
        const float *__restrict__ zer, const uint8_t *__restrict__ data, const __half *__restrict__ x,     \
        void *__restrict__ out, const float *__restrict__ osc, int S, int R, int per_cta
#define MF_ARGS bmp, offs, scl, zer, data, x, out, osc, S, R, per_cta

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (common/pdl.cuh; qgemm.kvcache.MustafarRunner.launch):
//   - a value kernel accumulates into its output, so the launcher runs mustafar_zero_output
//     (an entry of every value module) first. The zero kernel releases the value kernel at once,
//     then waits for the kernel before it (which may still read or write the output) and zeroes.
//     The value kernel (versions 2 and 3) loads its first metadata from the cache, which no
//     qgemm kernel writes, then waits (for the zero kernel, so for everything before it) before it
//     reads the probabilities -- the kernel before the zero kernel may write them -- and
//     before its first atomicAdd. So the value kernel's start overlaps the previous kernel's
//     end and the zeroing: H100, 32x16384x128 value q2 25.8 us with plain launches, 25.1 with
//     the value kernel released after the zero kernel's wait, 23.7 released at its entry.
//   - a key kernel waits before it reads the queries (the previous kernel may write them) or
//     writes scores, and releases the next kernel right after that wait (MF_KTRIG); above the
//     wait it reads only the cache.
// Without the launch attribute (QGEMM_PDL=0, GPUs before sm_90) both are no-ops and the zero
// kernel is an ordinary memset.

extern "C" __global__ void __launch_bounds__(256) mustafar_zero_output(float *__restrict__ out, int n) {
    pdl_launch_dependents();
    pdl_wait();
    for (int i = blockIdx.x * 256 + threadIdx.x; i < n; i += gridDim.x * 256) out[i] = 0.0f;
}

// ---------------------------------------------------------------------------------------------
// small helpers

__device__ __forceinline__ void mf_cp16(void *smem, const void *gmem) {
#if __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
    *reinterpret_cast<uint4 *>(smem) = __ldg(reinterpret_cast<const uint4 *>(gmem));
#endif
}

__device__ __forceinline__ void mf_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mf_wait1() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mf_wait_all() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

__device__ __forceinline__ int mf_warp_max(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_max_sync(MF_FULL, v);
#else
#pragma unroll
    for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(MF_FULL, v, o));
    return v;
#endif
}

// a value ptxas cannot rematerialize (it would otherwise recompute shared addresses from S2R in
// every word of the walk): one SHFL per step
__device__ __forceinline__ uint32_t mf_opaque(uint32_t v) { return __shfl_sync(MF_FULL, v, threadIdx.x & 31); }

__device__ __forceinline__ __half2 mf_as_h2(uint32_t u) { return *reinterpret_cast<__half2 *>(&u); }

// a plain tile's float32 scale and zero point -> the (mult, add) fp16 pair the kernels dequantize
// with, exactly as qgemm.kvcache.dequant_constants (float32 operations, no FMA, one rounding each).
// The kernels form h = 1 + q / 2^BITS (the code OR-ed into the mantissa of fp16 1.0), so
// h * mult + add = (2^BITS s + q s) + (-z s - 2^BITS s) = (q - z) s with mult = 2^BITS s and
// add = -z s - mult: one HFMA2 per pair of codes
template <int BITS>
__device__ __forceinline__ uint32_t mf_dq_pack(float scale, float zero) {
    const float mult = scale * (float)(1 << BITS);
    const float add = __fsub_rn(__fmul_rn(-zero, scale), mult);
    const __half2 h = __halves2half2(__float2half_rn(mult), __float2half_rn(add));
    return *reinterpret_cast<const uint32_t *>(&h);
}

// shared-memory loads at a 32-bit shared address (one IMAD per gather address, no generic pointers);
// "memory": never moved above the barrier that publishes the rows
__device__ __forceinline__ uint2 mf_lds64(uint32_t a) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ uint4 mf_lds128(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
    return v;
}

__device__ __forceinline__ uint32_t mf_lds32(uint32_t a) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(a) : "memory");
    return v;
}

// R <= 8 rows of X at a shared address: one 8- or 16-byte load, R/2 half2 FMAs
template <int R>
struct MfRow;
template <>
struct MfRow<4> {
    typedef uint2 T;
    static __device__ __forceinline__ T load(uint32_t a) { return mf_lds64(a); }
    template <int N>
    static __device__ __forceinline__ void fma(const T &x, __half2 v, __half2 (&acc)[N]) {
        acc[0] = __hfma2(mf_as_h2(x.x), v, acc[0]);
        acc[1] = __hfma2(mf_as_h2(x.y), v, acc[1]);
    }
};
template <>
struct MfRow<8> {
    typedef uint4 T;
    static __device__ __forceinline__ T load(uint32_t a) { return mf_lds128(a); }
    template <int N>
    static __device__ __forceinline__ void fma(const T &x, __half2 v, __half2 (&acc)[N]) {
        acc[0] = __hfma2(mf_as_h2(x.x), v, acc[0]);
        acc[1] = __hfma2(mf_as_h2(x.y), v, acc[1]);
        acc[2] = __hfma2(mf_as_h2(x.z), v, acc[2]);
        acc[3] = __hfma2(mf_as_h2(x.w), v, acc[3]);
    }
};

// fp16 values walked from the top down, two per aligned 32-bit load where a 16-bit load read one:
// a lane reads at an address of its own, so its loads are scattered over the window and each
// costs ~3.3 bank wavefronts whatever its width (Nsight Compute, key fp16 at 70%: 2.8 of the
// kernel's 5.6 M shared wavefronts were the 16-bit value loads, the L1 87% busy). Value k sits at
// vt - 2k (vt: the shared address of value 0). Phase vt % 4 == 2: the word at vt - 2k - 2 holds
// (value k + 1, value k) in its (low, high) halves. Phase 0: value k is the low half of the
// previous pair's word (at vt - 2k), value k + 1 the high half of this one (at vt - 2k - 4). One
// funnel shift of (this word, previous word) by 0 or 16 bits puts value k in the high half and
// value k + 1 in the low half in both phases. The caller loads `prev` before the first pair.
struct MfHalfPairs {
    uint32_t base, sh, prev;  // base: the word of pair 0, at (vt - 2) & ~3
    __device__ __forceinline__ void init(uint32_t vt) {
        base = (vt - 2) & ~3u;
        sh = (vt & 2) ? 0 : 16;
    }
    // values (k, k + 1), k even, as the (high, low) halves
    __device__ __forceinline__ uint32_t pair(int k) {
        const uint32_t cur = mf_lds32(base - 2 * k);
        const uint32_t f = __funnelshift_r(cur, prev, sh);
        prev = cur;
        return f;
    }
};

// A dim's R query values (row pairs as half2) into its MF_REP interleaved copies. Consecutive
// threads take consecutive dims, whose copies are MF_REP * MF_R * 2 = 128 bytes apart: written
// copy by copy in the same order by every lane, a half-warp's 8-byte (quarter-warp's 16-byte)
// stores all fell on the same banks (Nsight Compute, key q2 at 70%: 0.46 of its 3.0 M shared
// wavefronts, in the prologue of every CTA). Each lane starts at a copy of its own instead.
__device__ __forceinline__ void mf_store_query_copies(uint8_t *dst, const uint32_t (&hw)[MF_R / 2], int lane) {
#pragma unroll
    for (int j = 0; j < MF_REP; ++j) {
        const int rep = (j + lane) & (MF_REP - 1);
        if (MF_R == 4) *reinterpret_cast<uint2 *>(dst + rep * 8) = make_uint2(hw[0], hw[1]);
        else
            *reinterpret_cast<uint4 *>(dst + rep * 16) = make_uint4(hw[0], hw[1], hw[2 % (MF_R / 2)], hw[3 % (MF_R / 2)]);
    }
}

// The half-tile's sparse dot product: acc[r] += sum over set bits j of word of
//   value(j) * X[j][r]   (X row of position j at xrow0 + j * xstride, R halfs; the row at
//   xrow0 - xstride, "position -1", is zeros: lanes that ran out of non-zeros read it)
// The set bits are walked from the top (FLO, -1 when none is left), so the codes are consumed
// from the last one down; they are read from the window left-aligned (code n-1 at the top of
// c[NCW-1]) and dequantized two at a time into a half2.
template <int BITS, bool PADDED = false>
__device__ __forceinline__ void mf_half_tile(uint32_t word, uint32_t mdq, int lpos, const uint8_t *buf, uint32_t xrow0,
                                             int xstride, __half2 (&acc)[MF_R / 2]) {
    constexpr int NCW = BITS == 16 ? 1 : BITS;  // 32-bit code words of a half-tile: 2 (2-bit), 4 (4-bit)
    constexpr int PER = BITS == 16 ? 1 : 32 / BITS;
    const int n = __popc(word);
    const int kmax = mf_warp_max(n);
    uint32_t c[NCW];
    __half2 dqm, dqa;
    // fp16: values k, k + 1 (k even) of the descending walk from one aligned 32-bit load
    // (MfHalfPairs); before pair 0 the word above it (phase 0 takes value 0 from it), which
    // stays inside the 16-byte chunk of the last value
    const uint32_t vlast = (uint32_t)__cvta_generic_to_shared(buf) + (BITS == 16 ? 2 * (lpos + n - 1) : 0);
    MfHalfPairs hp;
    hp.init(vlast);
    hp.prev = BITS == 16 ? mf_lds32((vlast & 2) ? hp.base : hp.base + 4) : 0u;
    if (BITS != 16) {
        // the NCW words ending at this half-tile's last code bit (may start before the buffer:
        // those bits, below code 0, are only used by padding iterations that multiply zeros)
        const int e = lpos + n * BITS - 32 * NCW;
        const uint32_t *w = reinterpret_cast<const uint32_t *>(buf) + (e >> 5);
        const int sh = e & 31;
        uint32_t lo = w[0];
#pragma unroll
        for (int i = 0; i < NCW; ++i) {
            const uint32_t hi = w[i + 1];
            c[i] = __funnelshift_r(lo, hi, sh);
            lo = hi;
        }
        const __half2 dq = mf_as_h2(mdq);
        dqm = __low2half2(dq);
        dqa = __high2half2(dq);
    } else {
        c[0] = 0;
        dqm = dqa = __float2half2_rn(0.0f);
    }
    uint32_t bits = word;
    // codes k and k+1 (k even) of the descending walk, from word cw whose top holds code k at
    // bits [32 - BITS (j+1), 32 - BITS j), j = k % PER -> (value k+1, value k) as (low, high)
    auto pair = [&](uint32_t cw, int j) {
        constexpr int MB = 10 - BITS;                        // h = 1 + q / 2^BITS: code in mantissa bits [MB, 10)
        const int low = 32 - BITS * (j + 2);
        const uint32_t t = (cw >> low) & ((1u << (2 * BITS)) - 1u);
        // t = (code k << BITS) | code k+1; the multiply puts code k+1 at mantissa bits [MB, 10) of
        // the low half and code k at [16 + MB, 26) of the high half (the two partial products
        // cover disjoint bits, so no carries); the mask keeps one code per half and 0x3C00 is
        // fp16 1.0, so each half becomes 1 + q / 2^BITS exactly
        const uint32_t spread = t * ((1u << MB) + (1u << (16 + MB - BITS)));
        const uint32_t q = (1u << BITS) - 1u;
        const uint32_t h = (spread & ((q << MB) | (q << (16 + MB)))) | 0x3C003C00u;
        return __hfma2(mf_as_h2(h), dqm, dqa);
    };
    {
        // fully unrolled, every code at a constant bit position; the X rows of the next
        // pair are gathered before the FMAs of this one (past the last non-zero they are the zero
        // row: harmless), so the shared-memory latency overlaps a pair's work
        typedef typename MfRow<MF_R>::T XT;
        auto gather = [&]() {
            const int pos = 31 - __clz(bits);                // FLO: -1 once no bit is left
            bits &= ~__funnelshift_l(0u, 1u, pos);  // 1 << (pos & 31): defined for pos = -1 (bit 31, already clear)
            return MfRow<MF_R>::load(xrow0 + pos * xstride);
        };
        XT xa = gather(), xb = gather();
#pragma unroll
        for (int k0 = 0; k0 < 32; k0 += 2) {
            if (k0 >= kmax) break;
            const XT ca = xa, cb = xb;
            if (k0 + 2 < 32) {
                xa = gather();
                xb = gather();
            }
            __half2 va, vb;
            if (BITS == 16) {
                // past the lane's first value the loads read what lies below it: other lanes'
                // values, or below the stage whatever is there -- finite and multiplied by the
                // zero row where the stage has MF_PAD zero bytes below it (PADDED: the lowest
                // read is 64 bytes below the stage, lane 0 with no value and kmax 32), else zeroed
                // here (4 of a pair's ~24 instructions: the value kernel 10-12% faster without at
                // 60-70% sparsity (32x16384x128; 16% at 32k), 5% at 55%, 3% slower at 50%:
                // plan_for's MF_VMASK; H100, session 19)
                const __half2 f = mf_as_h2(hp.pair(k0));
                if (PADDED) {
                    va = __high2half2(f);
                    vb = __low2half2(f);
                } else {
                    va = k0 < n ? __high2half2(f) : __float2half2_rn(0.0f);
                    vb = k0 + 1 < n ? __low2half2(f) : __float2half2_rn(0.0f);
                }
            } else {
                const __half2 v = pair(c[NCW - 1 - k0 / PER], k0 % PER);
                va = __high2half2(v);
                vb = __low2half2(v);
            }
            MfRow<MF_R>::fma(ca, va, acc);
            MfRow<MF_R>::fma(cb, vb, acc);
        }
    }
}

// =============================================================================================
// The kernels: a lane walks whole tokens (keys: the D/32 words of one token) or a whole tile
// (values: both words of one 64-token tile), so a warp step is 32 lanes x U tiles of consecutive
// tiles (keys U = D/64, values U = MF_VALUE_U):
//   - the per-step work (metadata loads, window bounds, the cp.async of the window) is amortized
//     over 2-8x more non-zeros than half-tile lanes (the first version of these kernels; values
//     2x, keys D/32 x);
//   - keys need no reduction across lanes (a lane holds its token's R scores) and store them
//     coalesced; values reduce a channel's R sums across the warp once per step with a
//     reduce-scatter (log2 R halving exchanges, then a butterfly);
//   - version 2 (version 3 keeps this split; its differences are listed at its section): the
//     only offset read per step is the step's first (counts / offsets / group offsets: one
//     broadcast load); a lane's position in the window is an exclusive scan of the tiles' byte
//     counts across the warp (the formats guarantee offsets == prefix sums of the popcounts);
//   - the window stage holds MF_WIN2 bytes, sized by the launcher from the cache's largest step;
//   - rows per CTA MF_R is 4 or 8 (more rows: row blocks, adjacent in the grid so that they read
//     the same compressed bytes from L2).
// The sparse dot product of a word is mf_half_tile (version 2) or mf3_pair (version 3).

// value kernels: one tile per lane. Two (64-tile steps, 16-warp CTAs sharing twice the staged
// probabilities) measured 10-15% slower on the H100 (docs/perf/NOTES.md, the version 3 session)
// and were removed from the plans; the walks stay generic in U, which the keys use.
#define MF_VALUE_U 1
#ifndef MF_VMASK
#define MF_VMASK 0  // version 2's fp16 values: 1 zeroes the values read past a lane's count (mf_half_tile)
#endif
#ifndef MF_WIN2
#define MF_WIN2 1024  // bytes of one window stage (multiple of 16)
#endif
static_assert(MF_WIN2 % 16 == 0 && MF_WIN2 >= 64, "MF_WIN2 must be a multiple of 16");

// zero the pads below a warp's two window stages (wb: the warp's region, [pad][stage][pad][stage])
__device__ __forceinline__ void mf_zero_pads(uint8_t *wb, int lane) {
    if (lane < 2 * MF_PAD / 16) {
        const int st = lane / (MF_PAD / 16), c = lane % (MF_PAD / 16);
        *reinterpret_cast<uint4 *>(wb + st * (MF_PAD + MF_WIN2) + 16 * c) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// The bitmaps of U consecutive tiles from tile t (t even), two 64-bit bitmaps per 16-byte load
// (both versions' metadata loaders).
template <int U>
__device__ __forceinline__ void mf_load_bitmap_pairs(uint32_t (&w)[2 * U], const uint32_t *__restrict__ bmp, size_t t) {
#pragma unroll
    for (int j = 0; j < U / 2; ++j) {
        const uint4 v = __ldg(reinterpret_cast<const uint4 *>(bmp) + t / 2 + j);
        w[4 * j + 0] = v.x;
        w[4 * j + 1] = v.y;
        w[4 * j + 2] = v.z;
        w[4 * j + 3] = v.w;
    }
}

// U = 2 or 4 consecutive tiles' scales (plain: float bits; compact: dq half2 bits) and, unless
// COMPACT, zero points: one 8- or 16-byte load each (both metadata loaders)
template <int U, bool COMPACT>
static __device__ __forceinline__ void mf_load_scale_zero_vec(uint32_t (&dq)[U], float (&zero)[U], const uint32_t *sp,
                                                              const uint32_t *zp) {
    if (U == 2) {
        const uint2 v = __ldg(reinterpret_cast<const uint2 *>(sp));
        dq[0] = v.x;
        dq[1] = v.y;
        if (!COMPACT) {
            const uint2 z = __ldg(reinterpret_cast<const uint2 *>(zp));
            zero[0] = __uint_as_float(z.x);
            zero[1] = __uint_as_float(z.y);
        }
    } else {
        const uint4 v = __ldg(reinterpret_cast<const uint4 *>(sp));
        dq[0] = v.x;
        dq[1] = v.y;
        // (i % U keeps the index inside the array where U == 2 makes this branch dead)
        dq[2 % U] = v.z;
        dq[3 % U] = v.w;
        if (!COMPACT) {
            const uint4 z = __ldg(reinterpret_cast<const uint4 *>(zp));
            zero[0] = __uint_as_float(z.x);
            zero[1] = __uint_as_float(z.y);
            zero[2 % U] = __uint_as_float(z.z);
            zero[3 % U] = __uint_as_float(z.w);
        }
    }
}

template <int U>
struct Mf2Meta {
    uint32_t w[2 * U];  // bitmap words of the lane's U tiles (0: no tile)
    uint32_t dq[U];     // plain: scale bits; compact: dq half2 bits; fp16: unused
    float zero[U];      // plain: zero points
    int base;           // counts / offsets / group offset of the step's first tile (the same for all lanes)
};

// metadata of a step: the lane's U tiles start at tile index t (of the flat [B*T] arrays); oidx
// indexes offs for the step's base
template <int BITS, bool COMPACT, int U>
__device__ __forceinline__ void mf2_load(Mf2Meta<U> &m, const uint32_t *__restrict__ bmp, const int *__restrict__ offs,
                                         const void *__restrict__ scl, const float *__restrict__ zer, size_t t, bool ok,
                                         size_t oidx) {
#pragma unroll
    for (int j = 0; j < 2 * U; ++j) m.w[j] = 0u;
#pragma unroll
    for (int j = 0; j < U; ++j) {
        m.dq[j] = 0u;
        m.zero[j] = 0.0f;
    }
    if (ok) {
        if (U == 1) {
            const uint2 v = __ldg(reinterpret_cast<const uint2 *>(bmp) + t);
            m.w[0] = v.x;
            m.w[1] = v.y;
        } else {
            mf_load_bitmap_pairs<U>(m.w, bmp, t);
        }
        if (BITS != 16) {
            const uint32_t *sp = reinterpret_cast<const uint32_t *>(scl) + t;
            const uint32_t *zp = reinterpret_cast<const uint32_t *>(zer) + t;
            if (U == 1) {
                m.dq[0] = __ldg(sp);
                if (!COMPACT) m.zero[0] = __uint_as_float(__ldg(zp));
            } else {
                mf_load_scale_zero_vec<U, COMPACT>(m.dq, m.zero, sp, zp);
            }
        }
    }
    m.base = __ldg(offs + oidx);
}

// units of a tile's data: fp16 values (halfs) or code bytes
template <int BITS>
__device__ __forceinline__ int mf2_units(int n) { return BITS == 16 ? n : (n * BITS + 7) >> 3; }

// The step's window into buf (cp.async, 16-byte chunks). Returns the lane's first tile position
// in the buffer in units (halfs for fp16, bytes otherwise).
template <int BITS, int U>
__device__ __forceinline__ int mf2_issue(const Mf2Meta<U> &m, const uint8_t *__restrict__ data, uint8_t *buf, int lane) {
    int units = 0;
#pragma unroll
    for (int j = 0; j < U; ++j) units += mf2_units<BITS>(__popc(m.w[2 * j]) + __popc(m.w[2 * j + 1]));
    int incl = units;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(MF_FULL, incl, o);
        if (lane >= o) incl += y;
    }
    const int total = __shfl_sync(MF_FULL, incl, 31);
    constexpr int SC = BITS == 16 ? 2 : 1;
    const int start = m.base * SC, end = (m.base + total) * SC;
    // cp.async moves 16-byte-aligned chunks (the data is 16-byte aligned and padded), so the
    // window starts at start rounded down and the lanes' positions are offset by start - a. The
    // min never binds for a plan made from this cache (MF_WIN2: at least the largest step + 48 bytes);
    // it keeps a mismatched plan inside the warp's stage
    const int a = start & ~15;
    const int nchunk = min((end - a + 15) >> 4, MF_WIN2 / 16);
    for (int c = lane; c < nchunk; c += 32) mf_cp16(buf + 16 * c, data + a + 16 * c);
    return (start - a) / SC + incl - units;
}

// The lane's U tiles: acc[r] += sum over their non-zeros of value * X[pos][r]. Word j's X rows
// start at xw0 + j * xwstep (its row -1 is zeros), position rows xstride bytes apart.
template <int BITS, bool COMPACT, int U, bool PADDED = false>
__device__ __forceinline__ void mf2_walk(Mf2Meta<U> m, int first, const uint8_t *buf, uint32_t xw0, int xwstep,
                                         int xstride, float (&acc)[MF_R]) {
    // half2 sums within a word (<= 32 products), fp32 across words (a token's up to 256 products
    // summed in half2 miss the dense-tile accuracy)
    auto word = [&](uint32_t w, uint32_t dq, int lpos, uint32_t xa) {
        __half2 h[MF_R / 2];
#pragma unroll
        for (int j = 0; j < MF_R / 2; ++j) h[j] = __float2half2_rn(0.0f);
        mf_half_tile<BITS, PADDED>(w, dq, lpos, buf, xa, xstride, h);
#pragma unroll
        for (int j = 0; j < MF_R / 2; ++j) {
            const float2 f = __half22float2(h[j]);
            acc[2 * j] += f.x;
            acc[2 * j + 1] += f.y;
        }
    };
    int pos = first;
    // one copy of the walk (instruction cache): a rolled loop over the tiles, the next tile's
    // metadata shifted down into slot 0 after each
#pragma unroll 1
    for (int j = 0; j < U; ++j) {
        uint32_t dq = m.dq[0];
        if (BITS != 16 && !COMPACT) dq = mf_dq_pack<BITS>(__uint_as_float(dq), m.zero[0]);
        const int nlo = __popc(m.w[0]), nhi = __popc(m.w[1]);
        const int lo = BITS == 16 ? pos : pos * 8;
        const int hi = lo + nlo * (BITS == 16 ? 1 : BITS);
        word(m.w[0], dq, lo, xw0);
        word(m.w[1], dq, hi, xw0 + xwstep);
        pos += mf2_units<BITS>(nlo + nhi);
        xw0 += 2 * xwstep;
#pragma unroll
        for (int k = 0; k + 1 < U; ++k) {
            m.w[2 * k] = m.w[2 * k + 2];
            m.w[2 * k + 1] = m.w[2 * k + 3];
            m.dq[k] = m.dq[k + 1];
            m.zero[k] = m.zero[k + 1];
        }
    }
}

// Where a key-kernel CTA sits (both versions): grid.x = (chunk of per_cta warp steps, row block),
// row block fastest; this warp's steps (n: steps cs + warp, + MF_WARPS, ... below the chunk's end);
// the batch's bases into the per-tile arrays (tb) and into the offsets / compact groups (ob).
template <int BITS, bool COMPACT, int U>
struct MfKeyCta {
    int b, row0, nr, cs, n;
    size_t tb, ob;
    __device__ __forceinline__ MfKeyCta(int S, int R, int per_cta, int warp) {
        b = blockIdx.y;
        const int rb = (R + MF_R - 1) / MF_R;
        row0 = (blockIdx.x % rb) * MF_R;
        nr = min(MF_R, R - row0);
        const int T = S * U;
        const int steps_b = (S + 31) >> 5;
        cs = (blockIdx.x / rb) * per_cta;
        const int ce = min(cs + per_cta, steps_b);
        n = cs + warp < ce ? (ce - cs - warp + MF_WARPS - 1) / MF_WARPS : 0;
        tb = (size_t)b * T;
        ob = BITS == 16 ? (size_t)b * (T + 1) : (COMPACT ? (size_t)b * ((T + 15) / 16 + 1) : tb);
    }
};

// ---------------------------------------------------------------------------------------------
// key kernel v2: a lane = a token (its D/64 tiles); a warp step = 32 tokens
// per_cta: steps per CTA; grid = (chunks * row blocks, B, 1), row block fastest

template <int BITS, bool COMPACT>
__device__ __forceinline__ void mf2_key(MF_PARAMS) {
    static_assert(MF_R == 4 || MF_R == 8, "version 2: MF_R must be 4 or 8");
    constexpr int U = MF_D / 64;
    constexpr int BLK = 33 * MF_REP * MF_R * 2;  // bytes of one 32-dim block of query rows
    extern __shared__ __align__(16) uint8_t mf_smem[];
    uint8_t *xs = mf_smem;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint8_t *win = mf_smem + MF_XS_BYTES + warp * 2 * MF_WIN2;

    const MfKeyCta<BITS, COMPACT, U> c(S, R, per_cta, warp);
    const int b = c.b, row0 = c.row0, nr = c.nr, cs = c.cs, n = c.n;
    const size_t tb = c.tb, ob = c.ob;

    auto meta = [&](Mf2Meta<U> &m, int i) {
        const int st = cs + warp + i * MF_WARPS;
        const int s = st * 32 + lane;
        const int t0 = st * 32 * U;
        mf2_load<BITS, COMPACT, U>(m, bmp, offs, scl, zer, tb + (size_t)s * U, s < S, ob + (COMPACT ? t0 / 16 : t0));
    };

    if (MF_KTRIG == 2) pdl_launch_dependents();
    Mf2Meta<U> m0, m1;
    int p0 = 0;
    if (n > 0) meta(m0, 0);
    if (n > 1) meta(m1, 1);
    if (n > 0) p0 = mf2_issue<BITS, U>(m0, data, win, lane);
    mf_commit();
    pdl_wait();  // before the queries (the previous kernel may write them) and the scores
    if (MF_KTRIG == 1) pdl_launch_dependents();

    // queries of this row block, REP interleaved copies; row 0 of each block of 32 dims is zeros.
    // A thread takes a dim: its R loads are one round of latency.
    for (int d = threadIdx.x; d < MF_D; d += MF_THREADS) {
        uint32_t hw[MF_R / 2];
#pragma unroll
        for (int j = 0; j < MF_R / 2; ++j) {
            const __half h0 = 2 * j < nr ? x[((size_t)b * R + row0 + 2 * j) * MF_D + d] : __float2half_rn(0.0f);
            const __half h1 = 2 * j + 1 < nr ? x[((size_t)b * R + row0 + 2 * j + 1) * MF_D + d] : __float2half_rn(0.0f);
            const __half2 h = __halves2half2(h0, h1);
            hw[j] = *reinterpret_cast<const uint32_t *>(&h);
        }
        mf_store_query_copies(xs + (size_t)(((d >> 5) * 33 + 1 + (d & 31)) * MF_REP) * MF_R * 2, hw, lane);
    }
    for (int i = threadIdx.x; i < (MF_D / 32) * MF_REP * MF_R / 4; i += MF_THREADS) {  // the zero rows, 8 bytes at a time
        const int blk = i / (MF_REP * MF_R / 4), k = i % (MF_REP * MF_R / 4);
        *reinterpret_cast<uint2 *>(xs + (size_t)blk * 33 * MF_REP * MF_R * 2 + k * 8) = make_uint2(0u, 0u);
    }
    __syncthreads();

    __half *scores = reinterpret_cast<__half *>(out) + ((size_t)b * R + row0) * S;
    // position 0 of dim block 0 (row 0, "position -1", is the zero row), copy lane % MF_REP of
    // it: a half-warp's (quarter-warp's) gathers land on distinct banks whatever the positions
    const uint32_t xw0 = (uint32_t)__cvta_generic_to_shared(xs) + (MF_REP + (lane % MF_REP)) * MF_R * 2;
    int pcur = p0;
    // Step i: the window of step i+1 is issued from its metadata (loaded a step ago), the metadata
    // of step i+2 is loaded into the register set step i's leaves free. The two sets alternate by
    // the parity of i (a uniform branch), so no in-flight load is ever moved between registers,
    // and the walk below is one copy.
    for (int i = 0; i < n; ++i) {
        Mf2Meta<U> cur;
        int pnext = 0;
        uint8_t *nb = win + ((i + 1) & 1) * MF_WIN2;
        if ((i & 1) == 0) {
            cur = m0;
            if (i + 2 < n) meta(m0, i + 2);
            if (i + 1 < n) pnext = mf2_issue<BITS, U>(m1, data, nb, lane);
        } else {
            cur = m1;
            if (i + 2 < n) meta(m1, i + 2);
            if (i + 1 < n) pnext = mf2_issue<BITS, U>(m0, data, nb, lane);
        }
        mf_commit();
        mf_wait1();
        __syncwarp();
        float acc[MF_R];
#pragma unroll
        for (int j = 0; j < MF_R; ++j) acc[j] = 0.0f;
        mf2_walk<BITS, COMPACT, U>(cur, pcur, win + (i & 1) * MF_WIN2, xw0, BLK, MF_REP * MF_R * 2, acc);
        __syncwarp();
        const int s = (cs + warp + i * MF_WARPS) * 32 + lane;
        if (s < S) {
#pragma unroll
            for (int r = 0; r < MF_R; ++r) {
                if (r < nr) scores[(size_t)r * S + s] = __float2half_rn(acc[r]);
            }
        }
        pcur = pnext;
    }
}

// ---------------------------------------------------------------------------------------------
// value kernel v2: a lane = one tile of one channel (64 tokens); a warp step = 32 tiles of one
// channel. A CTA takes a chunk of 32 tiles (2048 tokens) for per_cta channels; its warps take the
// channels round-robin, one step each.
// grid = (chunks * channel groups * row blocks, B, 1), row block fastest, then channel group.

// The value kernels' probabilities of the chunk, staged once per CTA (rows past nr and tokens past S
// are zeros): token 64 * (u0 + U * l + j) + 32 h + pos -> ps[1 + pos][(2 j + h) * 32 + l][r], row 0 zeros
// ("position -1"), so a lane's gathers fall in its own bank.
//
// Work item i = (tile lane l = i % 32, tile j and 8-token group q: i / 32 = 8 j + q) loads the 8
// tokens of group q of tile U l + j, four rows at a time (one 16-byte load per row), and
// transposes them in registers (PRMT) into 8 vectors of 4 halfs, one per token: 8 8-byte stores
// per four rows, and a warp's lanes are 32 consecutive columns of one position, so with 4 rows
// each store is the minimum two wavefronts (with 8 rows, 16-byte apart: four). The earlier form
// stored each half on its own (8 MF_R 16-bit stores and their index math per 8 tokens) after step
// 0's window request: H100, 32x16384x128 at 70%, value fp16 30.3-30.6 -> 29.7-30.1 us, q4c 30.2 ->
// 29.1, 32x1024x128 8.3-8.5 -> 7.7 (docs/perf/NOTES.md, session 20; skipping the staging
// altogether, wrong results, measured 4 us less: most of it is the wait for the probabilities and
// the barrier, not the stores). The loads read 16 bytes of 32 lines, the other groups' items
// (other warps) the rest of each line, from L1.
//
// In two parts, so that a kernel can issue the first item's loads right after its PDL wait (the
// probabilities may come from the previous kernel) and before the first instruction that waits
// for step 0's metadata (its first window needs it): mf_probs_load (registers), then
// mf_probs_stage (that item's stores, the other items, the zero row and the barrier that
// publishes them). Eight rows are two quads, loaded and stored one after the other (32 registers
// of loads held at once spilled at the 3-CTA register bound).
struct MfProbs {
    uint4 v[4];  // row 4 quad + r: tokens 8 q .. 8 q + 7 of the item's tile
};

template <int U>
__device__ __forceinline__ void mf_probs_load(MfProbs &pr, int i, int quad, const __half *__restrict__ x, int b, int R,
                                              int row0, int nr, int S, int u0) {
    const int l = i & 31, jq = i >> 5;
    const int s = u0 * 64 + 64 * (U * l + jq / 8) + 8 * (jq % 8);  // first token of the group
    const bool vec = (S & 7) == 0 && s + 8 <= S;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int r = 4 * quad + k;
        const __half *src = x + ((size_t)b * R + row0 + min(r, nr - 1)) * S + s;
        if (r < nr && vec) {
            pr.v[k] = __ldg(reinterpret_cast<const uint4 *>(src));
        } else {
            __half h[8];
#pragma unroll
            for (int t = 0; t < 8; ++t) h[t] = (r < nr && s + t < S) ? src[t] : __float2half_rn(0.0f);
            pr.v[k] = *reinterpret_cast<const uint4 *>(h);
        }
    }
}

template <int U>
__device__ __forceinline__ void mf_probs_store(const MfProbs &pr, int i, int quad, uint8_t *ps) {
    constexpr int NCOL = 64 * U, POS_BYTES = NCOL * MF_R * 2;
    const int l = i & 31, jq = i >> 5, q = jq % 8;
    const int col = (2 * (jq / 8) + (q >> 2)) * 32 + l, pos0 = (q & 3) * 8;
    uint8_t *dst = ps + (size_t)(1 + pos0) * POS_BYTES + (size_t)col * MF_R * 2 + 8 * quad;
    const uint32_t *w = reinterpret_cast<const uint32_t *>(pr.v);  // row k of the quad, token pair t: w[4 k + t]
#pragma unroll
    for (int t = 0; t < 4; ++t) {  // tokens 2t, 2t + 1: rows (0, 1) and (2, 3) of the quad as half2
        *reinterpret_cast<uint2 *>(dst + 2 * t * POS_BYTES) =
            make_uint2(__byte_perm(w[t], w[4 + t], 0x5410), __byte_perm(w[8 + t], w[12 + t], 0x5410));
        *reinterpret_cast<uint2 *>(dst + (2 * t + 1) * POS_BYTES) =
            make_uint2(__byte_perm(w[t], w[4 + t], 0x7632), __byte_perm(w[8 + t], w[12 + t], 0x7632));
    }
}

// Whether the kernels load the first item's first quad early (mf_probs_load right after
// pdl_wait, before the prologue's waits for the metadata): with 8 rows the second quad's loads
// would wait for its stores anyway.
#define MF_PROBS_EARLY (MF_R == 4)

// The kernels' early part: quad 0 of item threadIdx.x, if MF_PROBS_EARLY (a no-op otherwise)
template <int U>
__device__ __forceinline__ void mf_probs_begin(MfProbs &first, const __half *__restrict__ x, int b, int R, int row0, int nr,
                                               int S, int u0) {
    if (MF_PROBS_EARLY && threadIdx.x < 256 * U) mf_probs_load<U>(first, threadIdx.x, 0, x, b, R, row0, nr, S, u0);
}

// first: from mf_probs_begin
template <int U>
__device__ __forceinline__ void mf_probs_stage(const MfProbs &first, const __half *__restrict__ x, uint8_t *ps, int b, int R,
                                               int row0, int nr, int S, int u0) {
    constexpr int NCOL = 64 * U, ITEMS = 256 * U;
    for (int i = threadIdx.x; i < ITEMS; i += MF_THREADS) {
#pragma unroll
        for (int quad = 0; quad < MF_R / 4; ++quad) {
            MfProbs pr = first;  // (unset and unused without MF_PROBS_EARLY)
            if (!MF_PROBS_EARLY || i != threadIdx.x) mf_probs_load<U>(pr, i, quad, x, b, R, row0, nr, S, u0);
            mf_probs_store<U>(pr, i, quad, ps);
        }
    }
    __half *dst = reinterpret_cast<__half *>(ps);
    for (int i = threadIdx.x; i < NCOL * MF_R; i += MF_THREADS) dst[i] = __float2half_rn(0.0f);
    __syncthreads();
}

// Where a value-kernel CTA sits (both versions): grid.x = (chunk, channel group, row block), row
// block fastest; the chunk's tiles, the batch's bases into the per-tile arrays (tb) and into the
// offsets / compact groups (ob).
template <int BITS, bool COMPACT, int U>
struct MfValueCta {
    int b, rb, ncg, row0, cg, chunk, nr, nst, T, u0, gpr, n;
    size_t tb, ob;
    __device__ __forceinline__ MfValueCta(int S, int R, int per_cta) {
        b = blockIdx.y;
        rb = (R + MF_R - 1) / MF_R;
        ncg = MF_D / per_cta;
        row0 = (blockIdx.x % rb) * MF_R;
        cg = (blockIdx.x / rb) % ncg;
        chunk = blockIdx.x / (rb * ncg);
        nr = min(MF_R, R - row0);
        nst = (S + 63) >> 6;        // tiles per channel
        T = MF_D * nst;
        u0 = chunk * 32 * U;        // first tile of the chunk (of each channel)
        gpr = (nst + 15) >> 4;      // compact groups per channel
        n = per_cta / MF_WARPS;     // this warp's steps (channels)
        tb = (size_t)b * T;
        ob = BITS == 16 ? (size_t)b * (T + 1) : (COMPACT ? (size_t)b * (MF_D * gpr + 1) : tb);
    }
};

// The MF_R partial sums of a value step, summed over the warp and added to the output of channel
// ch: a reduce-scatter (halve the rows at each of the first log2 MF_R exchanges, lane bit 4 - k
// picks the upper half), then a butterfly over the rest; lane 0 of each row's group adds it
// (times the channel's output scale sc where MF_OSC).
__device__ __forceinline__ void mf_value_sum_store(float (&v)[MF_R], int lane, int nr, float *o, int ch, float sc) {
    constexpr int LR = MF_R == 4 ? 2 : 3;  // log2 MF_R
    const int myrow = lane >> (5 - LR);     // the row this lane holds after the reduce-scatter
#pragma unroll
    for (int k = 0; k < LR; ++k) {
        const int off = 16 >> k, half = MF_R >> (k + 1);
        const bool up = (lane & off) != 0;
#pragma unroll
        for (int j = 0; j < half; ++j) {
            const float send = up ? v[j] : v[j + half];
            const float keep = up ? v[j + half] : v[j];
            v[j] = keep + __shfl_xor_sync(MF_FULL, send, off);
        }
    }
#pragma unroll
    for (int off = 16 >> LR; off; off >>= 1) v[0] += __shfl_xor_sync(MF_FULL, v[0], off);
    if ((lane & ((32 >> LR) - 1)) == 0 && myrow < nr) atomicAdd(o + (size_t)myrow * MF_D + ch, MF_OSC ? v[0] * sc : v[0]);
}

template <int BITS, bool COMPACT>
__device__ __forceinline__ void mf2_value(MF_PARAMS) {
    if (MF_VTRIG == 1) pdl_launch_dependents();
    static_assert(MF_R == 4 || MF_R == 8, "version 2: MF_R must be 4 or 8");
    constexpr int U = MF_VALUE_U;
    constexpr int NCOL = 64 * U;              // half-tiles of a step
    extern __shared__ __align__(16) uint8_t mf_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint8_t *ps = mf_smem;                    // [33 positions][NCOL][MF_R] halfs; row 0 zeros
    uint8_t *wb = mf_smem + 33 * NCOL * MF_R * 2 + warp * 2 * (MF_PAD + MF_WIN2);  // [pad][stage][pad][stage]
    uint8_t *win = wb + MF_PAD;
    mf_zero_pads(wb, lane);

    const MfValueCta<BITS, COMPACT, U> c(S, R, per_cta);
    const int b = c.b, row0 = c.row0, cg = c.cg, nr = c.nr, nst = c.nst, u0 = c.u0, gpr = c.gpr, n = c.n;
    const size_t tb = c.tb, ob = c.ob;

    auto chan = [&](int i) { return cg * per_cta + warp + i * MF_WARPS; };
    auto meta = [&](Mf2Meta<U> &m, int i) {
        const int d = chan(i);
        const int u = u0 + lane * U;
        const int t0 = d * nst + u0;
        mf2_load<BITS, COMPACT, U>(m, bmp, offs, scl, zer, tb + (size_t)d * nst + u, u < nst,
                                   ob + (COMPACT ? (size_t)d * gpr + (u0 >> 4) : (size_t)t0));
    };

    float *o = reinterpret_cast<float *>(out) + ((size_t)b * R + row0) * MF_D;
    // position 0 (row 1 of the staged probabilities: NCOL columns of MF_R halfs), column = lane
    // (word 0; word 1 is 32 columns on)
    const uint32_t xw0 = (uint32_t)__cvta_generic_to_shared(ps) + (NCOL + lane) * MF_R * 2;
    // prologue: steps 0 and 1's metadata loaded (above the wait: the cache), then the first item
    // of the probabilities with step 0's window request (it waits for the metadata), then the
    // probabilities staged
    Mf2Meta<U> m0, m1;
    int p0 = 0;
    if (n > 0) meta(m0, 0);
    if (n > 1) meta(m1, 1);
    MfProbs pr;
    if (MF_VEARLY == 1) {
        if (n > 0) p0 = mf2_issue<BITS, U>(m0, data, win, lane);
        mf_commit();
    }
    pdl_wait();  // before the probabilities (the kernel before the zero kernel may write them) and the output
    if (MF_VTRIG == 2) pdl_launch_dependents();
    mf_probs_begin<U>(pr, x, b, R, row0, nr, S, u0);
    if (MF_VEARLY != 1) {
        if (n > 0) p0 = mf2_issue<BITS, U>(m0, data, win, lane);
        mf_commit();
    }

    mf_probs_stage<U>(pr, x, ps, b, R, row0, nr, S, u0);

    int pcur = p0;
    for (int i = 0; i < n; ++i) {  // as in mf2_key
        Mf2Meta<U> cur;
        int pnext = 0;
        uint8_t *nb = win + ((i + 1) & 1) * (MF_PAD + MF_WIN2);
        if ((i & 1) == 0) {
            cur = m0;
            if (i + 2 < n) meta(m0, i + 2);
            if (i + 1 < n) pnext = mf2_issue<BITS, U>(m1, data, nb, lane);
        } else {
            cur = m1;
            if (i + 2 < n) meta(m1, i + 2);
            if (i + 1 < n) pnext = mf2_issue<BITS, U>(m0, data, nb, lane);
        }
        mf_commit();
        mf_wait1();
        __syncwarp();
        const float sc = MF_OSC ? __ldg(osc + (size_t)b * MF_D + chan(i)) : 1.0f;  // (loaded before the walk: its latency hidden)
        float v[MF_R];
#pragma unroll
        for (int j = 0; j < MF_R; ++j) v[j] = 0.0f;
        mf2_walk<BITS, COMPACT, U, !MF_VMASK>(cur, pcur, win + (i & 1) * (MF_PAD + MF_WIN2), xw0, 32 * MF_R * 2, NCOL * MF_R * 2,
                                             v);
        __syncwarp();
        mf_value_sum_store(v, lane, nr, o, chan(i), sc);
        pcur = pnext;
    }
}


// =============================================================================================
// version 3 (MF_V3 = 1; qgemm.kvcache.plan_for uses it for the 4/2-bit layouts and the fp16 keys,
// version 2 above for the fp16 values, where version 3 measured slower): the same work split as
// version 2, with
//   - a lane's words walked two at a time (mf3_pair): slot s takes the next set bit of each word,
//     so every slot has two independent FLO chains and accumulator chains (the kernels are
//     latency-bound at ~6.5 warps per scheduler; ncu, docs/perf/NOTES.md);
//   - the words paired in decreasing popcount order (MF_SORT: the two largest, then the next two):
//     each walk is bounded by the warp's largest word of the rank instead of by the fullest lane
//     of one fixed word; the words' bitmaps and code ends go through shared memory records
//     ([word][lane], conflict-free) so the walk loop stays one copy of code;
//   - the unrolled slots entered by a switch on 32 - kmax (Duff's device: one dispatch per pair
//     of words -- ptxas 13.5 emits a compare tree of up to 6 branches, not a jump table -- and
//     no loop test per slot), the codes read at compile-time bit positions of "virtual" code
//     words whose top 32 - kmax codes are never used; the two words' code words merged with one
//     PRMT so a slot's two codes sit 16 bits apart (one shift and a LOP3 per slot);
//   - plain and fp16 layouts read every lane's tile offsets / counts (no warp scan);
//   - a pipeline that holds only the next-but-one step's metadata in registers: at the start of
//     step i the metadata of step i+1 becomes its window copy, word records (double-buffered) and
//     sort keys (mf3_prep), and step i+2's metadata is loaded.

#ifndef MF_V3
#define MF_V3 1
#endif
#ifndef MF_SORT
#define MF_SORT 1
#endif
#define MF3_CASES32 \
    case 0: w.template slot<0>(acc, acc2); [[fallthrough]]; \
    case 1: w.template slot<1>(acc, acc2); [[fallthrough]]; \
    case 2: w.template slot<2>(acc, acc2); [[fallthrough]]; \
    case 3: w.template slot<3>(acc, acc2); [[fallthrough]]; \
    case 4: w.template slot<4>(acc, acc2); [[fallthrough]]; \
    case 5: w.template slot<5>(acc, acc2); [[fallthrough]]; \
    case 6: w.template slot<6>(acc, acc2); [[fallthrough]]; \
    case 7: w.template slot<7>(acc, acc2); [[fallthrough]]; \
    case 8: w.template slot<8>(acc, acc2); [[fallthrough]]; \
    case 9: w.template slot<9>(acc, acc2); [[fallthrough]]; \
    case 10: w.template slot<10>(acc, acc2); [[fallthrough]]; \
    case 11: w.template slot<11>(acc, acc2); [[fallthrough]]; \
    case 12: w.template slot<12>(acc, acc2); [[fallthrough]]; \
    case 13: w.template slot<13>(acc, acc2); [[fallthrough]]; \
    case 14: w.template slot<14>(acc, acc2); [[fallthrough]]; \
    case 15: w.template slot<15>(acc, acc2); [[fallthrough]]; \
    case 16: w.template slot<16>(acc, acc2); [[fallthrough]]; \
    case 17: w.template slot<17>(acc, acc2); [[fallthrough]]; \
    case 18: w.template slot<18>(acc, acc2); [[fallthrough]]; \
    case 19: w.template slot<19>(acc, acc2); [[fallthrough]]; \
    case 20: w.template slot<20>(acc, acc2); [[fallthrough]]; \
    case 21: w.template slot<21>(acc, acc2); [[fallthrough]]; \
    case 22: w.template slot<22>(acc, acc2); [[fallthrough]]; \
    case 23: w.template slot<23>(acc, acc2); [[fallthrough]]; \
    case 24: w.template slot<24>(acc, acc2); [[fallthrough]]; \
    case 25: w.template slot<25>(acc, acc2); [[fallthrough]]; \
    case 26: w.template slot<26>(acc, acc2); [[fallthrough]]; \
    case 27: w.template slot<27>(acc, acc2); [[fallthrough]]; \
    case 28: w.template slot<28>(acc, acc2); [[fallthrough]]; \
    case 29: w.template slot<29>(acc, acc2); [[fallthrough]]; \
    case 30: w.template slot<30>(acc, acc2); [[fallthrough]]; \
    case 31: w.template slot<31>(acc, acc2); [[fallthrough]]; \
    default: break;

// Two words of a lane walked together: slot s (0..31) takes the next set bit of each (two
// independent FLO chains and accumulator chains: twice the latency hiding of one word per slot),
// entered at slot 32 - kmax, kmax the warp's largest popcount of word A (the lane's larger word
// when sorted). Word X's virtual code s <-> code n_X - 1 + s0 - s, s0 = 32 - kmax; the two
// words' code words are merged so that a slot's two codes sit 16 bits apart (one PRMT per 32-bit
// word of each), A in the low half.
template <int BITS>
struct Mf3Pair {
    static constexpr int NCW = BITS == 16 ? 1 : BITS;       // 32-bit words of 32 virtual codes
    static constexpr int PER = BITS == 16 ? 2 : 32 / BITS;  // codes per 32-bit word
    static constexpr int T = BITS == 16 ? 0 : 10 - BITS;    // code at mantissa bits [T, 10)
    typedef typename MfRow<MF_R>::T XT;
    uint32_t ba, bb, xa, xb;
    int xstride;
    uint32_t wd[2 * NCW];  // [2i]: top halves of code words i of A (low) and B (high); [2i+1]: bottom halves
    __half2 dqm, dqa;      // (A, B) dequantization constants
    uint32_t fm, one, vta, vtb;  // fm, one: mf3_code_consts
    XT rw[2][2];           // [slot & 1][word]
    // fp16: each word's values two per even slot s (MfHalfPairs, virtual value s at vt - 2s), the
    // pair's funnel kept for slot s + 1
    MfHalfPairs hpa, hpb;
    uint32_t fa, fb;

    __device__ __forceinline__ XT gather(uint32_t &bits, uint32_t xrow) {
        const int pos = 31 - __clz(bits);
        bits &= ~__funnelshift_l(0u, 1u, pos);  // 1 << (pos & 31), one SHF: defined for pos = -1 (bit 31, already clear)
        return MfRow<MF_R>::load(xrow + pos * xstride);
    }
    template <int s>
    __device__ __forceinline__ void slot(__half2 (&acc)[MF_R / 2], __half2 (&acc2)[MF_R / 2]) {
        constexpr int c = s & 1;
        if (s < 31) {
            rw[c ^ 1][0] = gather(ba, xa);
            rw[c ^ 1][1] = gather(bb, xb);
        }
        __half2 va, vb;
        if constexpr (BITS == 16) {
            if constexpr ((s & 1) == 0) {
                fa = hpa.pair(s);
                fb = hpb.pair(s);
            }
            va = (s & 1) ? __low2half2(mf_as_h2(fa)) : __high2half2(mf_as_h2(fa));
            vb = (s & 1) ? __low2half2(mf_as_h2(fb)) : __high2half2(mf_as_h2(fb));
        } else {
            constexpr int ci = NCW - 1 - s / PER;          // the 32-bit word of virtual code s
            constexpr int j = s % PER;                     // its code, from the top
            constexpr int X = 16 - BITS * (j % (PER / 2) + 1);
            const uint32_t src = wd[2 * ci + (j < PER / 2 ? 0 : 1)];
            const uint32_t sft = T >= X ? (src << (T >= X ? T - X : 0)) : (src >> (T < X ? X - T : 0));
            const uint32_t h = (sft & fm) | one;           // (A, B) as 1 + q / 2^BITS: one LOP3
            const __half2 vv = __hfma2(mf_as_h2(h), dqm, dqa);
            va = __low2half2(vv);
            vb = __high2half2(vv);
        }
        MfRow<MF_R>::fma(rw[c][0], va, acc);
        MfRow<MF_R>::fma(rw[c][1], vb, acc2);
    }
};

// The code mask of both halves and the pair (1.0, 1.0), as registers the compiler cannot see
// through: as immediates a slot's (codes & mask) | 1.0 costs one instruction more (a LOP3 holds
// one 32-bit immediate: ptxas re-materializes the other constant with an IMAD.MOV per slot, or
// splits the op into two LOP3s); with both in registers it is one LOP3 (17 instead of 18
// instructions per slot of two codes). Made once per kernel, above the step loop, from `zero` (0
// at run time, computed from a kernel argument) and through a shuffle: ptxas folds a shuffle of an
// immediate, and splits a bare (constant | zero) back into an immediate and a register.
template <int BITS, bool OPAQUE>
__device__ __forceinline__ uint2 mf3_code_consts(int zero) {
    constexpr uint32_t FM = BITS == 16 ? 0u : (((1u << BITS) - 1u) << Mf3Pair<BITS>::T) * 0x10001u;
    if (BITS == 16 || !OPAQUE) return make_uint2(FM, 0x3C003C00u);
    return make_uint2(mf_opaque(FM | (uint32_t)zero), mf_opaque(0x3C003C00u | (uint32_t)zero));
}

template <int BITS>
__device__ __forceinline__ void mf3_pair(uint32_t bits_a, uint32_t bits_b, int kmax, uint32_t dq_a, uint32_t dq_b, uint32_t sbuf,
                                         int end_a, int end_b, uint32_t xrow_a, uint32_t xrow_b, int xstride, uint2 cc,
                                         __half2 (&acc)[MF_R / 2], __half2 (&acc2)[MF_R / 2]) {
    typedef Mf3Pair<BITS> W;
    W w;
    w.ba = bits_a;
    w.bb = bits_b;
    w.xa = xrow_a;
    w.xb = xrow_b;
    w.xstride = xstride;
    w.vta = sbuf + 2 * (end_a + 31 - kmax);  // virtual value 0 of each word (fp16)
    w.vtb = sbuf + 2 * (end_b + 31 - kmax);
    w.dqm = w.dqa = __float2half2_rn(0.0f);
    w.fm = w.one = 0u;
    if (BITS == 16) {
        w.wd[0] = w.wd[1] = 0u;
        // the loads before the entry slot s0 = 32 - kmax: s0 even, the previous word (phase 0
        // takes value s0 from it); s0 odd, the word of slot s0 - 1 (value s0 in its funnel's
        // low half). Value s0 is the word's last: neither reads more than 4 bytes above it (the
        // stage is followed by a pad or the records), and slot 30's word is at most 64 bytes
        // below the stage (MF_PAD).
        const int s0 = 32 - kmax;
        w.hpa.init(w.vta);
        w.hpb.init(w.vtb);
        w.hpa.prev = mf_lds32(w.hpa.base - 2 * s0 + ((s0 & 1) ? 2 : 4));
        w.hpb.prev = mf_lds32(w.hpb.base - 2 * s0 + ((s0 & 1) ? 2 : 4));
        w.fa = __funnelshift_r(w.hpa.prev, w.hpa.prev, w.hpa.sh);
        w.fb = __funnelshift_r(w.hpb.prev, w.hpb.prev, w.hpb.sh);
    }
    if (BITS != 16) {
        const int ea = end_a - kmax * BITS, eb = end_b - kmax * BITS;  // bit of virtual code 31's start
        const uint32_t pa = sbuf + 4 * (ea >> 5), pb = sbuf + 4 * (eb >> 5);
        const int sa = ea & 31, sb = eb & 31;
        uint32_t la = mf_lds32(pa), lb = mf_lds32(pb);
#pragma unroll
        for (int i = 0; i < W::NCW; ++i) {
            if (i == 0 || kmax > i * W::PER) {             // only the words of slots >= 32 - kmax
                const uint32_t ha = mf_lds32(pa + 4 * (i + 1)), hb = mf_lds32(pb + 4 * (i + 1));
                const uint32_t ca = __funnelshift_r(la, ha, sa), cb = __funnelshift_r(lb, hb, sb);
                la = ha;
                lb = hb;
                w.wd[2 * i] = __byte_perm(ca, cb, 0x7632);
                w.wd[2 * i + 1] = __byte_perm(ca, cb, 0x5410);
            }
        }
        w.dqm = mf_as_h2(__byte_perm(dq_a, dq_b, 0x5410));
        w.dqa = mf_as_h2(__byte_perm(dq_a, dq_b, 0x7632));
        w.fm = cc.x;
        w.one = cc.y;
    }
    if (kmax & 1) {  // s0 odd (gathered straight into the entry slot's set)
        w.rw[1][0] = w.gather(w.ba, w.xa);
        w.rw[1][1] = w.gather(w.bb, w.xb);
    } else {
        w.rw[0][0] = w.gather(w.ba, w.xa);
        w.rw[0][1] = w.gather(w.bb, w.xb);
    }
    switch (32 - kmax) { MF3_CASES32 }  // kmax in 1..32
}

// sorting networks (descending) on the packed word keys (popcount << 3 | word)
template <int NW>
__device__ __forceinline__ void mf3_sort(int (&k)[NW]) {
    auto cs = [&](int a, int b) {
        const int hi = max(k[a], k[b]), lo = min(k[a], k[b]);
        k[a] = hi;
        k[b] = lo;
    };
    if (NW == 2) {
        cs(0, 1);
    } else if (NW == 4) {
        cs(0, 1); cs(2, 3); cs(0, 2); cs(1, 3); cs(1, 2);
    } else if (NW == 8) {
        cs(0, 1); cs(2, 3); cs(4, 5); cs(6, 7); cs(0, 2); cs(1, 3); cs(4, 6); cs(5, 7); cs(1, 2); cs(5, 6);
        cs(0, 4); cs(3, 7); cs(1, 5); cs(2, 6); cs(1, 4); cs(3, 6); cs(2, 4); cs(3, 5); cs(3, 4);
    }
}

template <int U>
struct Mf3Meta {
    uint32_t w[2 * U];  // bitmap words of the lane's U tiles (0: no tile)
    uint32_t dq[U];     // plain: scale bits; compact: dq half2 bits; fp16: unused
    float zero[U];      // plain: zero points
    int off[U];         // plain: byte offsets, fp16: value indices of the tiles; compact: unused
    int base;           // compact: the group offset of the step's first tile (the same for all lanes)
};

// metadata of a lane's U tiles from flat tile index t (tiles t .. t+U-1; the first nt valid);
// oi: plain / fp16 index of tile t in offs; gi: compact group-offset index of the step.
// VEC: 16-byte vector loads (keys: t a multiple of U, all U tiles valid or none).
template <int BITS, bool COMPACT, int U, bool VEC>
__device__ __forceinline__ void mf3_load(Mf3Meta<U> &m, const uint32_t *__restrict__ bmp, const int *__restrict__ offs,
                                         const void *__restrict__ scl, const float *__restrict__ zer, size_t t, int nt,
                                         size_t oi, size_t gi) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
        m.w[2 * j] = m.w[2 * j + 1] = 0u;
        m.dq[j] = 0u;
        m.zero[j] = 0.0f;
        m.off[j] = 0;
    }
    const uint32_t *sp = reinterpret_cast<const uint32_t *>(scl) + t;
    const uint32_t *zp = reinterpret_cast<const uint32_t *>(zer) + t;
    if (VEC && U > 1) {
        if (nt > 0) {
            mf_load_bitmap_pairs<U>(m.w, bmp, t);
            if (BITS != 16) {
                mf_load_scale_zero_vec<U, COMPACT>(m.dq, m.zero, sp, zp);
                if (!COMPACT) {
                    if (U == 2) {
                        const int2 o = __ldg(reinterpret_cast<const int2 *>(offs + oi));
                        m.off[0] = o.x;
                        m.off[1] = o.y;
                    } else {
                        const int4 o = __ldg(reinterpret_cast<const int4 *>(offs + oi));
                        m.off[0] = o.x;
                        m.off[1] = o.y;
                        m.off[2 % U] = o.z;
                        m.off[3 % U] = o.w;
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < U; ++j) m.off[j] = __ldg(offs + oi + j);  // counts [B, T+1]: no alignment
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < U; ++j) {
            if (j < nt) {
                const uint2 v = __ldg(reinterpret_cast<const uint2 *>(bmp) + t + j);
                m.w[2 * j] = v.x;
                m.w[2 * j + 1] = v.y;
                if (BITS != 16) {
                    m.dq[j] = __ldg(sp + j);
                    if (!COMPACT) m.zero[j] = __uint_as_float(__ldg(zp + j));
                }
                if (BITS == 16 || !COMPACT) m.off[j] = __ldg(offs + oi + j);
            }
        }
    }
    m.base = COMPACT ? __ldg(offs + gi) : 0;
}

// Sort keys: popcount << 3 | word, 16 bits each, two per register (in walk order)
template <int NW>
struct MfKeys {
    static constexpr int NK = NW / 2;
    uint32_t k[NK];
};

// Everything of a step that can be done as soon as its metadata is in registers: the window copy
// (cp.async into buf), the per-tile dequantization constants, the word records (bitmap word, end
// of its codes / values in the window) into rec (the lane's first record of this step's buffer,
// [word][lane]), and the words' walk order (sorted by popcount, MF_SORT). After it the metadata
// registers are free for the step after.
template <int BITS, bool COMPACT, int U>
__device__ __forceinline__ void mf3_prep(const Mf3Meta<U> &m, int nt, const uint8_t *__restrict__ data, uint8_t *buf, int lane,
                                         uint2 *rec, uint32_t (&dq)[U], MfKeys<2 * U> &keys) {
    constexpr int NW = 2 * U;
    constexpr int SC = BITS == 16 ? 2 : 1;  // bytes per unit
    int units[U];
#pragma unroll
    for (int j = 0; j < U; ++j) units[j] = mf2_units<BITS>(__popc(m.w[2 * j]) + __popc(m.w[2 * j + 1]));
    int start, end, pos[U];  // in units
    if (COMPACT) {
        int tot = 0;
#pragma unroll
        for (int j = 0; j < U; ++j) tot += units[j];
        int incl = tot;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(MF_FULL, incl, o);
            if (lane >= o) incl += y;
        }
        start = m.base;
        end = m.base + __shfl_sync(MF_FULL, incl, 31);
        int p = m.base + incl - tot;
#pragma unroll
        for (int j = 0; j < U; ++j) {
            pos[j] = p;
            p += units[j];
        }
    } else {
        start = __shfl_sync(MF_FULL, m.off[0], 0);  // lane 0's first tile is the step's first
        int e = 0;
#pragma unroll
        for (int j = 0; j < U; ++j) {
            e = max(e, m.off[j] + units[j]);  // (absent tiles: 0 + 0)
            pos[j] = m.off[j];
        }
        end = mf_warp_max(e);
    }
    const int a = (start * SC) & ~15;
    const int nchunk = min((end * SC - a + 15) >> 4, MF_WIN2 / 16);
    for (int c = lane; c < nchunk; c += 32) mf_cp16(buf + 16 * c, data + a + 16 * c);
#pragma unroll
    for (int j = 0; j < U; ++j) {
        dq[j] = (BITS != 16 && !COMPACT) ? mf_dq_pack<BITS>(__uint_as_float(m.dq[j]), m.zero[j]) : m.dq[j];
    }
    int key[NW];
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        const int j = w / 2;
        const int nw = __popc(m.w[w]);
        // position of the word's first code / value in the window (units -> bits for codes)
        int e = j < nt ? (BITS == 16 ? pos[j] - a / SC : 8 * (pos[j] - a)) : 0;
        if (w & 1) e += BITS == 16 ? __popc(m.w[w - 1]) : __popc(m.w[w - 1]) * BITS;
        e += BITS == 16 ? nw : nw * BITS;                 // just past its last one
        rec[w * 32] = make_uint2(m.w[w], (uint32_t)e);
        key[w] = (nw << 3) | w;
    }
    if (MF_SORT) mf3_sort<NW>(key);
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) keys.k[i] = (uint32_t)key[2 * i] | ((uint32_t)key[2 * i + 1] << 16);
}

// The lane's words of a step in key order: acc[r] += sum over their non-zeros of value * X[pos][r].
// Word w's X rows start at xw0 + w * xwstep (its row -1 is zeros), position rows xstride bytes
// apart; srec: the shared address of the lane's first record in the step's buffer.
template <int BITS, int U>
__device__ __forceinline__ void mf3_walk(MfKeys<2 * U> keys, const uint32_t (&dq)[U], uint32_t sbuf, uint32_t srec,
                                         uint32_t xw0, int xwstep, int xstride, uint2 cc, float (&acc)[MF_R]) {
    constexpr int NW = 2 * U;
    auto tile_dq = [&](int idx) {  // the word's tile (bit tests: a chain of == made ptxas index a local array)
        uint32_t d = dq[0];
        if (U == 2) d = (idx & 2) ? dq[1 % U] : dq[0];
        if (U == 4) d = (idx & 4) ? ((idx & 2) ? dq[3 % U] : dq[2 % U]) : ((idx & 2) ? dq[1 % U] : dq[0]);
        return d;
    };
    auto add = [&](const __half2 (&h)[MF_R / 2]) {
#pragma unroll
        for (int i = 0; i < MF_R / 2; ++i) {
            const float2 f = __half22float2(h[i]);
            acc[2 * i] += f.x;
            acc[2 * i + 1] += f.y;
        }
    };
    // one copy of the walk: a rolled loop over the pairs of words (the two largest, then the next
    // two), the keys shifted down after each
#pragma unroll 1
    for (int j = 0; j < NW / 2; ++j) {
        const uint32_t k = keys.k[0];
        const int ka = k & 0xffff, kb = k >> 16;
        const int kmax = mf_warp_max(MF_SORT ? ka : max(ka, kb)) >> 3;
        if (kmax > 0) {
            const int ia = ka & 7, ib = kb & 7;
            const uint2 ra = mf_lds64(srec + ia * 256), rb = mf_lds64(srec + ib * 256);
            __half2 ha[MF_R / 2], hb[MF_R / 2];
#pragma unroll
            for (int i = 0; i < MF_R / 2; ++i) ha[i] = hb[i] = __float2half2_rn(0.0f);
            mf3_pair<BITS>(ra.x, rb.x, kmax, tile_dq(ia), tile_dq(ib), sbuf, (int)ra.y, (int)rb.y, xw0 + ia * xwstep,
                           xw0 + ib * xwstep, xstride, cc, ha, hb);
            add(ha);
            add(hb);
        }
#pragma unroll
        for (int i = 0; i + 1 < NW / 2; ++i) keys.k[i] = keys.k[i + 1];
    }
}

// The per-warp pipeline of both kernels. Step i: its metadata was loaded into registers during
// step i-2 and consumed by mf3_prep at the start of step i-1 (window copy issued, records written
// to buffer i & 1, keys / dq kept); so at the start of step i the metadata of step i+1 (loaded during
// step i-1) is prepped, the metadata of step i+2 is loaded (the only registers in flight), then
// step i's window is awaited and walked. In the prologue step 0 is prepped (its window requested
// before anything of step 1: prepping steps 0 and 1 together measured 2 us slower on keys).
// Per warp: [pad | window 0 | pad | window 1 | records 0 | records 1], MF3_WARP_BYTES.
#define MF3_WARP_BYTES(NW) (2 * (MF_PAD + MF_WIN2) + 2 * (NW) * 32 * 8)

// ---------------------------------------------------------------------------------------------
// key kernel v3 (layout and grid as version 2)

template <int BITS, bool COMPACT>
__device__ __forceinline__ void mf3_key(MF_PARAMS) {
    constexpr int U = MF_D / 64;
    constexpr int NW = 2 * U;
    constexpr int BLK = 33 * MF_REP * MF_R * 2;  // bytes of one 32-dim block of query rows
    extern __shared__ __align__(16) uint8_t mf_smem[];
    uint8_t *xs = mf_smem;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint8_t *wb = mf_smem + MF_XS_BYTES + warp * MF3_WARP_BYTES(NW);
    uint8_t *win0 = wb + MF_PAD, *win1 = wb + 2 * MF_PAD + MF_WIN2;
    uint2 *rec0 = reinterpret_cast<uint2 *>(wb + 2 * (MF_PAD + MF_WIN2)) + lane, *rec1 = rec0 + NW * 32;
    const uint32_t swin0 = (uint32_t)__cvta_generic_to_shared(win0), swin1 = swin0 + MF_PAD + MF_WIN2;
    const uint32_t srec0 = (uint32_t)__cvta_generic_to_shared(rec0), srec1 = srec0 + NW * 256;

    const MfKeyCta<BITS, COMPACT, U> c(S, R, per_cta, warp);
    const int b = c.b, row0 = c.row0, nr = c.nr, cs = c.cs, n = c.n;
    const size_t tb = c.tb, ob = c.ob;

    auto tok = [&](int i) { return (cs + warp + i * MF_WARPS) * 32 + lane; };
    auto meta = [&](Mf3Meta<U> &m, int i) {
        const int s = tok(i);
        const int t0 = (s - lane) * U;
        mf3_load<BITS, COMPACT, U, true>(m, bmp, offs, scl, zer, tb + (size_t)s * U, s < S ? U : 0, ob + (size_t)s * U,
                                         ob + t0 / 16);
    };

    // prologue: above the wait (MF_KEARLY), step 0's metadata loaded, its window requested, then
    // step 1's metadata loaded (the window first: the first walk waits for it alone); after the
    // wait the queries, staged while those are in flight
    if (MF_KTRIG == 2) pdl_launch_dependents();
    mf_zero_pads(wb, lane);
    Mf3Meta<U> m;
    uint32_t dq[U], dqn[U];
    MfKeys<NW> keys, keysn;
    if (n > 0) meta(m, 0);
    if (MF_KEARLY) {
        if (n > 0) mf3_prep<BITS, COMPACT, U>(m, tok(0) < S ? U : 0, data, win0, lane, rec0, dq, keys);
        mf_commit();
        if (MF_KEARLY == 2 && n > 1) meta(m, 1);
    }
    pdl_wait();  // before the queries (the previous kernel may write them) and the scores
    if (MF_KTRIG == 1) pdl_launch_dependents();
    constexpr int ND = (MF_D + MF_THREADS - 1) / MF_THREADS;
    uint32_t hq[ND][MF_R / 2];  // this thread's dims of the row block's queries, row pairs as half2
#pragma unroll
    for (int k = 0; k < ND; ++k) {
        const int d = threadIdx.x + k * MF_THREADS;
#pragma unroll
        for (int j = 0; j < MF_R / 2; ++j) {
            const bool ok = d < MF_D;
            const __half h0 = ok && 2 * j < nr ? x[((size_t)b * R + row0 + 2 * j) * MF_D + d] : __float2half_rn(0.0f);
            const __half h1 = ok && 2 * j + 1 < nr ? x[((size_t)b * R + row0 + 2 * j + 1) * MF_D + d] : __float2half_rn(0.0f);
            const __half2 h = __halves2half2(h0, h1);
            hq[k][j] = *reinterpret_cast<const uint32_t *>(&h);
        }
    }
    if (!MF_KEARLY) {
        if (n > 0) mf3_prep<BITS, COMPACT, U>(m, tok(0) < S ? U : 0, data, win0, lane, rec0, dq, keys);
        mf_commit();
    }
    if (MF_KEARLY != 2 && n > 1) meta(m, 1);

    // queries of this row block, REP interleaved copies; row 0 of each block of 32 dims is zeros
#pragma unroll
    for (int k = 0; k < ND; ++k) {
        const int d = threadIdx.x + k * MF_THREADS;
        if (d < MF_D) {
            mf_store_query_copies(xs + (size_t)(((d >> 5) * 33 + 1 + (d & 31)) * MF_REP) * MF_R * 2, hq[k], lane);
        }
    }
    for (int i = threadIdx.x; i < (MF_D / 32) * MF_REP * MF_R / 4; i += MF_THREADS) {
        const int blk = i / (MF_REP * MF_R / 4), k = i % (MF_REP * MF_R / 4);
        *reinterpret_cast<uint2 *>(xs + (size_t)blk * 33 * MF_REP * MF_R * 2 + k * 8) = make_uint2(0u, 0u);
    }
    __syncthreads();

    __half *scores = reinterpret_cast<__half *>(out) + ((size_t)b * R + row0) * S;
    const uint32_t xw0 = mf_opaque((uint32_t)__cvta_generic_to_shared(xs) + (MF_REP + (lane % MF_REP)) * MF_R * 2);
    // per_cta < 2^27, so per_cta >> 30 is 0 at run time, unknown to ptxas
    const uint2 cc = mf3_code_consts<BITS, MF_CREG == 1 || (MF_CREG == -1 && BITS == 2)>(per_cta >> 30);
    for (int i = 0; i < n; ++i) {
        if (i + 1 < n)
            mf3_prep<BITS, COMPACT, U>(m, tok(i + 1) < S ? U : 0, data, (i & 1) ? win0 : win1, lane, (i & 1) ? rec0 : rec1, dqn,
                                       keysn);
        mf_commit();
        if (i + 2 < n) meta(m, i + 2);
        // wait_group 1: this step's window (the older group) has landed, the next one's may stay
        // in flight; it covers only this lane's own copies and lanes read bytes other lanes
        // copied, hence the __syncwarp. The one after the walk: the next iteration copies into
        // the stage just walked, which no lane may start while another still reads it
        mf_wait1();
        __syncwarp();
        float acc[MF_R];
#pragma unroll
        for (int j = 0; j < MF_R; ++j) acc[j] = 0.0f;
        mf3_walk<BITS, U>(keys, dq, mf_opaque((i & 1) ? swin1 : swin0), mf_opaque((i & 1) ? srec1 : srec0), xw0, BLK,
                          MF_REP * MF_R * 2, cc, acc);
        __syncwarp();
        const int s = tok(i);
        if (s < S) {  // a pointer bumped by a row (64-bit row index math per row cost ~8 instructions)
            __half *p = scores + s;
#pragma unroll
            for (int r = 0; r < MF_R; ++r, p += S) {
                if (r < nr) *p = __float2half_rn(acc[r]);
            }
        }
#pragma unroll
        for (int j = 0; j < U; ++j) dq[j] = dqn[j];
        keys = keysn;
    }
}

// ---------------------------------------------------------------------------------------------
// value kernel v3: as version 2, one tile per lane (a lane past the end of the channel has none)

template <int BITS, bool COMPACT>
__device__ __forceinline__ void mf3_value(MF_PARAMS) {
    if (MF_VTRIG == 1) pdl_launch_dependents();
    constexpr int U = MF_VALUE_U;
    constexpr int NW = 2 * U;
    constexpr int NCOL = 64 * U;              // half-tiles of a step
    extern __shared__ __align__(16) uint8_t mf_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint8_t *ps = mf_smem;                    // [33 positions][NCOL][MF_R] halfs; row 0 zeros
    uint8_t *wb = mf_smem + 33 * NCOL * MF_R * 2 + warp * MF3_WARP_BYTES(NW);
    uint8_t *win0 = wb + MF_PAD, *win1 = wb + 2 * MF_PAD + MF_WIN2;
    uint2 *rec0 = reinterpret_cast<uint2 *>(wb + 2 * (MF_PAD + MF_WIN2)) + lane, *rec1 = rec0 + NW * 32;
    const uint32_t swin0 = (uint32_t)__cvta_generic_to_shared(win0), swin1 = swin0 + MF_PAD + MF_WIN2;
    const uint32_t srec0 = (uint32_t)__cvta_generic_to_shared(rec0), srec1 = srec0 + NW * 256;

    const MfValueCta<BITS, COMPACT, U> c(S, R, per_cta);
    const int b = c.b, row0 = c.row0, cg = c.cg, nr = c.nr, nst = c.nst, u0 = c.u0, gpr = c.gpr, n = c.n;
    const size_t tb = c.tb, ob = c.ob;
    const int ul = u0 + lane * U;            // the lane's first tile in each channel
    const int nt = max(0, min(U, nst - ul));

    auto chan = [&](int i) { return cg * per_cta + warp + i * MF_WARPS; };
    auto meta = [&](Mf3Meta<U> &m, int i) {
        const int d = chan(i);
        const size_t t = (size_t)d * nst + ul;
        mf3_load<BITS, COMPACT, U, U == 1>(m, bmp, offs, scl, zer, tb + t, nt, ob + t, ob + (size_t)d * gpr + (u0 >> 4));
    };

    // prologue: step 0's metadata loaded (above the wait: the cache), the first item of the
    // probabilities, step 0 prepped (its window requested), step 1's metadata loaded, then the
    // probabilities staged
    mf_zero_pads(wb, lane);
    Mf3Meta<U> m;
    uint32_t dq[U], dqn[U];
    MfKeys<NW> keys, keysn;
    MfProbs pr;
    if (n > 0) meta(m, 0);
    Mf3Meta<U> m1;  // MF_VEARLY == 2: step 1's metadata, loaded above the wait and held over it
    if (MF_VEARLY == 2 && n > 1) meta(m1, 1);
    if (MF_VEARLY == 1) {
        if (n > 0) mf3_prep<BITS, COMPACT, U>(m, nt, data, win0, lane, rec0, dq, keys);
        mf_commit();
    }
    pdl_wait();  // before the probabilities (the kernel before the zero kernel may write them) and the output
    if (MF_VTRIG == 2) pdl_launch_dependents();
    mf_probs_begin<U>(pr, x, b, R, row0, nr, S, u0);
    if (MF_VEARLY != 1) {
        if (n > 0) mf3_prep<BITS, COMPACT, U>(m, nt, data, win0, lane, rec0, dq, keys);
        mf_commit();
    }
    if (n > 1) {
        if (MF_VEARLY == 2)
            m = m1;
        else
            meta(m, 1);
    }

    mf_probs_stage<U>(pr, x, ps, b, R, row0, nr, S, u0);

    float *o = reinterpret_cast<float *>(out) + ((size_t)b * R + row0) * MF_D;
    const uint32_t xw0 = mf_opaque((uint32_t)__cvta_generic_to_shared(ps) + (NCOL + lane) * MF_R * 2);
    // as immediates: at the value kernels' 64-register bound ptxas rebuilt opaque ones with two
    // LOP3s anyway (and 3 resident 16-warp CTAs per SM would leave 40 registers)
    const uint2 cc = mf3_code_consts<BITS, false>(0);
    for (int i = 0; i < n; ++i) {  // as in mf3_key
        if (i + 1 < n) mf3_prep<BITS, COMPACT, U>(m, nt, data, (i & 1) ? win0 : win1, lane, (i & 1) ? rec0 : rec1, dqn, keysn);
        mf_commit();
        if (i + 2 < n) meta(m, i + 2);
        mf_wait1();
        __syncwarp();
        const float sc = MF_OSC ? __ldg(osc + (size_t)b * MF_D + chan(i)) : 1.0f;  // (loaded before the walk: its latency hidden)
        float v[MF_R];
#pragma unroll
        for (int j = 0; j < MF_R; ++j) v[j] = 0.0f;
        mf3_walk<BITS, U>(keys, dq, mf_opaque((i & 1) ? swin1 : swin0), mf_opaque((i & 1) ? srec1 : srec0), xw0, 32 * MF_R * 2,
                          NCOL * MF_R * 2, cc, v);
        __syncwarp();
        mf_value_sum_store(v, lane, nr, o, chan(i), sc);
#pragma unroll
        for (int j = 0; j < U; ++j) dq[j] = dqn[j];
        keys = keysn;
    }
}

// =============================================================================================
// version 4 (MF_MMA = 1; 4/2-bit value kernels, sm_80+): the tiles decoded densely in registers
// and multiplied on the tensor cores (mma.sync m16n8k16, fp16 in, fp32 accumulate).
//
// out[r, d] = sum over tiles (d, u) of  mult * sum_s p[r, s] h[s] + add * sum_{s set} p[r, s]
// (value = h * mult + add on the tile's set positions, h = 1 + q / L), so one MMA gives both sums
// when its A rows are, per channel, the dense h (row g) and the dense occupancy (row g + 8):
//   A  [16 x 16 tokens]  row g: 2-bit h, 4-bit q (0 where the bit is clear);
//                        row g + 8: the occupancy, 1 where set (2-bit) or 1024 (4-bit)
//   B  [16 tokens x 8]   the probabilities of query rows 8 nt .. 8 nt + 7
//   C  [16 x 8]          row g: sum p h (2-bit) / sum p q (4-bit); row g + 8: sum p (2-bit) /
//                        1024 sum p (4-bit), for channel g of the warp's eight (the scaling to
//                        mult and add for 4-bit: ch and cs in mf4_value)
// A warp owns 8 channels (lane quad g = lane / 4) and walks their 64-token tiles u = u0 .. u1 - 1;
// lane c = lane % 4 of the quad decodes positions 16c .. 16c + 15 of the tile, four per k step j
// (positions 16c + 4j .. + 3 land in the MMA's k slots 2c, 2c + 1, 2c + 8, 2c + 9: any order of
// the k slots works as long as B is staged in the same one).
// Decoding four positions (one nibble m of the bitmap): the next four codes spread to one byte
// each, then one PRMT per half2 puts code k of the nibble's set bits where the half needs it and
// zero bytes (the sign-replicate selector 0x8 of a byte < 0x80) where the bit is clear; the
// selectors and the code count are a 16-entry table in shared memory (conflict-free: 16 8-byte
// entries, 128 bytes, one bank pair each).
//   2-bit: byte = 0x3C | q, the half's high byte: h = 0x3C00 | q << 8 = 1 + q / 4 exactly
//   4-bit: byte = q, the half's low byte under 0x64: h = 1024 + q; minus the occupancy (1024) = q

#ifndef MF_MMA
#define MF_MMA 0
#endif
#ifndef MF_NT
#define MF_NT 1  // version 4: n tiles (8 query rows each) per CTA
#endif
#define MF4_LUT_BYTES 128
// staged probabilities: [chunk][MF_NT][half h][lane][16 bytes]: lane (g, c) reads tokens
// 16c + 8h .. + 7 of row g with one conflict-free 16-byte load
#define MF4_CHUNK_BYTES (MF_NT * 1024)

// PRMT with its full selector: __byte_perm uses only the low 3 bits of each selector nibble, and
// the decode needs bit 3 (0x8: replicate the sign of byte 0 -- a zero byte where a bit is clear)
__device__ __forceinline__ uint32_t mf4_prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// table entry of nibble mask m: x = selectors of positions 0, 1 | (bits consumed) << 16,
// y = selectors of positions 2, 3
template <int BITS>
__device__ __forceinline__ uint2 mf4_lut_entry(int m) {
    uint32_t sel[2] = {0u, 0u};
    int k = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t lo = 8u, hi = 8u;  // 0x8: sign of byte 0 (< 0x80): a zero byte
        if ((m >> i) & 1) {
            if (BITS == 2) {
                hi = (uint32_t)k;
            } else {
                lo = (uint32_t)k;
                hi = 4u;  // byte 0 of the second operand: 0x64
            }
            ++k;
        }
        sel[i >> 1] |= (lo | hi << 4) << (8 * (i & 1));
    }
    return make_uint2(sel[0] | (uint32_t)(k * BITS) << 16, sel[1]);
}

// the next four codes of X (low bits first), one per byte
template <int BITS>
__device__ __forceinline__ uint32_t mf4_spread(uint32_t x) {
    if (BITS == 2) {
        // even codes (q0, q2) times 1 + 2^12, odd (q1, q3) times 2^6 + 2^18: q_i lands at bit 8i;
        // the copies that overlap (bits 12-14) are masked off
        const uint32_t v = (x & 0x33u) * 0x1001u + (x & 0xCCu) * 0x40040u;
        return (v & 0x03030303u) | 0x3C3C3C3Cu;
    } else {
        const uint32_t y = mf4_prmt(x, 0u, 0x1100u);  // bytes b0 b0 b1 b1
        const uint32_t hi = (y >> 4) & 0x0F0F0F0Fu;
        return (y & 0x000F000Fu) | (hi & 0x0F000F00u);
    }
}

__device__ __forceinline__ void mf4_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// one tile's metadata as the lane needs it
struct Mf4Tile {
    uint32_t w0, w1;  // bitmap
    uint32_t dq;      // plain: scale bits; compact: (mult, add) half2 bits
    float zero;       // plain: zero point
    int off;          // byte offset of the tile's codes
};

// The probabilities of tiles u0 .. u1 - 1, query rows row0 .. row0 + 8 MF_NT - 1 (zeros past R
// and S), staged for the B fragments; the table; one barrier.
template <int BITS>
__device__ __forceinline__ void mf4_stage(const __half *__restrict__ x, uint8_t *smem, int b, int R, int row0, int S,
                                          int u0, int u1) {
    if (threadIdx.x < 16) reinterpret_cast<uint2 *>(smem)[threadIdx.x] = mf4_lut_entry<BITS>(threadIdx.x);
    uint8_t *ps = smem + MF4_LUT_BYTES;
    const int units = (u1 - u0) * MF_NT * 64;
    const bool vec = (S & 7) == 0;
    for (int i = threadIdx.x; i < units; i += MF_THREADS) {
        const int l = i & 31, h = (i >> 5) & 1, nt = (i >> 6) % MF_NT, ci = i / (64 * MF_NT);
        const int row = row0 + nt * 8 + (l >> 2);
        const int tok = (u0 + ci) * 64 + 16 * (l & 3) + 8 * h;
        uint8_t *dst = ps + (size_t)i * 16;  // i enumerates [chunk][nt][h][lane]
        const __half *src = x + ((size_t)b * R + min(row, R - 1)) * S + tok;
        if (row < R && vec && tok + 8 <= S) {
            mf_cp16(dst, src);
        } else {
            __half v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = (row < R && tok + j < S) ? src[j] : __float2half_rn(0.0f);
            *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(v);
        }
    }
    mf_commit();
    mf_wait_all();
    __syncthreads();
}

// grid.x = (tile range, channel block, row block), row block fastest; per_cta = 64-token tiles per CTA
// (a multiple of 16 for the compact layouts: a range starts at a group offset)
template <int BITS, bool COMPACT>
__device__ __forceinline__ void mf4_value(MF_PARAMS) {
    if (MF_VTRIG == 1) pdl_launch_dependents();
    static_assert(BITS == 2 || BITS == 4, "version 4: 4/2-bit layouts");
    extern __shared__ __align__(16) uint8_t mf_smem[];
    constexpr int ROWS = 8 * MF_NT;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int b = blockIdx.y;
    const int rb = (R + ROWS - 1) / ROWS;
    constexpr int NCB = MF_D / (8 * MF_WARPS);  // channel blocks
    static_assert(NCB >= 1 && MF_D % (8 * MF_WARPS) == 0, "version 4: 8 channels per warp");
    const int row0 = (blockIdx.x % rb) * ROWS;
    const int cb = (blockIdx.x / rb) % NCB;
    const int chunk = blockIdx.x / (rb * NCB);
    const int nst = (S + 63) >> 6;  // tiles per channel
    const int u0 = chunk * per_cta, u1 = min(u0 + per_cta, nst);
    const int d = (cb * MF_WARPS + warp) * 8 + g;
    const size_t T = (size_t)MF_D * nst;
    const size_t trow = (size_t)b * T + (size_t)d * nst;  // tile (d, 0) in the flat [B * T] arrays
    const uint32_t *__restrict__ data32 = reinterpret_cast<const uint32_t *>(data);

    pdl_wait();  // before the probabilities (the kernel before the zero kernel may write them) and the output
    if (MF_VTRIG == 2) pdl_launch_dependents();
    mf4_stage<BITS>(x, mf_smem, b, R, row0, S, u0, u1);
    const uint32_t slut = (uint32_t)__cvta_generic_to_shared(mf_smem);
    const uint32_t sps = slut + MF4_LUT_BYTES + lane * 16;

    int run = 0;  // compact: the running byte offset along the channel's row
    if (COMPACT) {
        const int gpr = (nst + 15) >> 4;
        run = __ldg(offs + (size_t)b * (MF_D * gpr + 1) + (size_t)d * gpr + (u0 >> 4));
    }
    // Metadata in blocks of 4 tiles: lane (g, c) loads tile ub + c of channel g (a quad reads 4
    // consecutive tiles: one sector per channel and array instead of one per tile), and every
    // tile's fields reach the quad by shuffles from lane 4g + k.
    auto load_blk = [&](Mf4Tile &t, int ub) {
        const int u = ub + c;
        t.w0 = t.w1 = t.dq = 0u;
        t.zero = 0.0f;
        t.off = 0;
        if (u < u1) {
            const uint2 w = __ldg(reinterpret_cast<const uint2 *>(bmp) + trow + u);
            t.w0 = w.x;
            t.w1 = w.y;
            t.dq = __ldg(reinterpret_cast<const uint32_t *>(scl) + trow + u);
            if (!COMPACT) {
                t.zero = __ldg(zer + trow + u);
                t.off = __ldg(offs + trow + u);
            }
        }
    };
    // compact: the quad's exclusive prefix of the tiles' code bytes after the running offset (run
    // only when the block is first needed: its loads have had a block of MMAs to arrive)
    auto prep_blk = [&](Mf4Tile &t) {
        if (COMPACT) {
            const int bytes = ((__popc(t.w0) + __popc(t.w1)) * BITS + 7) >> 3;
            int incl = bytes;
#pragma unroll
            for (int o = 1; o < 4; o <<= 1) {
                const int y = __shfl_up_sync(MF_FULL, incl, o, 4);
                if (c >= o) incl += y;
            }
            t.off = run + incl - bytes;
            run += __shfl_sync(MF_FULL, incl, 3, 4);
        }
    };
    auto tile_of = [&](const Mf4Tile &blk, int k) {
        const int src = (lane & ~3) | k;
        Mf4Tile t;
        t.w0 = __shfl_sync(MF_FULL, blk.w0, src);
        t.w1 = __shfl_sync(MF_FULL, blk.w1, src);
        t.dq = __shfl_sync(MF_FULL, blk.dq, src);
        t.zero = COMPACT ? 0.0f : __shfl_sync(MF_FULL, blk.zero, src);
        t.off = __shfl_sync(MF_FULL, blk.off, src);
        return t;
    };
    // the lane's 16 positions: their mask, and the code bits from their first code on
    // (the raw words: funnel-shifted only when the tile is decoded, so that their loads stay in
    // flight under the previous tile's MMAs)
    auto codes = [&](const Mf4Tile &t, uint32_t &m16, uint4 &xr) {
        const uint32_t w = c < 2 ? t.w0 : t.w1;
        m16 = (c & 1) ? (w >> 16) : (w & 0xFFFFu);
        // codes before this lane's 16 positions: the set bits of its word's lower half (c odd)
        // plus all of word 0 (c >= 2)
        const int pre = ((c & 1) ? __popc(w & 0xFFFFu) : 0) + (c >= 2 ? __popc(t.w0) : 0);
        const int nb = __popc(m16) * BITS;
        const size_t bit = (size_t)t.off * 8 + pre * BITS;
        const size_t wi = bit >> 5;
        const int sh = (int)(bit & 31);
        const uint32_t x0 = nb > 0 ? __ldg(data32 + wi) : 0u;
        const uint32_t x1 = sh + nb > 32 ? __ldg(data32 + wi + 1) : 0u;
        const uint32_t x2 = (BITS == 4 && sh + nb > 64) ? __ldg(data32 + wi + 2) : 0u;
        xr = make_uint4(x0, x1, x2, (uint32_t)sh);
    };

    float acc[MF_NT][2];
#pragma unroll
    for (int nt = 0; nt < MF_NT; ++nt) acc[nt][0] = acc[nt][1] = 0.0f;
    bool brow[MF_NT];  // B rows past R stay zero without a shared load
#pragma unroll
    for (int nt = 0; nt < MF_NT; ++nt) brow[nt] = row0 + nt * 8 + g < R;

    // blocks: this one and the next in registers; codes one tile ahead of the MMAs
    Mf4Tile bc, bn, tn;
    uint32_t m16 = 0;
    uint4 xr = make_uint4(0u, 0u, 0u, 0u);
    if (u0 < u1) {
        load_blk(bc, u0);
        load_blk(bn, u0 + 4);
        prep_blk(bc);
        tn = tile_of(bc, 0);
        codes(tn, m16, xr);
    }
#pragma unroll 1
    for (int ub = u0; ub < u1; ub += 4) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int u = ub + k;
            if (u >= u1) break;
            const Mf4Tile cur = tn;
            uint32_t m = m16;
            const uint4 xc = xr;
            if (u + 1 < u1) {
                if (k == 3) prep_blk(bn);
                tn = k < 3 ? tile_of(bc, k + 1) : tile_of(bn, 0);
                codes(tn, m16, xr);
            }
            uint32_t xl = __funnelshift_r(xc.x, xc.y, xc.w);
            uint32_t xh = BITS == 4 ? __funnelshift_r(xc.y, xc.z, xc.w) : 0u;
            float cc[MF_NT][4];
#pragma unroll
            for (int nt = 0; nt < MF_NT; ++nt) cc[nt][0] = cc[nt][1] = cc[nt][2] = cc[nt][3] = 0.0f;
            const uint32_t pb = sps + (u - u0) * MF4_CHUNK_BYTES;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                uint4 bf[MF_NT];
#pragma unroll
                for (int nt = 0; nt < MF_NT; ++nt)
                    bf[nt] = brow[nt] ? mf_lds128(pb + (nt * 2 + hh) * 512) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                    const uint2 e = mf_lds64(slut + (m & 15u) * 8);
                    m >>= 4;
                    const uint32_t cbytes = mf4_spread<BITS>(xl);
                    const uint32_t second = BITS == 2 ? cbytes : 0x64646464u;
                    uint32_t h01 = mf4_prmt(cbytes, second, e.x), h23 = mf4_prmt(cbytes, second, e.y);
                    const uint32_t smask = BITS == 2 ? 0x3C003C00u : 0x64006400u;
                    const uint32_t s01 = h01 & smask, s23 = h23 & smask;
                    if (BITS == 4) {
                        const __half2 a = __hsub2(mf_as_h2(h01), mf_as_h2(s01)), bq = __hsub2(mf_as_h2(h23), mf_as_h2(s23));
                        h01 = *reinterpret_cast<const uint32_t *>(&a);
                        h23 = *reinterpret_cast<const uint32_t *>(&bq);
                    }
                    const uint32_t nsh = e.x >> 16;
                    if (BITS == 2) {
                        xl >>= nsh;
                    } else {
                        xl = __funnelshift_r(xl, xh, nsh);
                        xh >>= nsh;
                    }
#pragma unroll
                    for (int nt = 0; nt < MF_NT; ++nt)
                        mf4_mma(cc[nt], h01, s01, h23, s23, jj ? bf[nt].z : bf[nt].x, jj ? bf[nt].w : bf[nt].y);
                }
            }
            // the tile's dequantization constants (compact: stored; plain: made from scale and zero)
            const float2 f = __half22float2(mf_as_h2(COMPACT ? cur.dq : mf_dq_pack<BITS>(__uint_as_float(cur.dq), cur.zero)));
            const float mult = f.x, add = f.y;
            // value = h mult + add. 2-bit: C = (sum p h, sum p) -> ch = mult, cs = add. 4-bit: C =
            // (sum p q, 1024 sum p) and h = 1 + q / 16, so value = q mult / 16 + (mult + add):
            // ch = mult / 16, cs = (mult + add) / 1024
            const float ch = BITS == 2 ? mult : mult * (1.0f / 16.0f);
            const float cs = BITS == 2 ? add : (mult + add) * (1.0f / 1024.0f);
#pragma unroll
            for (int nt = 0; nt < MF_NT; ++nt) {
                acc[nt][0] += ch * cc[nt][0] + cs * cc[nt][2];
                acc[nt][1] += ch * cc[nt][1] + cs * cc[nt][3];
            }
        }
        bc = bn;
        if (ub + 8 < u1) load_blk(bn, ub + 8);
    }
    float *o = reinterpret_cast<float *>(out) + (size_t)b * R * MF_D + d;
    if (u0 < u1) {
        const float sc = MF_OSC ? __ldg(osc + (size_t)b * MF_D + d) : 1.0f;  // the channel's output scale (MF_PARAMS)
#pragma unroll
        for (int nt = 0; nt < MF_NT; ++nt)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = row0 + nt * 8 + 2 * c + i;
                if (r < R) atomicAdd(o + (size_t)r * MF_D, MF_OSC ? acc[nt][i] * sc : acc[nt][i]);
            }
    }
}

#if MF_MMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "MF_MMA=1 (version 4) needs sm_80 or newer (mma.sync m16n8k16)"
#endif

#if MF_V3
#define MF_KEY mf3_key
#define MF_VALUE mf3_value
#else
#define MF_KEY mf2_key
#define MF_VALUE mf2_value
#endif
#if MF_MMA
#undef MF_VALUE
#define MF_VALUE mf4_value
#endif
