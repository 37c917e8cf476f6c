// Skinny int8 GEMM for small batches (2 <= M <= 32): Q8_1 activations (ggml's bytes, made once per
// op by quantize.q8_1) x Q4_0 / Q8_0 weights in the packed skinny layout, on int8 tensor cores
// (mma.sync m16n8k32 .s8) with the weights as the A operand and the tokens on the N side: the
// math of llama.cpp's vec_dot_q4_0_q8_1 / vec_dot_q8_0_q8_1, the work split of common/skinny_i8.cuh.
//
// Why a third decode kernel: common/skinny_i8.cuh quantizes the float32 activations inside every
// CTA. At M = 1 that is cheap; with 8 tokens every one of the ~256 CTAs quantizes all 8 rows of its
// K range again (256x the work of quantizing them once) and the kernel ran 2-3x slower than the
// fp16 one (docs/perf/NOTES.md, session 9). Here the quantization happens once, in the prologue
// kernel, and what is left per weight is what the M = 1 kernel does: the packed words are the A
// fragments, and one MMA covers up to 8 tokens for the price of one -- the n8 side that M = 1
// leaves 7/8 empty.
//
// B fragments straight from the Q8_1 blocks (36 B: half d, half s, int8 qs[32]; qs at byte 4, so
// every qs word is 4-byte aligned): lane (g, t) needs token g's qs words t and t + 4 of the block
// (k 4t..4t+3 and 16+4t..16+4t+3, as common/skinny_i8.cuh draws it), i.e. 32-bit words 1 + t and
// 5 + t of the block; its C fragment columns are tokens 2t and 2t + 1, whose (d, s) half pair is
// word 0 of their blocks. Per block and 8-token tile a lane issues four 4-byte loads; the rows of
// tokens >= M read token M - 1 (finite, never stored).
//
// Per block, with sumi the MMA's int32 (Q4_0: the stored nibbles 0..15 times q_a):
//     Q4_0:  acc += d_w * (d_a * sumi - 8 * s_a)      (s_a: the half-rounded sum of the block's x)
//     Q8_0:  acc += (d_w * d_a) * sumi
// in float32 -- qgemm.reference.exact_w4a8 / exact_w8a8 are this in float64, as for the DP4A
// kernels and w4a8.gemv (tight tolerance).
//
// Configuration (-D): SK_R, SK_WARPS, SK_UNROLL as in common/skinny_f16.cuh; SK_MT = 8-token tiles
// (1, 2, 4: M <= 8 SK_MT); SK_PDL_EARLY as in common/skinny_f16.cuh (default 0: trigger after the
// main loop; measured against 1 and against a quantize.q8_1 without trigger, docs/perf/NOTES.md).
#pragma once
#include "common/skinny_i8.cuh"
#include "common/blocks.cuh"

#ifndef SK_MT
#define SK_MT 1
#endif
#if SK_MT != 1 && SK_MT != 2 && SK_MT != 4
#error "SK_MT must be 1, 2 or 4"
#endif

