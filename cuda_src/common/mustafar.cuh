// Mustafar: attention straight on a bitmap-sparse (fp16 / 4-bit / 2-bit) KV cache.
// Layouts: qgemm/kvcache.py and docs/mustafar.md. Tiles of 64 elements, a 64-bit occupancy bitmap
// each (bit i <-> element i); keys tiled along each token's D, values along S for each channel.
//
//   key kernel    scores[b*g+.., l, s] = sum_d q[.., l, d] K[s, d]        (fp16 out)
//   value kernel  out[b*g+.., l, d]   += sum_s p[.., l, s] V[s, d]        (fp32, accumulated)
//
// Work unit: one lane = one half-tile (32 positions = one 32-bit word of the bitmap); one warp
// step = 16 consecutive tiles = 32 half-tiles, whose codes / values are one contiguous byte range
// (the "window"), copied to shared memory with 16-byte cp.async while the previous step computes.
// Per lane, the set bits are walked in ascending order (clz of the bit-reversed word), the k-th
// non-zero dequantized (fp16: one HFMA from the code's bits) and multiplied with the R query /
// probability rows of its position, gathered from shared memory:
//   keys:   the queries of the batch, 16 copies interleaved so the 16 lanes of a half-warp never
//           hit the same bank (conflict-free 64-bit gathers at random positions);
//   values: the probabilities of the CTA's token chunk, transposed to [pos][half-tile][row] so a
//           lane's reads always fall in its own bank.
// Products accumulate in half2 within a half-tile (<= 32 terms); keys reduce the D/32 lanes of a
// token with shuffles and store fp16 scores; values add each half-tile into fp32 per lane and
// reduce a channel's lanes once per chunk, then atomicAdd into the fp32 output (zeroed first).
//
// Compile-time configuration (-D from the launcher):
//   MF_R      query rows per CTA (groups * Lq, padded): 4, 8, 16, 24 or 32
//   MF_D      head dim (64, 128, 256)
//   MF_REP    copies of the query rows in shared memory (key kernels; power of 2, <= 16)
//   MF_WARPS  warps per CTA
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
#define MF_MIN_CTAS (MF_R <= 8 ? 2 : 1)  // resident CTAs per SM the registers must allow
#else
#define MF_MIN_CTAS (MF_R <= 8 ? 4 : (MF_R <= 16 ? 2 : 1))
#endif
#endif
#define MF_THREADS (MF_WARPS * 32)
#define MF_FULL 0xffffffffu

static_assert(MF_R == 4 || (MF_R % 8 == 0 && MF_R <= 32), "MF_R must be 4, 8, 16, 24 or 32");
static_assert(MF_D == 64 || MF_D == 128 || MF_D == 256, "MF_D must be 64, 128 or 256");
static_assert(MF_REP >= 1 && MF_REP <= 16 && (MF_REP & (MF_REP - 1)) == 0, "MF_REP must be a power of 2 <= 16");

// Bytes of one step's codes / values at most (16 tiles), and the per-stage window buffer: the
// window starts 16-aligned below the first byte, and lanes read a little past their own data.
__host__ __device__ constexpr int mf_step_max(int bits) { return bits == 16 ? 16 * 64 * 2 : 16 * 64 * bits / 8; }
__host__ __device__ constexpr int mf_win(int bits) { return mf_step_max(bits) + 128; }
// Shared memory of the key kernel's query copies: [D/32 blocks][33 positions][REP][R] halfs
// (row 0 of every block is zeros, "position -1": lanes that ran out of non-zeros read it).
#define MF_XS_BYTES ((MF_D / 32) * 33 * MF_REP * MF_R * 2)

// Kernel parameters, the same for all eight entries:
//   bmp     bitmaps [B, T] (as pairs of 32-bit words, low word = elements 0..31)
//   offs    fp16: counts [B, T+1] (value index of each tile, then the end)
//           plain 4/2-bit: byte offset of each tile's codes [B, T]
//           compact: byte offset of each group of 16 tiles of a tile row [B, G+1]
//   scl     plain: scales [B, T] float; compact: dq [B, T] half2 (mult, add); fp16: unused
//   zer     plain: zeros [B, T] float (zero points in code units); otherwise unused
//   data    packed codes (uint8) or fp16 values; 16-byte aligned and padded to a multiple of 16
//   x       key: queries [B, R, D] half; value: probabilities [B, R, S] half   (R = groups * Lq)
//   out     key: scores [B, R, S] half; value: output [B, R, D] float (accumulated: zero it first)
//   S, R    tokens, query rows per kv head
//   per_cta key: steps (16 tiles) per CTA; value: tiles of each channel per CTA (multiple of 16)
// grid = (chunks, B, ceil(R / MF_R)).
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

