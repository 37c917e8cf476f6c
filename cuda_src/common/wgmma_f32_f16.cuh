// Prefill on Hopper (sm_90a), third design: *float32* activations straight from global memory into
// registers as wgmma's A operand (rounded to fp16 there), Q4_0 / Q8_0 weights dequantized by a
// producer warpgroup into 128-byte-swizzled shared memory as the B operand. No prologue kernel.
//
// Why: the register-A kernel (common/wgmma_rs_f16.cuh) needs its activations as fp16 in the kperm16
// layout, so qgemm.matmul runs convert.f16k before it: at 512x4096x14336 and 2048x4096x4096 that
// launch is 8-16 us of a 94-120 us op (its 29-34 MB of float32 read and 15-17 MB of fp16 written).
// Converting inside that kernel failed (docs/perf/NOTES.md sessions 3, 6, 7, 31): there the tokens
// are wgmma's N side, staged through shared memory, and each CTA's 64-128 weight rows re-read them,
// so float32 doubled the staged bytes. Here the roles are those of the GEMM itself: the tokens are
// wgmma's M (64 per consumer warpgroup) and come from registers, where the float32 -> fp16
// rounding is one cvt per pair; each activation is read once per CTA for XA_BN = 128 weight rows
// (the same bytes per FLOP as the fp16 path's 64-row tiles). The weights pay instead: they are
// dequantized into shared memory once per CTA (tile 128 tokens x XA_BN rows), by a warpgroup that
// does nothing else, and wgmma reads them from there (the first design, common/wgmma_f16.cuh, did
// that fill in the MMA warps, between two CTA barriers: it was bound by it).
//
// The k order: kperm16 on both sides, without any kernel writing it. Inside every 16 k of a
// k-step, wgmma position 2t, 2t + 1, 2t + 8, 2t + 9 (lane (g, t)'s A fragment columns) stand for
// k 4t, 4t + 2, 4t + 1, 4t + 3. A consumer lane's float4 at x[16 s + 4t ..] is (k 4t .. 4t + 3),
// so its A registers are cvt(x0, x2) and cvt(x1, x3): one 16-byte load per row and k-step. The
// producer's SkQ*::frags output is already in that order (common/wgmma_rs_f16.cuh explains why) as
// m16n8k16 A fragments of 16 weight rows x 16 positions, which one stmatrix.x4 writes to the B
// tile: B[row][position] K-major, 64-position atoms of XA_BN rows x 128 B, chunk c of row r at
// c ^ (r % 8) (8 rows of an 8x8 matrix hit 8 distinct 16-byte bank groups: conflict-free).
//
// CTA: XA_WGS consumer warpgroups (tokens 64 v .. 64 v + 63 of the tile) + 1 producer warpgroup.
// K in stages of 128 (a group of 4 blocks of the skinny layout).
//   producer: the raw quants and scales of stage s + XA_QSTAGES - 1 by cp.async into a ring of
//     its own (each lane copies the 16-byte pieces it later reads, the scales by 8 lanes per
//     tile: a __syncwarp after the wait makes them visible to the warp), then for stage s: wait for
//     B buffer s % XA_STAGES to be free (mbarrier `empty`), dequantize, stmatrix, fence.proxy.async
//     (generic writes -> visible to wgmma), arrive on `full`.
//   consumers: per half-stage (2 blocks = 4 k-steps) wait_group 1 (the half before the previous
//     one retired: its fragment registers are free), round the float32 loaded one half earlier
//     into those registers, wgmma.fence, 4 wgmma m64nXA_BNk16, commit, then load the next half's
//     float32 (so a half-stage of MMA covers the loads' L2 latency). After the second half's wait
//     the previous stage has retired in this warp: its lane 0 arrives on that buffer's `empty`.
// The producer never waits for the previous grid (programmatic dependent launch): it reads only
// weights, which no PDL predecessor writes (common/pdl.cuh); the consumers wait before their first
// activation load.
#pragma once
#include "common/skinny_f16.cuh"
#include "common/wgmma.cuh"
#include "common/pdl.cuh"

#ifndef XA_BN
#define XA_BN 128  // weight rows per CTA: wgmma's N (128 or 256)
#endif
#ifndef XA_WGS
#define XA_WGS 2  // consumer warpgroups, 64 tokens each
#endif
#ifndef XA_STAGES
#define XA_STAGES 4  // dequantized B buffers
#endif
#ifndef XA_QSTAGES
#define XA_QSTAGES 4  // raw quant stages in flight (the producer's cp.async ring)
#endif
#ifndef XA_PROBE
#define XA_PROBE 0  // timing probes (wrong results): 1 = no dequantization, 2 = no activation loads in the loop
#endif
#ifndef XA_PF
#define XA_PF 3  // the activations of the half-stage this many halves ahead are prefetched into the L2 (0: none)
#endif
#ifndef XA_XD
#define XA_XD 1  // activation register sets: 1 = loaded one half-stage ahead, 2 = two halves ahead (twice the registers)
#endif
#if XA_STAGES < 2 || XA_QSTAGES < 2
#error "XA_STAGES and XA_QSTAGES must be >= 2"
#endif
#define XA_BM (64 * XA_WGS)                 // tokens per CTA
#define XA_THREADS (128 * XA_WGS + 128)      // + the producer warpgroup
#define XA_TILES (XA_BN / 16)                // 16-row weight tiles per CTA
#define XA_TPW (XA_TILES / 4)                // tiles per producer warp
#define XA_B_BYTES (XA_BN * 128 * 2)         // [XA_BN rows][128 k] fp16