template <typename SF>
static __device__ __forceinline__ void skinny_q8_1(const block_q8_1* __restrict__ X, const unsigned char* __restrict__ Wp,
                                                   float* __restrict__ C, int M, int N, int K) {
    __shared__ float red[SK_WARPS][SK_R * SK_MT * 4][32];
#if SK_PDL_EARLY
    pdl_launch_dependents();
#endif
    const SkSlice<SF::PIECES> sl(Wp, N, K);
    const int g = sl.g, t = sl.t, nb = sl.nb, tile0 = sl.tile0, gb = sl.gb, ge = sl.ge;
    // the 32-bit words of this lane's token rows: B fragment token g + 8 nt, scale tokens 8 nt + 2t (+1)
    const unsigned* xb[SK_MT];
    const unsigned* xs0[SK_MT];
    const unsigned* xs1[SK_MT];
#pragma unroll
    for (int nt = 0; nt < SK_MT; ++nt) {
        const unsigned* x = reinterpret_cast<const unsigned*>(X);
        xb[nt] = x + (size_t)min(8 * nt + g, M - 1) * nb * 9;
        xs0[nt] = x + (size_t)min(8 * nt + 2 * t, M - 1) * nb * 9;
        xs1[nt] = x + (size_t)min(8 * nt + 2 * t + 1, M - 1) * nb * 9;
    }

    float acc[SK_R][SK_MT][4];
#pragma unroll
    for (int r = 0; r < SK_R; ++r)
#pragma unroll
        for (int nt = 0; nt < SK_MT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[r][nt][i] = 0.0f;

    // Software pipeline as in skinny_f16.cuh: set A computes while set B's loads are in flight.
    typedef typename SkSlice<SF::PIECES>::WSet WSet;
    typedef typename SkSlice<SF::PIECES>::DSet DSet;
    typedef uint4 XSet[SK_UNROLL][4][SK_MT];  // {qs word t, qs word t + 4, (d, s) of token 2t, of 2t + 1}
    // Blocks past K (the last group's padding) re-read block nb - 1: finite, and their weights have
    // d = 0, so they add exactly 0.
    auto load_x = [&](XSet& xv, int G) {
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int b9 = min(min(G + u, ge - 1) * 4 + j, nb - 1) * 9;
#pragma unroll
                for (int nt = 0; nt < SK_MT; ++nt)
                    xv[u][j][nt] = make_uint4(__ldg(xb[nt] + b9 + 1 + t), __ldg(xb[nt] + b9 + 5 + t), __ldg(xs0[nt] + b9),
                                              __ldg(xs1[nt] + b9));
            }
    };
    auto compute = [&](const WSet& wq, const DSet& wd, const XSet& xv, int G) {
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u) {
            if (G + u >= ge) break;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int r = 0; r < SK_R; ++r) {
                    int a[4];
                    SF::frags(wq[u][r], j, a);
                    const float dw0 = sk_dw(wd[u][r], 0, j), dw1 = sk_dw(wd[u][r], 1, j);
#pragma unroll
                    for (int nt = 0; nt < SK_MT; ++nt) {
                        const uint4 x = xv[u][j][nt];
                        int c[4] = {0, 0, 0, 0};
                        mma_s8(c, a[0], a[1], a[2], a[3], (int)x.x, (int)x.y);
                        const float2 ds0 = __half22float2(*reinterpret_cast<const __half2*>(&x.z));
                        const float2 ds1 = __half22float2(*reinterpret_cast<const __half2*>(&x.w));
                        float* o = acc[r][nt];
                        if (SF::OFFSET8) {
                            // d_w (d_a sumi - 8 s_a), rows g (dw0) and g + 8 (dw1), tokens 2t (ds0) and 2t + 1 (ds1)
                            o[0] = fmaf(dw0, fmaf(ds0.x, (float)c[0], -8.0f * ds0.y), o[0]);
                            o[1] = fmaf(dw0, fmaf(ds1.x, (float)c[1], -8.0f * ds1.y), o[1]);
                            o[2] = fmaf(dw1, fmaf(ds0.x, (float)c[2], -8.0f * ds0.y), o[2]);
                            o[3] = fmaf(dw1, fmaf(ds1.x, (float)c[3], -8.0f * ds1.y), o[3]);
                        } else {
                            o[0] = fmaf((float)c[0], dw0 * ds0.x, o[0]);
                            o[1] = fmaf((float)c[1], dw0 * ds1.x, o[1]);
                            o[2] = fmaf((float)c[2], dw1 * ds0.x, o[2]);
                            o[3] = fmaf((float)c[3], dw1 * ds1.x, o[3]);
                        }
                    }
                }
        }
    };

    WSet wqA, wqB;
    DSet wdA, wdB;
    XSet xA, xB;
    if (gb < ge) sl.load(wqA, wdA, gb);  // in flight while the prologue finishes (PDL)
    // The weights are the only memory read above this line: X (the prologue's output) and C only
    // after the wait (common/pdl.cuh).
    pdl_wait();
    if (gb < ge) load_x(xA, gb);
    for (int G = gb; G < ge; G += 2 * SK_UNROLL) {
        if (G + SK_UNROLL < ge) {
            sl.load(wqB, wdB, G + SK_UNROLL);
            load_x(xB, G + SK_UNROLL);
        }
        compute(wqA, wdA, xA, G);
        if (G + SK_UNROLL >= ge) break;
        if (G + 2 * SK_UNROLL < ge) {
            sl.load(wqA, wdA, G + 2 * SK_UNROLL);
            load_x(xA, G + 2 * SK_UNROLL);
        }
        compute(wqB, wdB, xB, G + SK_UNROLL);
    }

    // C fragment: acc[r][nt][0..1] -> W row g, tokens 8 nt + 2t, + 1; acc[r][nt][2..3] -> row g + 8
    sk_reduce_store<SK_MT>(red, [&](int r, int nt, int i) { return acc[r][nt][i]; }, C, M, N, tile0);
}