// Per-step metadata of one lane (its half-tile), loaded two steps ahead.
struct MfMeta {
    uint32_t word;  // this lane's 32 bits of its tile's bitmap (0: no tile)
    int off;        // plain: tile byte offset; fp16: index of the tile's first value
    uint32_t dq;    // plain: scale bits; compact: dq half2 bits
    float zero;     // plain: zero point
    int g0, g1;     // step's byte / value range (compact, fp16): start and end
    int valid;
};

template <int BITS, bool COMPACT>
__device__ __forceinline__ MfMeta mf_load_meta(const uint32_t *__restrict__ bmp, const int *__restrict__ offs,
                                               const void *__restrict__ scl, const float *__restrict__ zer,
                                               size_t tile_base,  // b * T
                                               int t_first, int ntiles, int lane, size_t offs_base, int g) {
    MfMeta m;
    const int i = lane >> 1;
    const int t = t_first + i;
    m.valid = i < ntiles;
    const size_t gt = tile_base + (size_t)t;
    m.word = m.valid ? __ldg(bmp + 2 * gt + (lane & 1)) : 0u;
    m.off = 0;
    m.dq = 0;
    m.zero = 0.0f;
    m.g0 = m.g1 = 0;
    if (BITS == 16) {
        m.off = m.valid ? __ldg(offs + offs_base + t) : 0;
        m.g0 = __ldg(offs + offs_base + t_first);
        m.g1 = __ldg(offs + offs_base + t_first + ntiles);
    } else if (COMPACT) {
        m.dq = m.valid ? __ldg(reinterpret_cast<const uint32_t *>(scl) + gt) : 0u;
        m.g0 = __ldg(offs + offs_base + g);
        m.g1 = __ldg(offs + offs_base + g + 1);
    } else {
        m.off = m.valid ? __ldg(offs + gt) : 0;
        m.dq = m.valid ? __float_as_uint(__ldg(reinterpret_cast<const float *>(scl) + gt)) : 0u;
        m.zero = m.valid ? __ldg(zer + gt) : 0.0f;
    }
    return m;
}

// The step's window: its byte range [start, end) of `data`, copied (16-byte aligned) into `buf`.
// Returns this lane's position in the buffer: bit position of its first code, or (fp16) the
// half index of its first value.
template <int BITS, bool COMPACT>
__device__ __forceinline__ int mf_issue_window(const MfMeta &m, const uint8_t *__restrict__ data, uint8_t *buf, int lane) {
    const uint32_t partner = __shfl_xor_sync(MF_FULL, m.word, 1);
    const int hf = lane & 1;
    const int nlo = __popc(hf ? partner : m.word);
    const int ntile = __popc(m.word) + __popc(partner);
    int start, end, lpos;
    if (BITS == 16) {
        start = 2 * m.g0;
        end = 2 * m.g1;
        lpos = m.off + (hf ? nlo : 0) - ((start & ~15) >> 1);
    } else {
        const int nb = (ntile * BITS + 7) >> 3;
        int toff;
        if (COMPACT) {
            int incl = (hf == 0 && m.valid) ? nb : 0;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(MF_FULL, incl, o);
                if (lane >= o) incl += y;
            }
            toff = m.g0 + incl - nb;
            start = m.g0;
            end = m.g1;
        } else {
            toff = m.off;
            start = __shfl_sync(MF_FULL, m.off, 0);
            end = mf_warp_max(m.valid ? m.off + nb : 0);
        }
        lpos = (toff - (start & ~15)) * 8 + (hf ? nlo * BITS : 0);
    }
    if (!m.valid) lpos = 0;  // no tile: the lane walks no bits; keep its reads inside the buffer
    const int a = start & ~15;
    const int nchunk = (((end + 15) & ~15) - a) >> 4;
    for (int c = lane; c < nchunk; c += 32) mf_cp16(buf + 16 * c, data + a + 16 * c);
    return lpos;
}

