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
// the last one down, dequantized two at a time (one IMAD + one HFMA2) and multiplied with the R
// query / probability rows of their positions, gathered from shared memory:
//   keys:   the queries of the row block, REP copies interleaved so the lanes of a half-warp
//           (8-byte rows) or quarter-warp (16-byte rows) never hit the same bank;
//   values: the probabilities of the CTA's chunk, transposed to [pos][word][lane][row] so a
//           lane's reads always fall in its own bank.
// Products accumulate in half2 within a word (<= 32 terms), fp32 across words. Keys store their
// R fp16 scores per lane; values reduce-scatter a channel's R sums over the warp once per step
// and atomicAdd them into the fp32 output (zeroed first).
//
// Compile-time configuration (-D from the launcher, qgemm.kvcache.plan_for):
//   MF_R      query rows per CTA: 4 or 8 (more rows: row blocks)
//   MF_D      head dim (64, 128, 256)
//   MF_REP    copies of the query rows in shared memory (key kernels: 16 for 4 rows, 8 for 8)
//   MF_WARPS  warps per CTA
//   MF_WIN2   bytes of one window stage (sized from the cache's largest step)
#pragma once
#include <cuda_fp16.h>
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

// Shared memory of the key kernel's query copies: [D/32 blocks][33 positions][REP][R] halfs
// (row 0 of every block is zeros, "position -1": lanes that ran out of non-zeros read it).
#define MF_XS_BYTES ((MF_D / 32) * 33 * MF_REP * MF_R * 2)

// Kernel parameters, the same for all ten entries:
//   bmp     bitmaps [B, T] (as pairs of 32-bit words, low word = elements 0..31)
//   offs    fp16: counts [B, T+1] (value index of each tile, then the end)
//           plain 4/2-bit: byte offset of each tile's codes [B, T]
//           compact: byte offset of each group of 16 tiles of a tile row [B, G+1]
//           (only the one of each warp step's first tile is read: the rest are prefix sums of
//           the popcounts, which validate_compressed guarantees)
//   scl     plain: scales [B, T] float; compact: dq [B, T] half2 (mult, add); fp16: unused
//   zer     plain: zeros [B, T] float (zero points in code units); otherwise unused
//   data    packed codes (uint8) or fp16 values; 16-byte aligned and padded to a multiple of 16
//   x       key: queries [B, R, D] half; value: probabilities [B, R, S] half   (R = groups * Lq)
//   out     key: scores [B, R, S] half; value: output [B, R, D] float (accumulated: zero it first)
//   S, R    tokens, query rows per kv head
//   per_cta key: warp steps (32 tokens) per CTA; value: channels per CTA (a multiple of MF_WARPS)
// grid = (chunks * ceil(R / MF_R), B, 1) (keys) or (chunks * D / per_cta * ceil(R / MF_R), B, 1)
// (values), the row block fastest.
#define MF_PARAMS                                                                                          \
    const uint32_t *__restrict__ bmp, const int *__restrict__ offs, const void *__restrict__ scl,          \
        const float *__restrict__ zer, const uint8_t *__restrict__ data, const __half *__restrict__ x,     \
        void *__restrict__ out, int S, int R, int per_cta
#define MF_ARGS bmp, offs, scl, zer, data, x, out, S, R, per_cta

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

__device__ __forceinline__ int mf_warp_max(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_max_sync(MF_FULL, v);
#else
#pragma unroll
    for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(MF_FULL, v, o));
    return v;
#endif
}