#if XA_BN == 128
#define XA_WGMMA wgmma_rs_m64n128k16
#elif XA_BN == 256
#define XA_WGMMA wgmma_rs_m64n256k16
#else
#error "XA_BN must be 128 or 256"
#endif

// byte offset of (weight row, k position) in a B buffer (128-byte swizzle, 64-wide K atoms)
static __device__ __forceinline__ unsigned xa_sw(int row, int k) {
    return (unsigned)((k >> 6) * (XA_BN * 128) + row * 128 + ((((k & 63) >> 3) ^ (row & 7)) << 4) + ((k & 7) << 1));
}

static __device__ __forceinline__ void xa_stmatrix_x4(unsigned addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}

static __device__ __forceinline__ void xa_cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// a float32 x 4 activation load, zeros where `valid` is false (past K). Predicated instead of
// branched: control flow between two wgmma makes ptxas serialize them all (C7513)
static __device__ __forceinline__ float4 xa_ld_x(const float* p, bool valid) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));  // p is in bounds either way
    return valid ? v : make_float4(0.f, 0.f, 0.f, 0.f);
}

static __device__ __forceinline__ void xa_prefetch_l2(const float* p, bool valid) {
    asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %1, 0;\n@q prefetch.global.L2 [%0];\n}\n" ::"l"(p), "r"((int)valid));
}

static __device__ __forceinline__ unsigned xa_h2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

static __device__ __forceinline__ void xa_arrive_if(unsigned bar, bool pred) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 st;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar),
        "r"((int)pred)
        : "memory");
}

// round (lo, hi) into the fragment register r *in place*: tied to r's previous value, so ptxas
// keeps one physical register per fragment across the loop instead of renaming (a renamed
// fragment may land on registers an in-flight wgmma still reads: then every wgmma is serialized)
static __device__ __forceinline__ void xa_cvt_into(unsigned& r, float lo, float hi) {
    asm volatile("cvt.rn.f16x2.f32 %0, %2, %1;\n" : "+r"(r) : "f"(lo), "f"(hi));
}