// The half-tile's sparse dot product: acc[r] += sum over set bits j of word of
//   value(j) * X[j][r]   (X row of position j at xrow0 + j * xstride, R halfs; the row at
//   xrow0 - xstride, "position -1", is zeros: lanes that ran out of non-zeros read it)
// The set bits are walked from the top (FLO, -1 when none is left), so the codes are consumed
// from the last one down; they are read from the window left-aligned (code n-1 at the top of
// c[NCW-1]) and dequantized two at a time into a half2.
template <int BITS>
__device__ __forceinline__ void mf_half_tile(const MfMeta &m, int lpos, const uint8_t *buf, uint32_t xrow0,
                                             int xstride, __half2 (&acc)[MF_R / 2]) {
    constexpr int NCW = BITS == 16 ? 1 : BITS;  // 32-bit code words of a half-tile: 2 (2-bit), 4 (4-bit)
    constexpr int PER = BITS == 16 ? 1 : 32 / BITS;
    const int n = __popc(m.word);
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
        const __half2 dq = mf_as_h2(m.dq);
        dqm = __low2half2(dq);
        dqa = __high2half2(dq);
    } else {
        c[0] = 0;
        dqm = dqa = __float2half2_rn(0.0f);
    }
    uint32_t bits = m.word;
    // one non-zero: the highest set bit left picks the X row; v2 holds its value twice
    auto fma_row = [&](__half2 v2) {
        const int pos = 31 - __clz(bits);                    // FLO: -1 once no bit is left
        bits &= ~__funnelshift_l(0u, 1u, pos);               // clear it (1 << (pos & 31); harmless at -1)
        const uint32_t xp = xrow0 + pos * xstride;
        if (MF_R == 4) {
            const uint2 xx = mf_lds64(xp);
            acc[0] = __hfma2(mf_as_h2(xx.x), v2, acc[0]);
            acc[1] = __hfma2(mf_as_h2(xx.y), v2, acc[1]);
        } else {
#pragma unroll
            for (int j = 0; j < MF_R / 8; ++j) {
                const uint4 xx = mf_lds128(xp + 16 * j);
                acc[4 * j + 0] = __hfma2(mf_as_h2(xx.x), v2, acc[4 * j + 0]);
                acc[4 * j + 1] = __hfma2(mf_as_h2(xx.y), v2, acc[4 * j + 1]);
                acc[4 * j + 2] = __hfma2(mf_as_h2(xx.z), v2, acc[4 * j + 2]);
                acc[4 * j + 3] = __hfma2(mf_as_h2(xx.w), v2, acc[4 * j + 3]);
            }
        }
    };
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
    if (MF_R <= 8) {
        // few rows: fully unrolled, every code at a constant bit position
#pragma unroll
        for (int k0 = 0; k0 < 32; k0 += 2) {
            if (k0 >= kmax) break;
            if (BITS == 16) {
#pragma unroll
                for (int kk = 0; kk < 2; ++kk) {
                    const int k = k0 + kk;
                    fma_row(__half2half2(k < n ? vlast[-k] : __float2half_rn(0.0f)));
                }
            } else {
                {
                    const int k = k0;
                    const __half2 v = pair(c[NCW - 1 - k / PER], k % PER);
                    fma_row(__high2half2(v));
                    fma_row(__low2half2(v));
                }
            }
        }
    } else {
        // many rows (registers go to the row loads): a rolled loop over pairs of non-zeros,
        // the codes shifted up through c[] by 2 * BITS bits per pair
#pragma unroll 1
        for (int k0 = 0; k0 < kmax; k0 += 2) {
            if (BITS == 16) {
                fma_row(__half2half2(k0 < n ? vlast[-k0] : __float2half_rn(0.0f)));
                fma_row(__half2half2(k0 + 1 < n ? vlast[-k0 - 1] : __float2half_rn(0.0f)));
            } else {
                const __half2 v = pair(c[NCW - 1], 0);
                fma_row(__high2half2(v));
                fma_row(__low2half2(v));
#pragma unroll
                for (int i = NCW - 1; i > 0; --i) c[i] = __funnelshift_l(c[i - 1], c[i], 2 * BITS);
                c[0] <<= 2 * BITS;
            }
        }
    }
}

