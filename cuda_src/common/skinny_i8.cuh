// Skinny int8 GEMM for decode (M <= 8): float32 activations x Q4_0 / Q8_0 weights on int8 tensor
// cores (mma.sync m16n8k32 .s8), the weights as the MMA's A operand (16 rows), the tokens on its
// N side (8 columns) -- the int8 sibling of common/skinny_f16.cuh, reading the same packed
// "skinny" weight layout (qgemm.packing), with the same work split (SK_R tiles of 16 rows per CTA,
// SK_WARPS warps splitting the K groups, gridDim.y > 1 splitting K across CTAs with atomics).
//
// Why a second decode kernel: at M = 1 the fp16 kernel spends a third of its time (Q8_0) turning
// weights into fp16 (docs/perf/NOTES.md, session 8 probes). Here a weight word *is* a fragment.
// One m16n8k32 MMA is one 32-value block; with g = lane / 4, t = lane % 4 (PTX ISA, .s8 layouts):
//     A: a0 = row g, k 4t..4t+3   a1 = row g+8, k 4t..4t+3   a2, a3: the same rows, k 16+4t..16+4t+3
//     B: b0 = token g, k 4t..4t+3   b1 = token g, k 16+4t..16+4t+3
//     C: c0, c1 = row g, tokens 2t, 2t+1   c2, c3 = row g+8
// Q8_0: the skinny layout gives lane (g, t) qs words t and t+4 of rows g and g+8: a0..a3 with no
//       instruction at all.
// Q4_0: qs word t holds k 4t..4t+3 in its low nibbles and 16+4t..16+4t+3 in its high nibbles, so
//       a0 = w & 0x0F0F0F0F and a2 = (w >> 4) & 0x0F0F0F0F: the stored nibbles 0..15, and the -8
//       is compensated per block in integers: sum_k (w_k - 8) q_k = sumi - 8 sum_k q_k.
//
// Activations. Each warp quantizes the activations of its own K slice, SK_UNROLL groups (4 blocks,
// 128 values each) per step, loaded one step ahead with the weights: lane l holds, per group,
// values 4(l % 8) .. +3 of block l / 8 as a float4 and, per block of 32 (8 lanes, a 3-step xor butterfly for the max),
//     amax = max |x|,  q = rint(x * (127 / amax))  (IEEE division, round to nearest even),
//     d = amax * fl(1/127)  (one rounding; q = 0 where amax < 2^-118, so 127 / amax stays finite)
// d stays float32 (no half rounding as in Q8_1) and q sums exactly in DP4A, so the per-block
// result d_w d (sumi [- 8 sum q]) has one product rounding -- qgemm.reference.quantize_rows_i8 and
// exact_w4a8s / exact_w8a8s are this arithmetic in numpy. The quantized words go through a
// warp-private shared buffer (two of them, by step parity: one __syncwarp per step, no CTA
// barrier) into the B fragment layout [block][token][t] = {word t, word t + 4}: one LDS.64 per
// lane and block (for one token the 8 lanes of each t read the same 8 bytes: 32 contiguous bytes
// per warp, conflict-free).
//
// Every CTA quantizes the activations of its K range again (at M = 1 and K = 4096: 16 KB read from
// L2 per CTA); the arithmetic is ~6 instructions per value, against ~30 per 16 weights that the fp16
// kernel spends dequantizing, per 16-row tile. More tokens multiply the first and not the second,
// which is why qgemm.matmul uses it at M = 1 only (qgemm.dispatch.SKINNY_I8_MAX_M: from two tokens
// the fp16 kernel measured faster); up to 8 tokens it runs by path=.
//
// Configuration (-D): SK_R, SK_WARPS, SK_UNROLL as in skinny_f16.cuh; SK_MQ = tokens compiled for
// (1, 2, 4, 8; M <= SK_MQ); SK_PRIME (below); SK_PDL_EARLY as in skinny_f16.cuh (default here:
// trigger after the main loop; the launcher sets 1 at M = 1, where the trigger at entry measured
// faster cold and no slower hot: qgemm.registry._skinny_i8_pdl_early).
#pragma once
#include "common/mma_gemm.cuh"
#include "common/pdl.cuh"