template <typename SF>
static __device__ __forceinline__ void wgmma_f32_f16_gemm(const float* __restrict__ X, const unsigned char* __restrict__ Wp,
                                                          float* __restrict__ C, int M, int N, int K) {
    constexpr int GROUP_PIECES = SF::PIECES * 32;                         // uint4 per (tile, group)
    constexpr int Q_BYTES = XA_TILES * (GROUP_PIECES * 16 + 8 * 16);       // raw quants + scales of a stage
    extern __shared__ unsigned char xa_smem_raw[];
    const unsigned raw = (unsigned)__cvta_generic_to_shared(xa_smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // the swizzle pattern is on absolute address bits
    const unsigned qring = base + XA_STAGES * XA_B_BYTES;
    const unsigned bars = qring + XA_QSTAGES * Q_BYTES;  // full[b] at bars + 8 b, empty[b] at bars + 8 (XA_STAGES + b)
    unsigned char* const smem = xa_smem_raw + (base - raw);

    pdl_launch_dependents();  // the next op may launch: it waits for this grid before touching what this one uses
    const int tid = threadIdx.x, lane = tid % 32, wgi = tid / 128, warp_in_wg = (tid / 32) % 4;
    const int g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * XA_BN, m0 = blockIdx.y * XA_BM;
    const int nb = K / QK, ngroups = (nb + 3) / 4, ntiles = (N + 15) / 16;
    const uint4* qs = reinterpret_cast<const uint4*>(Wp);
    const uint4* ds = qs + (size_t)ntiles * ngroups * GROUP_PIECES;

    if (tid == 0)
        for (int b = 0; b < XA_STAGES; ++b) {
            mbar_init(bars + 8 * b, 128);                         // every producer thread
            mbar_init(bars + 8 * (XA_STAGES + b), 4 * XA_WGS);    // one arrival per consumer warp
        }
    __syncthreads();

    if (wgi == XA_WGS) {
        // ---- producer: warp pw dequantizes tiles pw * XA_TPW .. + XA_TPW - 1 of the CTA ----
        const int pw = warp_in_wg;
        const uint4* qsrc[XA_TPW];
#pragma unroll
        for (int i = 0; i < XA_TPW; ++i) {
            const int tile = min(n0 / 16 + pw * XA_TPW + i, ntiles - 1);  // tiles past N re-read the last (never stored)
            qsrc[i] = qs + (size_t)tile * ngroups * GROUP_PIECES + lane;
        }
        // the scales: lane l < 8 XA_TPW copies uint4 l % 8 of tile l / 8's 8
        const int dl = lane % 8, dtile = min(lane / 8, XA_TPW - 1);
        const uint4* dsrc = ds + ((size_t)min(n0 / 16 + pw * XA_TPW + dtile, ntiles - 1) * ngroups) * 8 + dl;
        // this warp's part of a ring slot: [tile][piece][lane] uint4, then [tile][8] uint4 of scales
        const unsigned qw = pw * XA_TPW * GROUP_PIECES * 16, dw = XA_TILES * GROUP_PIECES * 16 + pw * XA_TPW * 128;
        auto issue = [&](int s) {
            if (s < ngroups) {
                const unsigned slot = qring + (s % XA_QSTAGES) * Q_BYTES;
#pragma unroll
                for (int i = 0; i < XA_TPW; ++i)
#pragma unroll
                    for (int p = 0; p < SF::PIECES; ++p)
                        xa_cp_async16(slot + qw + ((i * SF::PIECES + p) * 32 + lane) * 16, qsrc[i] + (size_t)s * GROUP_PIECES + p * 32);
                if (lane < 8 * XA_TPW) xa_cp_async16(slot + dw + lane * 16, dsrc + (size_t)s * 8);
            }
            cp_async_commit();
        };
#pragma unroll
        for (int s = 0; s < XA_QSTAGES - 1; ++s) issue(s);
        // stmatrix addresses: lane l gives row l % 8 of matrix l / 8 -- matrices (rows 0-7 | 8-15) x
        // (positions 0-7 | 8-15) of a tile's k-step, in the order of the A fragment's registers
        const int st_row = (lane % 8) + 8 * ((lane / 8) & 1), st_pos = 8 * (lane / 16);
        for (int s = 0; s < ngroups; ++s) {
            __syncwarp();  // every lane is done reading the slot that issue() refills next
            issue(s + XA_QSTAGES - 1);
            cp_async_wait<XA_QSTAGES - 1>();
            __syncwarp();  // the scales other lanes copied are visible
            const int b = s % XA_STAGES;
            if (s >= XA_STAGES) mbar_wait(bars + 8 * (XA_STAGES + b), ((s / XA_STAGES) - 1) & 1);
            const unsigned char* slot = smem + (qring - base) + (s % XA_QSTAGES) * Q_BYTES;
            const unsigned bbuf = base + b * XA_B_BYTES;
#pragma unroll
            for (int i = 0; i < XA_TPW * !(XA_PROBE & 1); ++i) {
                uint4 nat[SF::PIECES];
#pragma unroll
                for (int p = 0; p < SF::PIECES; ++p)
                    nat[p] = reinterpret_cast<const uint4*>(slot + qw)[(i * SF::PIECES + p) * 32 + lane];
                const uint4 dq = reinterpret_cast<const uint4*>(slot + dw)[i * 8 + g];
                const int row = 16 * (pw * XA_TPW + i) + st_row;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    unsigned a[2][4];
                    SF::frags(nat, dq, j, a);
#pragma unroll
                    for (int h = 0; h < 2; ++h) xa_stmatrix_x4(bbuf + xa_sw(row, 16 * (2 * j + h) + st_pos), a[h]);
                }
            }
            fence_proxy_async();
            mbar_arrive(bars + 8 * b);
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // ---- consumers: warp w of warpgroup wgi owns tokens m0 + 64 wgi + 16 w + g (+ 8) ----
    float d[XA_BN / 2];
#pragma unroll
    for (int i = 0; i < XA_BN / 2; ++i) d[i] = 0.0f;
    const int tok = m0 + 64 * wgi + 16 * warp_in_wg + g;
    const float* xr0 = X + (size_t)min(tok, M - 1) * K + 4 * t;  // rows past M read row M - 1 (never stored)
    const float* xr1 = X + (size_t)min(tok + 8, M - 1) * K + 4 * t;
    float4 xvs[XA_XD][4][2];  // the float32 of the next XA_XD half-stages: k-step kk, row g / g + 8
    // half u of stage s (k from 128 s + 64 u); K % 32 == 0, so a k-step is all inside K or all past
    // it, and past K (the last stage, or the stage after the last) it is zeros: the weights there
    // are exact zeros (padding), and 0 x 0 stays 0
    // L2 prefetch: a half-stage of a warp's 16 rows is 32 lines of 128 B (64 k); lane l asks for
    // line l / 16 of row l % 16, XA_PF halves ahead of the loads (one instruction, no registers)
    const float* xpf = X + (size_t)min(m0 + 64 * wgi + 16 * warp_in_wg + lane % 16, M - 1) * K + 32 * (lane / 16);
    auto load_half = [&](float4 (&xv)[4][2], int s, int u) {
        if ((XA_PROBE & 2) && s + u > 0) return;
        const int k0 = 128 * s + 64 * u;
        if (XA_PF) {
            const int kp = k0 + 64 * XA_PF;
            xa_prefetch_l2(xpf + (kp < K ? kp : 0), kp < K);
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const int k = k0 + 16 * kk;
            const bool in = k < K;
            const int kc = in ? k : 0;
            xv[kk][0] = xa_ld_x(xr0 + kc, in);
            xv[kk][1] = xa_ld_x(xr1 + kc, in);
        }
    };
    unsigned fr[2][4][4];  // A fragments of the two half-stages
    pdl_wait();
    load_half(xvs[0], 0, 0);
    if (XA_XD == 2) load_half(xvs[XA_XD - 1], 0, 1);
    for (int s = 0; s < ngroups; ++s) {
        const int b = s % XA_STAGES;
        mbar_wait(bars + 8 * b, (s / XA_STAGES) & 1);
        const unsigned bdesc = wg_desc_lo(base + b * XA_B_BYTES);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            float4 (&xv)[4][2] = xvs[XA_XD == 2 ? u : 0];
            wgmma_wait<1>();
            // u = 1: the whole previous stage has retired in this warp -- lane 0 frees its buffer
            // (predicated, not branched: with loads in flight, a branch here made ptxas serialize
            // every wgmma, C7513)
            if (u == 1) xa_arrive_if(bars + 8 * (XA_STAGES + (s + XA_STAGES - 1) % XA_STAGES), s > 0 && lane == 0);
#pragma unroll
            for (int i = 0; i < 16; ++i) wg_fence_operand(fr[u][i / 4][i % 4]);
            // the roundings must not be hoisted above the wait into registers an in-flight wgmma
            // still reads (ptxas would then serialize every wgmma, C7513)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                wg_fence_operand(xv[i / 2][i % 2].x);
                wg_fence_operand(xv[i / 2][i % 2].y);
                wg_fence_operand(xv[i / 2][i % 2].z);
                wg_fence_operand(xv[i / 2][i % 2].w);
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                // A registers: {row g, positions 2t..2t+1} = k (4t, 4t+2); {row g+8, same}; {row g, 2t+8..} = (4t+1, 4t+3); {row g+8, ..}
                xa_cvt_into(fr[u][kk][0], xv[kk][0].x, xv[kk][0].z);
                xa_cvt_into(fr[u][kk][1], xv[kk][1].x, xv[kk][1].z);
                xa_cvt_into(fr[u][kk][2], xv[kk][0].y, xv[kk][0].w);
                xa_cvt_into(fr[u][kk][3], xv[kk][1].y, xv[kk][1].w);
            }
            // ... nor sunk below the first wgmma of the half (the same C7513)
#pragma unroll
            for (int i = 0; i < 16; ++i) wg_fence_operand(fr[u][i / 4][i % 4]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const int step = 4 * u + kk;
                XA_WGMMA(d, fr[u][kk], wg_desc_at(bdesc, (step >> 2) * (XA_BN * 128) + (step & 3) * 32));
            }
            wgmma_commit();
            if (XA_XD == 2) load_half(xv, s + 1, u);  // two halves ahead: (s + 1, u)
            else load_half(xv, s + u, 1 - u);  // the next half: (s, 1), or (s + 1, 0) -- zeros past the last stage
        }
    }
    wgmma_wait<0>();

    // accumulator layout (m64nNk16, f32): warp w owns rows 16w .. 16w + 15 (tokens);
    // d[4c + 0..1] = (row g, cols 8c + 2t + 0..1), d[4c + 2..3] = (row g + 8, same cols) (weight rows)
    const bool pairs = (N % 2) == 0 && (((size_t)C) & 7) == 0;  // 8-byte stores: even rows and an 8-byte aligned C
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int m = tok + 8 * h;
        if (m >= M) continue;
        float* crow = C + (size_t)m * N;
#pragma unroll
        for (int c = 0; c < XA_BN / 8; ++c) {
            const int n = n0 + 8 * c + 2 * t;
            const float v0 = d[4 * c + 2 * h], v1 = d[4 * c + 2 * h + 1];
            if (pairs && n + 1 < N) {
                *reinterpret_cast<float2*>(crow + n) = make_float2(v0, v1);
            } else {
                if (n < N) crow[n] = v0;
                if (n + 1 < N) crow[n + 1] = v1;
            }
        }
    }
}
