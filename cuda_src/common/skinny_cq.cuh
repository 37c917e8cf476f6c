// Skinny int8 GEMM for small batches on Hopper (sm_90): common/skinny_i8.cuh's kernel -- float32
// activations quantized to int8 per 32-block by the kernel, Q4_0 / Q8_0 weights in the packed skinny
// layout as the A operand of mma.sync m16n8k32 .s8, the tokens on its N side -- with the
// quantization done once per thread block cluster instead of once per CTA.
//
// Why: in skinny_i8.cuh every CTA quantizes all M rows of its K range, and each of the ~256 CTAs of
// an N = 4096 op does it again: at M = 8 that made the kernel 2-3x slower than the fp16 one
// (docs/perf/NOTES.md, session 9), and quantizing in a separate kernel (quantize.q8_1 +
// skinny_q8_1.cuh) costs a kernel boundary of ~2.4 us that a 5 us op cannot hide (session 10).
// The CTAs of a cluster (neighbouring 16-row tiles, the same K range) share the work instead:
//
//   1. at entry each CTA announces it has started (barrier.cluster.arrive.relaxed) and issues its
//      first weight loads (PDL: the weights are the only memory read above pdl_wait);
//   2. CTA `rank` of the cluster's C quantizes blocks [rank nblk / C, (rank + 1) nblk / C) of the
//      CTA's K range for every token -- a warp item is one block x 4 tokens, lane (token quad
//      member lane / 8, qs word lane % 8), the arithmetic of skinny_i8.cuh (sk_quantize8) -- and
//      stores each int8 word and each block's {d, sum q} into the shared memory of all C CTAs
//      (st.shared::cluster after barrier.cluster.wait: a CTA's shared memory may only be written
//      once it runs);
//   3. one cluster barrier (arrive.release / wait.acquire) and every CTA holds its whole K range's
//      B fragments, [block][token][t] = {qs word t, qs word t + 4} (one conflict-free LDS.64 per
//      lane and block) and [block][token] = {d, sum q} (a broadcast LDS.64 per token pair);
//   4. the main loop of skinny_i8.cuh without its per-step quantization: weights streamed into
//      registers (two pipelined sets), one MMA per block and tile, the same float32 epilogue in the
//      same order -- so the result is bitwise that of skinny_i8.cuh at the same SK_R / SK_WARPS /
//      SK_UNROLL, and qgemm.reference.exact_w4a8s / exact_w8a8s are its exact reference.
//
// The cluster size is read from %cluster_nctarank at run time, so any launch is correct (a plain
// launch is a cluster of one: each CTA quantizes everything itself); the registry launches clusters
// of SK_CQ CTAs along x (grid.x rounded up to a multiple: the extra CTAs re-read the last tile and
// store nothing, but quantize their share). Per CTA each lane stores (words quantized) x C: the
// remote stores are the same count whatever C, the float32 loads and the arithmetic shrink by C.
//
// Shared memory (dynamic): 4 (groups of the CTA's K range) x (SK_MQ x 32 + SK_MQP x 8) bytes.
//
// Configuration (-D): SK_R, SK_WARPS, SK_UNROLL, SK_MQ, SK_MINB as in skinny_i8.cuh; SK_CQ, the
// launch's cluster size, is read by the launcher only; SK_PDL_EARLY as in skinny_f16.cuh.
#pragma once
#include "common/skinny_i8.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "skinny_cq.cuh needs thread block clusters (sm_90)"
#endif

static __device__ __forceinline__ unsigned sk_cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

static __device__ __forceinline__ unsigned sk_cluster_size() {
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}

// Stores into the shared memory of CTA `rank` of the cluster, at the offset `saddr` has in this CTA's.
static __device__ __forceinline__ void sk_st_cluster(unsigned saddr, unsigned rank, unsigned v) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(saddr), "r"(rank));
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(v) : "memory");
}

static __device__ __forceinline__ void sk_st_cluster2(unsigned saddr, unsigned rank, float2 v) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(saddr), "r"(rank));
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(remote), "f"(v.x), "f"(v.y) : "memory");
}

// items (one block x 4 tokens) a warp quantizes per round: their float4 loads issued together
#define SK_CQ_BATCH 4