__device__ __forceinline__ __half2 mf_as_h2(uint32_t u) { return *reinterpret_cast<__half2 *>(&u); }

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
// The half-tile's sparse dot product: acc[r] += sum over set bits j of word of
//   value(j) * X[j][r]   (X row of position j at xrow0 + j * xstride, R halfs; the row at
//   xrow0 - xstride, "position -1", is zeros: lanes that ran out of non-zeros read it)
// The set bits are walked from the top (FLO, -1 when none is left), so the codes are consumed
// from the last one down; they are read from the window left-aligned (code n-1 at the top of
// c[NCW-1]) and dequantized two at a time into a half2.
template <int BITS>
__device__ __forceinline__ void mf_half_tile(uint32_t word, uint32_t mdq, int lpos, const uint8_t *buf, uint32_t xrow0,
                                             int xstride, __half2 (&acc)[MF_R / 2]) {
    constexpr int NCW = BITS == 16 ? 1 : BITS;  // 32-bit code words of a half-tile: 2 (2-bit), 4 (4-bit)
    constexpr int PER = BITS == 16 ? 1 : 32 / BITS;
    const int n = __popc(word);
    const int kmax = mf_warp_max(n);
    uint32_t c[NCW];
    __half2 dqm, dqa;
    const __half *vlast = reinterpret_cast<const __half *>(buf) + (BITS == 16 ? lpos + n - 1 : 0);
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
            bits &= ~__funnelshift_l(0u, 1u, pos);
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
                va = __half2half2(k0 < n ? vlast[-k0] : __float2half_rn(0.0f));
                vb = __half2half2(k0 + 1 < n ? vlast[-k0 - 1] : __float2half_rn(0.0f));
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
// tiles (keys U = D/64, values U = MF_U):
//   - the per-step work (metadata loads, window bounds, the cp.async of the window) is amortized
//     over 2-4x more non-zeros than half-tile lanes (the first version of these kernels);
//   - keys need no reduction across lanes (a lane holds its token's R scores) and store them
//     coalesced; values reduce a channel's R sums across the warp once per step with a
//     reduce-scatter (log2 R halving exchanges, then a butterfly);
//   - the only offset read per step is the step's first (counts / offsets / group offsets: one
//     broadcast load); a lane's position in the window is an exclusive scan of the tiles' byte
//     counts across the warp (the formats guarantee offsets == prefix sums of the popcounts);
//   - the window stage holds MF_WIN2 bytes, sized by the launcher from the cache's largest step;
//   - rows per CTA MF_R is 4 or 8 (more rows: row blocks, adjacent in the grid so that they read
//     the same compressed bytes from L2).
// The sparse dot product of a word is mf_half_tile.

#ifndef MF_U
#define MF_U 1  // value kernels: tiles per lane
#endif
#ifndef MF_WIN2
#define MF_WIN2 1024  // bytes of one window stage (multiple of 16)
#endif
static_assert(MF_WIN2 % 16 == 0 && MF_WIN2 >= 64, "MF_WIN2 must be a multiple of 16");

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
#pragma unroll
            for (int j = 0; j < U / 2; ++j) {
                const uint4 v = __ldg(reinterpret_cast<const uint4 *>(bmp) + t / 2 + j);
                m.w[4 * j + 0] = v.x;
                m.w[4 * j + 1] = v.y;
                m.w[4 * j + 2] = v.z;
                m.w[4 * j + 3] = v.w;
            }
        }
        if (BITS != 16) {
            const uint32_t *sp = reinterpret_cast<const uint32_t *>(scl) + t;
            const uint32_t *zp = reinterpret_cast<const uint32_t *>(zer) + t;
            if (U == 1) {
                m.dq[0] = __ldg(sp);
                if (!COMPACT) m.zero[0] = __uint_as_float(__ldg(zp));
            } else if (U == 2) {
                const uint2 v = __ldg(reinterpret_cast<const uint2 *>(sp));
                m.dq[0] = v.x;
                m.dq[1] = v.y;
                if (!COMPACT) {
                    const uint2 z = __ldg(reinterpret_cast<const uint2 *>(zp));
                    m.zero[0] = __uint_as_float(z.x);
                    m.zero[1] = __uint_as_float(z.y);
                }
            } else {
                const uint4 v = __ldg(reinterpret_cast<const uint4 *>(sp));
                m.dq[0] = v.x;
                m.dq[1] = v.y;
                m.dq[2] = v.z;
                m.dq[3] = v.w;
                if (!COMPACT) {
                    const uint4 z = __ldg(reinterpret_cast<const uint4 *>(zp));
                    m.zero[0] = __uint_as_float(z.x);
                    m.zero[1] = __uint_as_float(z.y);
                    m.zero[2] = __uint_as_float(z.z);
                    m.zero[3] = __uint_as_float(z.w);
                }
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
    const int a = start & ~15;
    const int nchunk = min((end - a + 15) >> 4, MF_WIN2 / 16);
    for (int c = lane; c < nchunk; c += 32) mf_cp16(buf + 16 * c, data + a + 16 * c);
    return (start - a) / SC + incl - units;
}

// The lane's U tiles: acc[r] += sum over their non-zeros of value * X[pos][r]. Word j's X rows
// start at xw0 + j * xwstep (its row -1 is zeros), position rows xstride bytes apart.
template <int BITS, bool COMPACT, int U>
__device__ __forceinline__ void mf2_walk(Mf2Meta<U> m, int first, const uint8_t *buf, uint32_t xw0, int xwstep,
                                         int xstride, float (&acc)[MF_R]) {
    // half2 sums within a word (<= 32 products), fp32 across words (a token's up to 256 products
    // summed in half2 miss the dense-tile accuracy)
    auto word = [&](uint32_t w, uint32_t dq, int lpos, uint32_t xa) {
        __half2 h[MF_R / 2];
#pragma unroll
        for (int j = 0; j < MF_R / 2; ++j) h[j] = __float2half2_rn(0.0f);
        mf_half_tile<BITS>(w, dq, lpos, buf, xa, xstride, h);
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
        if (BITS != 16 && !COMPACT) {  // the fp16 constants, exactly as qgemm.kvcache.dequant_constants
            const float s = __uint_as_float(dq);
            const float mult = s * (float)(1 << BITS);
            const float add = __fsub_rn(__fmul_rn(-m.zero[0], s), mult);
            const __half2 h = __halves2half2(__float2half_rn(mult), __float2half_rn(add));
            dq = *reinterpret_cast<const uint32_t *>(&h);
        }
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

    const int b = blockIdx.y;
    const int rb = (R + MF_R - 1) / MF_R;
    const int row0 = (blockIdx.x % rb) * MF_R;
    const int nr = min(MF_R, R - row0);
    const int T = S * U;
    const int steps_b = (S + 31) >> 5;
    const int cs = (blockIdx.x / rb) * per_cta;
    const int ce = min(cs + per_cta, steps_b);
    const int n = cs + warp < ce ? (ce - cs - warp + MF_WARPS - 1) / MF_WARPS : 0;
    const size_t tb = (size_t)b * T;
    const size_t ob = BITS == 16 ? (size_t)b * (T + 1) : (COMPACT ? (size_t)b * ((T + 15) / 16 + 1) : tb);

    auto meta = [&](Mf2Meta<U> &m, int i) {
        const int st = cs + warp + i * MF_WARPS;
        const int s = st * 32 + lane;
        const int t0 = st * 32 * U;
        mf2_load<BITS, COMPACT, U>(m, bmp, offs, scl, zer, tb + (size_t)s * U, s < S, ob + (COMPACT ? t0 / 16 : t0));
    };

    Mf2Meta<U> m0, m1;
    int p0 = 0;
    if (n > 0) meta(m0, 0);
    if (n > 1) meta(m1, 1);
    if (n > 0) p0 = mf2_issue<BITS, U>(m0, data, win, lane);
    mf_commit();

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
        uint8_t *dst = xs + (size_t)(((d >> 5) * 33 + 1 + (d & 31)) * MF_REP) * MF_R * 2;
#pragma unroll
        for (int rep = 0; rep < MF_REP; ++rep) {
            if (MF_R == 4) *reinterpret_cast<uint2 *>(dst + rep * 8) = make_uint2(hw[0], hw[1]);
            else *reinterpret_cast<uint4 *>(dst + rep * 16) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
        }
    }
    for (int i = threadIdx.x; i < (MF_D / 32) * MF_REP * MF_R / 4; i += MF_THREADS) {  // the zero rows, 8 bytes at a time
        const int blk = i / (MF_REP * MF_R / 4), k = i % (MF_REP * MF_R / 4);
        *reinterpret_cast<uint2 *>(xs + (size_t)blk * 33 * MF_REP * MF_R * 2 + k * 8) = make_uint2(0u, 0u);
    }
    __syncthreads();

    __half *scores = reinterpret_cast<__half *>(out) + ((size_t)b * R + row0) * S;
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
// value kernel v2: a lane = MF_U consecutive tiles of one channel (64 tokens each); a warp step =
// 32 * MF_U tiles of one channel. A CTA takes a chunk of 32 * MF_U tiles (2048 * MF_U tokens) for
// per_cta channels; its warps take the channels round-robin, one step each.
// grid = (chunks * channel groups * row blocks, B, 1), row block fastest, then channel group.

template <int BITS, bool COMPACT>
__device__ __forceinline__ void mf2_value(MF_PARAMS) {
    static_assert(MF_R == 4 || MF_R == 8, "version 2: MF_R must be 4 or 8");
    static_assert(MF_U == 1, "version 2 value kernels: one tile per lane (a lane's tiles must all be inside the channel)");
    constexpr int U = MF_U;
    constexpr int NCOL = 64 * U;              // half-tiles of a step
    constexpr int LR = MF_R == 4 ? 2 : 3;     // log2 MF_R
    extern __shared__ __align__(16) uint8_t mf_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint8_t *ps = mf_smem;                    // [33 positions][NCOL][MF_R] halfs; row 0 zeros
    uint8_t *win = mf_smem + 33 * NCOL * MF_R * 2 + warp * 2 * MF_WIN2;

    const int b = blockIdx.y;
    const int rb = (R + MF_R - 1) / MF_R;
    const int ncg = MF_D / per_cta;
    const int row0 = (blockIdx.x % rb) * MF_R;
    const int cg = (blockIdx.x / rb) % ncg;
    const int chunk = blockIdx.x / (rb * ncg);
    const int nr = min(MF_R, R - row0);
    const int nst = (S + 63) >> 6;           // tiles per channel
    const int T = MF_D * nst;
    const int u0 = chunk * 32 * U;           // first tile of the chunk (of each channel)
    const int gpr = (nst + 15) >> 4;         // compact groups per channel
    const int n = per_cta / MF_WARPS;        // this warp's steps (channels)
    const size_t tb = (size_t)b * T;
    const size_t ob = BITS == 16 ? (size_t)b * (T + 1) : (COMPACT ? (size_t)b * (MF_D * gpr + 1) : tb);

    auto chan = [&](int i) { return cg * per_cta + warp + i * MF_WARPS; };
    auto meta = [&](Mf2Meta<U> &m, int i) {
        const int d = chan(i);
        const int u = u0 + lane * U;
        const int t0 = d * nst + u0;
        mf2_load<BITS, COMPACT, U>(m, bmp, offs, scl, zer, tb + (size_t)d * nst + u, u < nst,
                                   ob + (COMPACT ? (size_t)d * gpr + (u0 >> 4) : (size_t)t0));
    };

    Mf2Meta<U> m0, m1;
    int p0 = 0;
    if (n > 0) meta(m0, 0);
    if (n > 1) meta(m1, 1);
    if (n > 0) p0 = mf2_issue<BITS, U>(m0, data, win, lane);
    mf_commit();

    // probabilities of the chunk: token 64 * (u0 + U * l + j) + 32 h + pos -> ps[1 + pos][(2 j + h) * 32 + l][r]
    const int s0 = u0 * 64;
    constexpr int G8 = 2048 * U / 8;         // 8-token groups of the chunk
    const bool vec = (S & 7) == 0;
    __half *dst = reinterpret_cast<__half *>(ps);
    constexpr int NB = 4;  // loads in flight per thread before their stores
    for (int i0 = threadIdx.x; i0 < MF_R * G8; i0 += NB * MF_THREADS) {
        uint4 u[NB];
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const int i = i0 + k * MF_THREADS;
            const int r = i / G8, g = i % G8;
            const int s = s0 + 8 * g;
            const __half *src = x + ((size_t)b * R + row0 + min(r, nr - 1)) * S;
            if (i < MF_R * G8 && r < nr && vec && s + 8 <= S) {
                u[k] = __ldg(reinterpret_cast<const uint4 *>(src + s));
            } else {
                __half h[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) h[j] = (i < MF_R * G8 && r < nr && s + j < S) ? src[s + j] : __float2half_rn(0.0f);
                u[k] = *reinterpret_cast<const uint4 *>(h);
            }
        }
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const int i = i0 + k * MF_THREADS;
            if (i >= MF_R * G8) break;
            const int r = i / G8, g = i % G8;
            const __half *hv = reinterpret_cast<const __half *>(&u[k]);
            const int o = 8 * g;                 // token offset in the chunk
            const int tl = o >> 6;               // tile of the chunk: lane tl / U, its tile j = tl % U
            const int col = (2 * (tl % U) + ((o >> 5) & 1)) * 32 + tl / U;
            const int pos0 = o & 31;
#pragma unroll
            for (int j = 0; j < 8; ++j) dst[((1 + pos0 + j) * NCOL + col) * MF_R + r] = hv[j];
        }
    }
    for (int i = threadIdx.x; i < NCOL * MF_R; i += MF_THREADS) dst[i] = __float2half_rn(0.0f);
    __syncthreads();

    float *o = reinterpret_cast<float *>(out) + ((size_t)b * R + row0) * MF_D;
    const uint32_t xw0 = (uint32_t)__cvta_generic_to_shared(ps) + (NCOL + lane) * MF_R * 2;
    const int myrow = lane >> (5 - LR);      // the row this lane holds after the reduce-scatter
    int pcur = p0;
    for (int i = 0; i < n; ++i) {  // as in mf2_key
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
        float v[MF_R];
#pragma unroll
        for (int j = 0; j < MF_R; ++j) v[j] = 0.0f;
        mf2_walk<BITS, COMPACT, U>(cur, pcur, win + (i & 1) * MF_WIN2, xw0, 32 * MF_R * 2, NCOL * MF_R * 2, v);
        __syncwarp();
        // reduce-scatter of the R sums over the warp: halve the rows at each of the first log2 R
        // exchanges (lane bit 4 - k picks the upper half), then a butterfly over the rest
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
        if ((lane & ((32 >> LR) - 1)) == 0 && myrow < nr) atomicAdd(o + (size_t)myrow * MF_D + chan(i), v[0]);
        pcur = pnext;
    }
}

