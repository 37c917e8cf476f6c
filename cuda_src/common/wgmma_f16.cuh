// Prefill on Hopper (sm_90a): fp16 activations x Q4_0 / Q8_0 weights through wgmma, the
// asynchronous warpgroup MMA that reads both operands straight from shared memory.
//
// Why: the mma.sync kernel (common/mma_f16.cuh) runs one CTA of 8 warps per SM at 512x4096
// (128 tiles, 233 registers) and Nsight Compute shows the tensor pipe a third busy -- too few
// warps to hide mma.sync + ldmatrix latency. wgmma is issued once per 64x128x16 step by a whole
// warpgroup and runs asynchronously, so the same warps dequantize the next stage while the
// tensor cores work on this one, and no fragment ever passes through registers.
//
// CTA: 2 warpgroups (256 threads), tile 128 tokens x 128 weight rows, K in stages of 128 (one
// group of 4 quant blocks of the skinny layout, qgemm.packing), WG_STAGES buffers:
//   A stage: 128 rows x 128 K fp16, copied with cp.async 16 B (zero-filled past K)
//   W stage: 128 rows x 128 K fp16, dequantized by the CTA's threads from the skinny layout:
//            thread (tile T = tid / 32, lane) holds rows 16T + g and 16T + g + 8, qs word t of
//            the group's 4 blocks -- exactly SkQ4_0 / SkQ8_0::frags' A fragments, which are the
//            4 values 32j + 4t .. + 3 and 32j + 16 + 4t .. + 3 of each block j, paired (0, 2)
//            and (1, 3): one PRMT per pair puts them back in order for the 8-byte store.
// Both tiles use wgmma's K-major 128-byte-swizzle layout: a tile is two 64-wide K atoms of
// [rows][128 B], and the 16-byte chunk c of row r sits at chunk c ^ (r % 8) (the hardware applies
// the same XOR on the address bits when it reads, so the 8 rows of a core matrix hit 8 different
// bank groups). A descriptor names a 64 x 16 (A) or 128 x 16 (B) slice by its start address;
// stepping k by 16 inside an atom adds 32 bytes, stride between 8-row groups 1024 bytes.
//
// WG_SPEC = 0 (all 8 warps fill and multiply): per stage, wait for this stage's copies, make the
// generic-proxy writes (cp.async, st.shared) visible to the async proxy (fence.proxy.async),
// barrier, issue the 8 wgmma of each warpgroup, commit; wait until the previous stage's wgmma are
// done (wait_group 1) and barrier, then refill that buffer with the stage WG_STAGES - 1 ahead while
// this stage's wgmma run. Weight registers for the stage after that are loaded one iteration early.
// The two CTA barriers per stage serialize the fill with the MMAs (Nsight Compute: 0.41 issued
// instructions per scheduler per cycle, the tensor cores waiting on the fill).
//
// WG_SPEC = 1 (warp specialization, 4 warpgroups): warpgroups 0 and 1 only fill -- activations by
// cp.async one stage ahead, weights dequantized from registers loaded one stage ahead -- and
// signal `full[buf]` (an mbarrier, 256 arrivals) after fence.proxy.async; warpgroups 2 and 3 wait
// on `full`, issue their wgmma, and once a stage's wgmma group has completed (wait_group 1) one
// thread of each signals `empty[buf]` (2 arrivals), which the producers wait on before refilling
// that buffer. No CTA-wide barrier in the loop: the fill of stage s + 1 runs under stage s's MMAs.
// (A single producer warpgroup measured slower: it was the bottleneck at twice the work per thread.)
#pragma once
#include "common/skinny_f16.cuh"
#include "common/wgmma.cuh"

#ifndef WG_STAGES
#define WG_STAGES 3
#endif
#ifndef WG_SPLITK
#define WG_SPLITK 1  // K split across CTAs (blockIdx.z) when the tile grid would leave SMs idle; atomics into a zeroed C
#endif
#ifndef WG_SPEC
#define WG_SPEC 0  // 1: warp-specialized -- two producer warpgroups fill the stages, two consumer warpgroups only MMA
#endif
#define WG_THREADS (WG_SPEC ? 512 : 256)
#define WG_PRODUCERS 256  // threads that fill a stage (WG_SPEC: warpgroups 0 and 1)
#define WG_BM 128
#define WG_BN 128
#define WG_BK 128
#define WG_TILE_BYTES (128 * WG_BK * 2)  // one 128 x 128 fp16 operand tile