#ifndef SK_R
#define SK_R 1
#endif
#ifndef SK_WARPS
#define SK_WARPS 8
#endif
#ifndef SK_UNROLL
#define SK_UNROLL 2
#endif
#ifndef SK_MQ
#define SK_MQ 1
#endif
#if SK_MQ != 1 && SK_MQ != 2 && SK_MQ != 4 && SK_MQ != 8
#error "SK_MQ must be 1, 2, 4 or 8"
#endif
#ifndef SK_PDL_EARLY
#define SK_PDL_EARLY 0
#endif
// SK_PRIME: 1 requests the weights of the first two steps (both pipelined sets) before the PDL
// wait, so a CTA that starts while the previous kernel finishes has two steps in flight instead
// of one; the next set is then requested after a step is computed rather than before. For a lane
// that streams one group per step (SK_UNROLL = 1) the launcher sets it (qgemm.registry:
// _skinny_i8_prime for Q8_0 at M = 1, K < 8192; _x16_config for the float16 / bfloat16 Q4_0
// variants at M = 1). With two groups per step it requests four groups per warp
// before the wait -- at K = 4096 the warp's whole slice -- and measured slower: the next op's
// loads then crowd out this op's (Q4_0 1x4096x4096 cold 4.05 -> 4.38 us).
#ifndef SK_PRIME
#define SK_PRIME 0
#endif
// token slots of the scale rows: a lane reads tokens 2t, 2t + 1 (at SK_MQ = 1 the second slot is
// padding only: that path reads slot 0 for both of a lane's columns)
#define SK_MQP (SK_MQ < 2 ? 2 : SK_MQ)
#include "common/skinny_common.cuh"

struct SkI8Q4_0 {
    static constexpr int PIECES = 2;  // 16-byte pieces per lane per (tile, group): rows g, g + 8
    static constexpr bool OFFSET8 = true;
    static __device__ __forceinline__ void frags(const uint4 (&q)[PIECES], int j, int (&a)[4]) {
        const unsigned w0 = (&q[0].x)[j], w1 = (&q[1].x)[j];  // qs word t of block j, rows g and g + 8
        a[0] = (int)(w0 & 0x0F0F0F0Fu);
        a[1] = (int)(w1 & 0x0F0F0F0Fu);
        a[2] = (int)((w0 >> 4) & 0x0F0F0F0Fu);
        a[3] = (int)((w1 >> 4) & 0x0F0F0F0Fu);
    }
};

struct SkI8Q8_0 {
    static constexpr int PIECES = 4;  // piece 2h + p: row g + 8h, blocks 2p and 2p + 1, words t and t + 4
    static constexpr bool OFFSET8 = false;
    static __device__ __forceinline__ void frags(const uint4 (&q)[PIECES], int j, int (&a)[4]) {
        const int s = 2 * (j & 1);
        a[0] = (int)(&q[j / 2].x)[s];
        a[1] = (int)(&q[2 + j / 2].x)[s];
        a[2] = (int)(&q[j / 2].x)[s + 1];
        a[3] = (int)(&q[2 + j / 2].x)[s + 1];
    }
};

// d_w (row g + 8h, block j) of the scale piece (halves 4h + j) as float
static __device__ __forceinline__ float sk_dw(const uint4& dq, int h, int j) {
    return __half2float(reinterpret_cast<const __half*>(&dq)[4 * h + j]);
}