// plain 4/2-bit: the fp16 constants from the float32 scale and zero point, exactly as
// qgemm.kvcache.dequant_constants (no contraction into an FMA)
template <int BITS>
__device__ __forceinline__ void mf_plain_dq(MfMeta &m) {
    const float s = __uint_as_float(m.dq);
    const float mult = s * (float)(1 << BITS);
    const float add = __fsub_rn(__fmul_rn(-m.zero, s), mult);
    const __half2 h = __halves2half2(__float2half_rn(mult), __float2half_rn(add));
    m.dq = *reinterpret_cast<const uint32_t *>(&h);
}

// ---------------------------------------------------------------------------------------------
// key kernel: scores = q . K^T

template <int BITS, bool COMPACT>
__device__ __forceinline__ void mf_key(MF_PARAMS) {
    constexpr int TPT = MF_D / 64;  // tiles per token
    constexpr int LPT = MF_D / 32;  // lanes (half-tiles) per token
    constexpr int WIN = mf_win(BITS);
    extern __shared__ __align__(16) uint8_t mf_smem[];
    uint8_t *xs = mf_smem;                                  // [D/32][33][REP][MF_R] halfs
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint8_t *win = mf_smem + MF_XS_BYTES + warp * 2 * WIN;  // this warp's two window stages

    const int b = blockIdx.y;
    const int row0 = blockIdx.z * MF_R;
    const int nr = min(MF_R, R - row0);
    const int T = S * TPT;
    const int steps_b = (T + 15) >> 4;
    const int cs = blockIdx.x * per_cta;
    const int ce = min(cs + per_cta, steps_b);
    const int n = cs + warp < ce ? (ce - cs - warp + MF_WARPS - 1) / MF_WARPS : 0;  // this warp's steps
    const size_t tile_base = (size_t)b * T;
    const size_t offs_base = BITS == 16 ? (size_t)b * (T + 1) : (COMPACT ? (size_t)b * (steps_b + 1) : 0);

    auto step_of = [&](int i) { return cs + warp + i * MF_WARPS; };
    auto meta = [&](int i) {
        const int st = step_of(i);
        return mf_load_meta<BITS, COMPACT>(bmp, offs, scl, zer, tile_base, st * 16, min(16, T - st * 16), lane, offs_base, st);
    };

    MfMeta m0{}, m1{};
    int p0 = 0;
    if (n > 0) m0 = meta(0);
    if (n > 1) m1 = meta(1);
    if (n > 0) p0 = mf_issue_window<BITS, COMPACT>(m0, data, win, lane);
    mf_commit();

    // queries of this batch, REP interleaved copies; row 0 of each block of 32 dims is zeros
    for (int i = threadIdx.x; i < (MF_D / 32) * 33 * MF_REP; i += MF_THREADS) {
        const int rep = i % MF_REP, e = i / MF_REP;
        const int blk = e / 33, row = e % 33;
        const int d = blk * 32 + row - 1;
#pragma unroll
        for (int r4 = 0; r4 < MF_R; r4 += 4) {
            __half h[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = r4 + j;
                h[j] = (row > 0 && r < nr) ? x[((size_t)b * R + row0 + r) * MF_D + d] : __float2half_rn(0.0f);
            }
            uint2 w;
            __half2 lo = __halves2half2(h[0], h[1]), hi = __halves2half2(h[2], h[3]);
            w.x = *reinterpret_cast<uint32_t *>(&lo);
            w.y = *reinterpret_cast<uint32_t *>(&hi);
            *reinterpret_cast<uint2 *>(xs + ((size_t)(e * MF_REP + rep) * MF_R + r4) * 2) = w;
        }
    }
    __syncthreads();

    __half *scores = reinterpret_cast<__half *>(out);
    const int hf = lane & 1;
    const int jl = lane % LPT;
    int pcur = p0;
    // One step: the window of step i+1 is issued from meta(i+1) (loaded one step ago), meta(i+2)
    // is loaded into the registers meta(i) leaves free. The loop runs two steps per trip with the
    // two register sets swapped, so no in-flight load is ever moved between registers (a move
    // would wait for it: the prefetch would be lost).
    auto one = [&](int i, MfMeta &A, MfMeta &B) {
        MfMeta cur = A;
        if (i + 2 < n) A = meta(i + 2);
        int pnext = 0;
        if (i + 1 < n) pnext = mf_issue_window<BITS, COMPACT>(B, data, win + ((i + 1) & 1) * WIN, lane);
        mf_commit();
        mf_wait1();
        __syncwarp();
        if (BITS != 16 && !COMPACT) mf_plain_dq<BITS>(cur);
        const int t = step_of(i) * 16 + (lane >> 1);
        const int blk = (t % TPT) * 2 + hf;
        const uint32_t xaddr = (uint32_t)__cvta_generic_to_shared(xs) + ((blk * 33 + 1) * MF_REP + (lane % MF_REP)) * MF_R * 2;
        __half2 acc[MF_R / 2];
#pragma unroll
        for (int j = 0; j < MF_R / 2; ++j) acc[j] = __float2half2_rn(0.0f);
        mf_half_tile<BITS>(cur, pcur, win + (i & 1) * WIN, xaddr, MF_REP * MF_R * 2, acc);
        __syncwarp();
        // the token's LPT lanes sum their half-tiles; lane jl of the token stores rows jl, jl+LPT, ...
#pragma unroll
        for (int o = 1; o < LPT; o <<= 1) {
#pragma unroll
            for (int j = 0; j < MF_R / 2; ++j) acc[j] = __hadd2(acc[j], __shfl_xor_sync(MF_FULL, acc[j], o));
        }
        if (cur.valid) {
            __half *o = scores + ((size_t)b * R + row0) * S + t / TPT;
#pragma unroll
            for (int r = 0; r < MF_R; ++r) {
                if (r % LPT == jl && r < nr) o[(size_t)r * S] = (r & 1) ? __high2half(acc[r >> 1]) : __low2half(acc[r >> 1]);
            }
        }
        pcur = pnext;
    };
    for (int i = 0; i < n; i += 2) {
        one(i, m0, m1);
        if (i + 1 < n) one(i + 1, m1, m0);
    }
}