// byte offset of (row, k) in a [128 rows][128 K] fp16 tile in the 128-byte-swizzle layout
static __device__ __forceinline__ unsigned wg_sw(int row, int k) {
    return (unsigned)((k >> 6) * (128 * 128) + row * 128 + ((((k & 63) >> 3) ^ (row & 7)) << 4) + ((k & 7) << 1));
}

static __device__ __forceinline__ void wg_sts64(unsigned addr, unsigned lo, unsigned hi) {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(lo), "r"(hi));
}

template <typename SF>
static __device__ __forceinline__ void wgmma_f16_gemm(const __half* __restrict__ A, const unsigned char* __restrict__ Wp,
                                                      float* __restrict__ C, int M, int N, int K) {
    extern __shared__ unsigned char wg_smem_raw[];
    const unsigned raw = (unsigned)__cvta_generic_to_shared(wg_smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // the swizzle pattern is on absolute address bits
    const unsigned sA = base, sW = base + WG_STAGES * WG_TILE_BYTES;

    const int tid = threadIdx.x, lane = tid % 32, wgi = tid / 128, warp_in_wg = (tid / 32) % 4;
    const int g = lane / 4, t = lane % 4;
    const int m0 = blockIdx.y * WG_BM, n0 = blockIdx.x * WG_BN;
    const int nb = K / QK, ngroups = (nb + 3) / 4, ntiles = (N + 15) / 16;
    const int g_begin = (int)((long long)ngroups * blockIdx.z / WG_SPLITK);
    const int n_stages = (int)((long long)ngroups * (blockIdx.z + 1) / WG_SPLITK) - g_begin;
    constexpr int GROUP_PIECES = SF::PIECES * 32;
    const uint4* qs = reinterpret_cast<const uint4*>(Wp);
    const uint4* ds = qs + (size_t)ntiles * ngroups * GROUP_PIECES;
    // a producer thread's share of a W stage (tid < WG_PRODUCERS): 16-row tile T of the CTA's 8,
    // rows g and g + 8
    const int T = tid / 32;
    const int tile = min(n0 / 16 + T, ntiles - 1);  // past N: clamped (rows never stored)

    uint4 wq[SF::PIECES], wd;
    auto load_w = [&](int st) {  // stage st of this CTA's K slice
        const size_t bse = (size_t)tile * ngroups + g_begin + st;
#pragma unroll
        for (int p = 0; p < SF::PIECES; ++p) wq[p] = ld_stream16(qs + bse * GROUP_PIECES + p * 32 + lane);
        wd = __ldg(ds + bse * 8 + g);
    };
    auto store_w = [&](int buf) {
        const unsigned dst = sW + buf * WG_TILE_BYTES;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            unsigned a[2][4];
            SF::frags(wq, wd, j, a);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = 16 * T + g + 8 * h;
#pragma unroll
                for (int s = 0; s < 2; ++s)
                    wg_sts64(dst + wg_sw(row, 32 * j + 16 * s + 4 * t), __byte_perm(a[s][h], a[s][2 + h], 0x5410),
                             __byte_perm(a[s][h], a[s][2 + h], 0x7632));
            }
        }
    };
    // A must start on a 16-byte boundary (the launcher checks it); rows are then 16-byte aligned too
    // (K % 32 == 0). Chunks past K are zero-filled: the padded weight blocks are exact zeros, and
    // so must the activations be (0 x garbage could be NaN).
    auto load_a = [&](int st, int buf) {
        const unsigned dst = sA + buf * WG_TILE_BYTES;
        const int k0 = (g_begin + st) * WG_BK;
#pragma unroll
        for (int i = 0; i < (WG_BM * WG_BK / 8) / WG_PRODUCERS; ++i) {
            const int q = tid + i * WG_PRODUCERS, r = q / 16, c = q % 16;  // 16 chunks of 8 halves per row
            const int k = k0 + c * 8;
            const __half* src = A + (size_t)min(m0 + r, M - 1) * K + min(k, K - 8);
            wg_cp_async16_zfill(dst + wg_sw(r, c * 8), src, k < K);
        }
    };

    float d[64];  // a consumer warpgroup's 64 x 128 accumulator tile
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    auto mma_stage = [&](int buf, int cw) {  // cw: which 64 token rows of the tile
        wgmma_fence();
        const unsigned a_tile = sA + buf * WG_TILE_BYTES + cw * 64 * 128;
        const unsigned w_tile = sW + buf * WG_TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; ++kk) {
            const unsigned koff = (kk >> 2) * (128 * 128) + (kk & 3) * 32;
            wgmma_m64n128k16(d, wg_desc(a_tile + koff), wg_desc(w_tile + koff));
        }
        wgmma_commit();
    };
    int cw = wgi;  // token block of this warpgroup's accumulators