template <typename SF>
static __device__ __forceinline__ void skinny_i8(const sk_x_t* __restrict__ X, const unsigned char* __restrict__ Wp,
                                                 float* __restrict__ C, int M, int N, int K) {
    __shared__ float red[SK_WARPS][SK_R * 4][32];
    // per warp, per step parity: quantized activations as B fragments, and {d, sum q} per block and token
    __shared__ uint2 xq_s[SK_WARPS][2][SK_UNROLL][4][SK_MQ][4];
    __shared__ float2 xd_s[SK_WARPS][2][SK_UNROLL][4][SK_MQP];
#if SK_PDL_EARLY
    pdl_launch_dependents();
#endif
    const SkSlice<SF::PIECES> sl(Wp, N, K);
    const int lane = sl.lane, warp = sl.warp, g = sl.g, t = sl.t, nb = sl.nb, tile0 = sl.tile0, gb = sl.gb, ge = sl.ge;
    const int mrow = min(g, M - 1);  // the B fragment's token; rows >= M are never stored
    // this lane's quantization slot: block jl of a group, qs word wl (values 4 wl .. 4 wl + 3)
    const int jl = lane / 8, wl = lane % 8;

    float acc[SK_R][4];
#pragma unroll
    for (int r = 0; r < SK_R; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][i] = 0.0f;

    // Software pipeline as in skinny_f16.cuh: set A computes while set B's loads are in flight,
    // the loop body written out twice (a register move of a load in flight would wait for it).
    typedef typename SkSlice<SF::PIECES>::WSet WSet;
    typedef typename SkSlice<SF::PIECES>::DSet DSet;
    typedef SkXT::raw XSet[SK_UNROLL][SK_MQ];
    auto load_w = [&](WSet& wq, DSet& wd, int G) { sl.load(wq, wd, G); };
    // Blocks past K (the last group's padding) re-read block nb - 1: finite values whose weights
    // are d = 0, so they add exactly 0.
    auto load_x = [&](XSet& xv, int G) {
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u) {
            const int b = min(min(G + u, ge - 1) * 4 + jl, nb - 1);
#pragma unroll
            for (int m = 0; m < SK_MQ; ++m)
                if (SK_MQ == 1 || m < M) xv[u][m] = SkXT::load(X + (size_t)m * K + b * QK + 4 * wl);
        }
    };
    auto quantize = [&](const XSet& xv, int par) {
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u)
#pragma unroll
            for (int m = 0; m < SK_MQ; ++m) {
                if (SK_MQ > 1 && m >= M) break;  // warp-uniform (M >= 1 always)
                const float4 v = SkXT::f4(xv[u][m]);
                // NaN-propagating: a NaN value makes d NaN (and id 0), so the block's products are NaN
                // instead of the code 0 that fmaxf would leave it (the host check never sees device x)
                float amax = qg_fmax_nan(qg_fmax_nan(fabsf(v.x), fabsf(v.y)), qg_fmax_nan(fabsf(v.z), fabsf(v.w)));
#pragma unroll
                for (int o = 1; o < 8; o <<= 1) amax = qg_fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                // one IEEE division per block and lane (its slow path is a call), the scale by a multiply
                const float id = amax >= 0x1p-118f ? __fdiv_rn(127.0f, amax) : 0.0f;
                const float d = __fmul_rn(amax, 0x1.020408p-7f);  // fl(1/127), exactly as the reference
                const int q0 = __float2int_rn(__fmul_rn(v.x, id)), q1 = __float2int_rn(__fmul_rn(v.y, id));
                const int q2 = __float2int_rn(__fmul_rn(v.z, id)), q3 = __float2int_rn(__fmul_rn(v.w, id));
                // q0..q3's low bytes into one word, q0 in byte 0 (PRMT 0x0040: byte 0 of each of two
                // ints; 0x5410: the two low halves). Word wl of the block goes to slot wl % 4, half
                // wl / 4, so slot t holds {word t, word t + 4}: the B fragment {b0, b1} of lane (g, t)
                const unsigned word = __byte_perm(__byte_perm(q0, q1, 0x0040), __byte_perm(q2, q3, 0x0040), 0x5410);
                reinterpret_cast<unsigned*>(&xq_s[warp][par][u][jl][m][wl % 4])[wl / 4] = word;
                int sum = 0;
                if (SF::OFFSET8) {  // the block's integer sum of q, for the -8 of Q4_0
                    sum = __dp4a((int)word, 0x01010101, 0);
#pragma unroll
                    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
                }
                if (wl == 0) xd_s[warp][par][u][jl][m] = make_float2(d, __int_as_float(sum));
            }
        __syncwarp();  // the writes above before any lane reads them; the buffer of the other parity
                       // is only rewritten after the next step's __syncwarp
    };
    auto compute = [&](const WSet& wq, const DSet& wd, int G, int par) {
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u) {
            if (G + u >= ge) break;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint2 bq = xq_s[warp][par][u][j][mrow][t];
                const float2 x0 = xd_s[warp][par][u][j][SK_MQ == 1 ? 0 : min(2 * t, M - 1)];
                const float2 x1 = SK_MQ == 1 ? x0 : xd_s[warp][par][u][j][min(2 * t + 1, M - 1)];
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

    WSet wqA, wqB;
    DSet wdA, wdB;
    XSet xA, xB;
    if (gb < ge) load_w(wqA, wdA, gb);  // in flight while the previous kernel finishes (PDL)
    if (SK_PRIME && gb + SK_UNROLL < ge) load_w(wqB, wdB, gb + SK_UNROLL);
    // The weights are the only memory read above this line (no kernel of an op chain writes them);
    // X and C only after the wait (common/pdl.cuh).
    pdl_wait();
    if (gb < ge) load_x(xA, gb);
    if (SK_PRIME && gb + SK_UNROLL < ge) load_x(xB, gb + SK_UNROLL);
    for (int G = gb; G < ge; G += 2 * SK_UNROLL) {
        if (!SK_PRIME && G + SK_UNROLL < ge) {
            load_w(wqB, wdB, G + SK_UNROLL);
            load_x(xB, G + SK_UNROLL);
        }
        quantize(xA, 0);
        compute(wqA, wdA, G, 0);
        if (G + SK_UNROLL >= ge) break;
        if (G + 2 * SK_UNROLL < ge) {
            load_w(wqA, wdA, G + 2 * SK_UNROLL);
            load_x(xA, G + 2 * SK_UNROLL);
        }
        quantize(xB, 1);
        compute(wqB, wdB, G + SK_UNROLL, 1);
        if (SK_PRIME && G + 3 * SK_UNROLL < ge) {
            load_w(wqB, wdB, G + 3 * SK_UNROLL);
            load_x(xB, G + 3 * SK_UNROLL);
        }
    }

    // C fragment: acc[r][0..1] -> W row g, tokens 2t, 2t+1; acc[r][2..3] -> row g + 8
    sk_reduce_store<1>(red, [&](int r, int, int i) { return acc[r][i]; }, C, M, N, tile0);
}