template <typename SF>
static __device__ __forceinline__ void skinny_cq(const float* __restrict__ X, const unsigned char* __restrict__ Wp,
                                                 float* __restrict__ C, int M, int N, int K) {
    __shared__ float red[SK_WARPS][SK_R * 4][32];
    extern __shared__ uint2 sk_xq[];  // [block][SK_MQ][4] B fragments, then float2 [block][SK_MQP] {d, sum q}
#if SK_PDL_EARLY
    pdl_launch_dependents();
#endif
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");  // this CTA runs: its shared memory may be written
    const SkSlice<SF::PIECES> sl(Wp, N, K);
    const int lane = sl.lane, warp = sl.warp, g = sl.g, t = sl.t, nb = sl.nb, tile0 = sl.tile0, gb = sl.gb, ge = sl.ge;
    const int mrow = min(g, M - 1);  // the B fragment's token; rows >= M are never stored
    // the CTA's K range: the union of its warps' (SkSlice), the same in every CTA of the cluster
    const int cgb = split_point(sl.ngroups, blockIdx.y * SK_WARPS, gridDim.y * SK_WARPS);
    const int cge = split_point(sl.ngroups, (blockIdx.y + 1) * SK_WARPS, gridDim.y * SK_WARPS);
    const int nblk = 4 * (cge - cgb);
    float2* xd_s = reinterpret_cast<float2*>(sk_xq + (size_t)nblk * SK_MQ * 4);

    float acc[SK_R][4];
#pragma unroll
    for (int r = 0; r < SK_R; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][i] = 0.0f;

    typedef typename SkSlice<SF::PIECES>::WSet WSet;
    typedef typename SkSlice<SF::PIECES>::DSet DSet;
    WSet wqA, wqB;
    DSet wdA, wdB;
    if (gb < ge) sl.load(wqA, wdA, gb);  // in flight while the previous kernel finishes (PDL) and below
    // The weights are the only memory read above this line; X and C only after the wait (common/pdl.cuh).
    pdl_wait();

    {  // this CTA's share of the cluster's quantization
        const unsigned crank = sk_cluster_rank(), csize = sk_cluster_size();
        const int b0 = split_point(nblk, crank, csize), b1 = split_point(nblk, crank + 1, csize);
        const int quads = (M + 3) / 4, items = (b1 - b0) * quads;
        const int mq = lane / 8, wl = lane % 8;
        const unsigned xq_base = (unsigned)__cvta_generic_to_shared(sk_xq);
        const unsigned xd_base = (unsigned)__cvta_generic_to_shared(xd_s);
        asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every CTA of the cluster runs
        for (int i0 = warp; i0 < items; i0 += SK_WARPS * SK_CQ_BATCH) {
            float4 v[SK_CQ_BATCH];
#pragma unroll
            for (int s = 0; s < SK_CQ_BATCH; ++s) {
                const int it = min(i0 + s * SK_WARPS, items - 1);  // past the last item: a finite re-read, not stored
                const int blk = b0 + it / quads, m = min((it % quads) * 4 + mq, M - 1);
                // blocks past K (the last group's padding) quantize block nb - 1: their weights have d = 0
                const int b = min(4 * cgb + blk, nb - 1);
                v[s] = __ldg(reinterpret_cast<const float4*>(X + (size_t)m * K + (size_t)b * QK + 4 * wl));
            }
#pragma unroll
            for (int s = 0; s < SK_CQ_BATCH; ++s) {
                const int it = i0 + s * SK_WARPS;
                if (it >= items) break;  // warp-uniform
                float d;
                int sum;
                const unsigned word = sk_quantize8<SF::OFFSET8>(v[s], d, sum);
                const int blk = b0 + it / quads, m = (it % quads) * 4 + mq;
                if (m < M) {
                    const unsigned a = xq_base + (unsigned)(((blk * SK_MQ + m) * 4 + wl % 4) * 8 + (wl / 4) * 4);
                    const unsigned ad = xd_base + (unsigned)((blk * SK_MQP + m) * 8);
                    for (unsigned r = 0; r < csize; ++r) {
                        sk_st_cluster(a, r, word);
                        if (wl == 0) sk_st_cluster2(ad, r, make_float2(d, __int_as_float(sum)));
                    }
                }
            }
        }
        // every CTA's stores into every CTA before any reads (and none after: a CTA may then exit)
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    }

    // skinny_i8.cuh's MMAs and epilogue, the B fragments and scales of block G * 4 + j from shared memory
    auto compute = [&](const WSet& wq, const DSet& wd, int G) {
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u) {
            if (G + u >= ge) break;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int blk = (G + u - cgb) * 4 + j;
                const uint2 bq = sk_xq[(blk * SK_MQ + mrow) * 4 + t];
                const float2 x0 = xd_s[blk * SK_MQP + (SK_MQ == 1 ? 0 : min(2 * t, M - 1))];
                const float2 x1 = SK_MQ == 1 ? x0 : xd_s[blk * SK_MQP + min(2 * t + 1, M - 1)];
#pragma unroll
                for (int r = 0; r < SK_R; ++r) {
                    int a[4], c[4] = {0, 0, 0, 0};
                    SF::frags(wq[u][r], j, a);
                    mma_s8(c, a[0], a[1], a[2], a[3], (int)bq.x, (int)bq.y);
                    if (SF::OFFSET8) {
                        const int s0 = __float_as_int(x0.y), s1 = __float_as_int(x1.y);
                        c[0] -= 8 * s0, c[2] -= 8 * s0, c[1] -= 8 * s1, c[3] -= 8 * s1;
                    }
                    const float dw0 = sk_dw(wd[u][r], 0, j), dw1 = sk_dw(wd[u][r], 1, j);
                    acc[r][0] = fmaf((float)c[0], dw0 * x0.x, acc[r][0]);
                    acc[r][2] = fmaf((float)c[2], dw1 * x0.x, acc[r][2]);
                    if (SK_MQ > 1) {  // one token: the lanes' second column (token 2t + 1 >= 1) is never stored
                        acc[r][1] = fmaf((float)c[1], dw0 * x1.x, acc[r][1]);
                        acc[r][3] = fmaf((float)c[3], dw1 * x1.x, acc[r][3]);
                    }
                }
            }
        }
    };

    for (int G = gb; G < ge; G += 2 * SK_UNROLL) {
        if (G + SK_UNROLL < ge) sl.load(wqB, wdB, G + SK_UNROLL);
        compute(wqA, wdA, G);
        if (G + SK_UNROLL >= ge) break;
        if (G + 2 * SK_UNROLL < ge) sl.load(wqA, wdA, G + 2 * SK_UNROLL);
        compute(wqB, wdB, G + SK_UNROLL);
    }

    // C fragment: acc[r][0..1] -> W row g, tokens 2t, 2t+1; acc[r][2..3] -> row g + 8
    sk_reduce_store<1>(red, [&](int r, int, int i) { return acc[r][i]; }, C, M, N, tile0);
}