#if WG_SPEC
    const unsigned bars = sW + WG_STAGES * WG_TILE_BYTES;  // full[WG_STAGES], empty[WG_STAGES]
    if (tid == 0) {
        for (int b = 0; b < WG_STAGES; ++b) {
            mbar_init(bars + 8 * b, WG_PRODUCERS);             // full[b]
            mbar_init(bars + 8 * (WG_STAGES + b), 2);          // empty[b]: one arrival per consumer warpgroup
        }
    }
    __syncthreads();
    if (wgi < 2) {  // producers
        if (n_stages > 0) {
            load_a(0, 0);
            load_w(0);
        }
        cp_async_commit();
        for (int s = 0; s < n_stages; ++s) {
            const int buf = s % WG_STAGES;
            if (s + 1 < n_stages) {
                const int nbuf = (s + 1) % WG_STAGES, round = (s + 1) / WG_STAGES;
                if (round > 0) mbar_wait(bars + 8 * (WG_STAGES + nbuf), (round - 1) & 1);  // consumers released it
                load_a(s + 1, nbuf);
            }
            cp_async_commit();
            store_w(buf);  // buffer `buf` was released before A(s) was issued into it
            if (s + 1 < n_stages) load_w(s + 1);
            cp_async_wait<1>();  // A(s) has landed (A(s + 1) may be in flight)
            fence_proxy_async();
            mbar_arrive(bars + 8 * buf);
        }
        cp_async_wait<0>();
        return;
    }
    cw = wgi - 2;
    for (int s = 0; s < n_stages; ++s) {
        const int buf = s % WG_STAGES;
        mbar_wait(bars + 8 * buf, (s / WG_STAGES) & 1);
        mma_stage(buf, cw);
        wgmma_wait<1>();  // stage s - 1's wgmma have completed: release its buffer
        if (s > 0 && tid % 128 == 0) mbar_arrive(bars + 8 * (WG_STAGES + (s - 1) % WG_STAGES));
    }
    wgmma_wait<0>();
#else
    // prologue: stages 0 .. WG_STAGES - 2
#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; ++s) {
        if (s < n_stages) {
            load_a(s, s);
            load_w(s);
            store_w(s);
        }
        cp_async_commit();
    }
    if (WG_STAGES - 1 < n_stages) load_w(WG_STAGES - 1);

    for (int s = 0; s < n_stages; ++s) {
        const int buf = s % WG_STAGES;
        cp_async_wait<WG_STAGES - 2>();
        fence_proxy_async();
        __syncthreads();
        mma_stage(buf, cw);
        wgmma_wait<1>();  // this warpgroup's previous stage is done ...
        __syncthreads();  // ... and the other's: its buffer may be refilled
        const int next = s + WG_STAGES - 1;
        if (next < n_stages) {
            load_a(next, next % WG_STAGES);
            store_w(next % WG_STAGES);
            if (next + 1 < n_stages) load_w(next + 1);
        }
        cp_async_commit();
    }
    wgmma_wait<0>();
#endif

    // accumulator layout (m64nNk16, f32): warp w of the warpgroup owns rows 16w .. 16w + 15;
    // d[4c + 0..1] = (row g, cols 8c + 2t + 0..1), d[4c + 2..3] = (row g + 8, same cols)
    const int tok0 = m0 + cw * 64 + warp_in_wg * 16 + g;
#pragma unroll
    for (int c = 0; c < 16; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int tok = tok0 + 8 * (i >> 1), n = n0 + 8 * c + 2 * t + (i & 1);
            if (tok < M && n < N) {
                if (WG_SPLITK > 1)
                    atomicAdd(C + (size_t)tok * N + n, d[4 * c + i]);
                else
                    C[(size_t)tok * N + n] = d[4 * c + i];
            }
        }
}