// ---------------------------------------------------------------------------------------------
// value kernel: out += p . V over this CTA's chunk of tokens

template <int BITS, bool COMPACT>
__device__ __forceinline__ void mf_value(MF_PARAMS) {
    constexpr int WIN = mf_win(BITS);
    extern __shared__ __align__(16) uint8_t mf_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tpc = per_cta;                 // tiles of a channel per CTA (multiple of 16)
    const int NH = 2 * tpc;                  // half-tiles of a channel per CTA (multiple of 32)
    uint8_t *ps = mf_smem;                   // [33 positions][NH][MF_R] halfs
    uint8_t *win = mf_smem + (size_t)33 * NH * MF_R * 2 + warp * 2 * WIN;

    const int b = blockIdx.y;
    const int row0 = blockIdx.z * MF_R;
    const int nr = min(MF_R, R - row0);
    const int nst = (S + 63) >> 6;           // tiles per channel
    const int T = MF_D * nst;
    const int st0 = blockIdx.x * tpc;
    const int st1 = min(st0 + tpc, nst);
    const int nsr = (st1 - st0 + 15) >> 4;   // steps per channel in this chunk
    const int gpr = (nst + 15) >> 4;         // compact groups per channel
    const int dpw = MF_D / MF_WARPS;         // channels per warp
    const int n = dpw * nsr;                 // this warp's steps
    const size_t tile_base = (size_t)b * T;
    const size_t offs_base = BITS == 16 ? (size_t)b * (T + 1) : (COMPACT ? (size_t)b * (MF_D * gpr + 1) : 0);

    auto meta = [&](int i) {
        const int d = warp + (i / nsr) * MF_WARPS, j = i % nsr;
        const int su = st0 + 16 * j;
        return mf_load_meta<BITS, COMPACT>(bmp, offs, scl, zer, tile_base, d * nst + su, min(16, st1 - su), lane, offs_base,
                                           d * gpr + (su >> 4));
    };

    MfMeta m0{}, m1{};
    int p0 = 0;
    if (n > 0) m0 = meta(0);
    if (n > 1) m1 = meta(1);
    if (n > 0) p0 = mf_issue_window<BITS, COMPACT>(m0, data, win, lane);
    mf_commit();

    // probabilities of the chunk's tokens, transposed: token s0 + 32h + pos -> ps[1 + pos][h][r]; row 0 zeros
    const int s0 = st0 * 64;
    const int groups8 = NH * 4;              // 8-token groups in the chunk
    const bool vec = (S & 7) == 0;
    for (int i = threadIdx.x; i < MF_R * groups8; i += MF_THREADS) {
        const int r = i / groups8, g = i % groups8;
        const int s = s0 + 8 * g;
        __half h[8];
        const __half *src = x + ((size_t)b * R + row0 + min(r, nr - 1)) * S;
        if (r < nr && vec && s + 8 <= S) {
            const uint4 u = __ldg(reinterpret_cast<const uint4 *>(src + s));
            const __half *hu = reinterpret_cast<const __half *>(&u);
#pragma unroll
            for (int j = 0; j < 8; ++j) h[j] = hu[j];
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) h[j] = (r < nr && s + j < S) ? src[s + j] : __float2half_rn(0.0f);
        }
        const int hh = g >> 2, pos0 = (g & 3) * 8;
        __half *dst = reinterpret_cast<__half *>(ps);
#pragma unroll
        for (int j = 0; j < 8; ++j) dst[((1 + pos0 + j) * NH + hh) * MF_R + r] = h[j];
    }
    for (int i = threadIdx.x; i < NH * MF_R; i += MF_THREADS) reinterpret_cast<__half *>(ps)[i] = __float2half_rn(0.0f);
    __syncthreads();

    float facc[MF_R];
#pragma unroll
    for (int r = 0; r < MF_R; ++r) facc[r] = 0.0f;
    float *o = reinterpret_cast<float *>(out);
    const int xstride = NH * MF_R * 2;
    const uint32_t ps_s = (uint32_t)__cvta_generic_to_shared(ps);
    int pcur = p0;
    // as in mf_key: two steps per trip, register sets swapped (no in-flight load is moved)
    auto one = [&](int i, MfMeta &A, MfMeta &B) {
        MfMeta cur = A;
        if (i + 2 < n) A = meta(i + 2);
        int pnext = 0;
        if (i + 1 < n) pnext = mf_issue_window<BITS, COMPACT>(B, data, win + ((i + 1) & 1) * WIN, lane);
        mf_commit();
        mf_wait1();
        __syncwarp();
        if (BITS != 16 && !COMPACT) mf_plain_dq<BITS>(cur);
        const int j = i % nsr;
        const uint32_t xaddr = ps_s + (NH + 32 * j + lane) * MF_R * 2;
        __half2 acc[MF_R / 2];
#pragma unroll
        for (int q = 0; q < MF_R / 2; ++q) acc[q] = __float2half2_rn(0.0f);
        mf_half_tile<BITS>(cur, pcur, win + (i & 1) * WIN, xaddr, xstride, acc);
        __syncwarp();
#pragma unroll
        for (int q = 0; q < MF_R / 2; ++q) {
            const float2 f = __half22float2(acc[q]);
            facc[2 * q] += f.x;
            facc[2 * q + 1] += f.y;
        }
        if (j == nsr - 1) {  // this channel's chunk is done: reduce the warp, add into the output
            const int d = warp + (i / nsr) * MF_WARPS;
#pragma unroll
            for (int r = 0; r < MF_R; ++r) {
#pragma unroll
                for (int off = 16; off; off >>= 1) facc[r] += __shfl_xor_sync(MF_FULL, facc[r], off);
            }
            float mine = 0.0f;
#pragma unroll
            for (int r = 0; r < MF_R; ++r) {
                if (lane == r) mine = facc[r];
                facc[r] = 0.0f;
            }
            if (lane < nr) atomicAdd(o + ((size_t)b * R + row0 + lane) * MF_D + d, mine);
        }
        pcur = pnext;
    };
    for (int i = 0; i < n; i += 2) {
        one(i, m0, m1);
        if (i + 1 < n) one(i + 1, m1, m0);
    }
}
