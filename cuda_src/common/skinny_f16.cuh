// Skinny GEMM for decode and small batches (M <= 64): float32 activations x Q4_0 / Q8_0 weights
// on fp16 tensor cores with the operands swapped -- the weights are the MMA's A operand (16 rows
// of W per fragment) and the tokens its N side (8 per fragment), so M = 1 wastes 7/8 of an MMA
// that costs nothing next to the weight bytes, instead of 15/16 of every A fragment.
//
// Weights come in the "skinny" layout made once by qgemm.packing (one device buffer):
//
//   qs: [tile = 16 rows][group = 4 blocks = 128 K][16-byte piece][lane]     (32 lanes x 16 B = 512 B)
//       Q4_0: pieces h = 0, 1 -> rows g + 8h (g = lane / 4, t = lane % 4); the 16 bytes are
//             qs word t (bytes 4t..4t+3) of the group's blocks 0..3
//       Q8_0: pieces 2h + p -> rows g + 8h, blocks 2p and 2p + 1; per block qs words t and t + 4
//   d:  [tile][group][g][8 halves]  -> d(row g + 8h, block j) at half index 4h + j
//
// so every weight byte is read once, by one lane, in 16-byte coalesced loads (a warp load is
// 512 contiguous bytes), with no alignment question (ggml blocks are 18 / 34 bytes).
//
// The k permutation. An MMA sums over its 16 k values, so any bijection between the fragment's
// logical k and the physical K index, applied to both operands, gives the same sum. The
// fragment wants, for lane (g, t), logical k pairs (2t, 2t+1) and (2t+8, 2t+9) of each k16 step
// (PTX mma.m16n8k16 A and B layouts). Map step s of block b to
//     (2t, 2t+1) -> physical 32b + 16s + 4t + (0, 2),   (2t+8, 2t+9) -> 32b + 16s + 4t + (1, 3).
// Then a lane's weights are whole qs words (for Q4_0, word t of a block holds physical 4t..4t+3 in
// its low nibbles and 16+4t..16+4t+3 in its high nibbles: both k-steps from one word), and its
// activations are two float4 loads per block, x[32b + 4t ..] and x[32b + 16 + 4t ..], each
// giving the b0 = (x, z) and b1 = (y, w) halves of a B fragment. The pairing of bytes 0 and 2
// (1 and 3) is what makes the dequantization cheap:
//
// Dequantization (frags below) is the magic-number one of common/mma_f16.cuh (dq_q4_lo / dq_q4_hi /
// dq_q8: one LOP3 per byte pair, exact integer arithmetic, one HMUL2 by d with the scale broadcast
// by HMUL2's operand selector), so d (q - 8) or d q is rounded once to fp16; per half pair 1.25
// (Q4_0) or 1.5 (Q8_0) instructions of extraction + 2 of arithmetic. Activations are rounded to
// fp16 in registers (cvt.rn), the MMAs accumulate in fp32: qgemm.reference.exact_w4a16s models
// exactly this.
//
// Work split: a CTA owns SK_R tiles (16 SK_R rows of W) and SK_MT 8-token fragments; its SK_WARPS
// warps split the K groups and are summed through shared memory; gridDim.y > 1 splits K across
// CTAs too, and those add into C with atomics (the launcher zeroes C first). With SK_XSMEM (one
// token fragment, M <= 8) the CTA first stages its activations in shared memory as ready-made
// fp16 B fragments, so no global activation load ever sits in front of an MMA. Each lane keeps
// SK_UNROLL groups of weight loads in flight while it computes the previous SK_UNROLL (two
// register sets, software-pipelined), so enough bytes are in flight per SM.
#pragma once
#include "common/mma_f16.cuh"
#include "common/pdl.cuh"

#ifndef SK_R
#define SK_R 2
#endif
#ifndef SK_MT
#define SK_MT 1
#endif
#ifndef SK_WARPS
#define SK_WARPS 4
#endif
#ifndef SK_UNROLL
#define SK_UNROLL 2
#endif
#ifndef SK_ACC
#define SK_ACC 1  // accumulator sets (1 or 2): see acc below
#endif
#if SK_ACC != 1 && SK_ACC != 2
#error "SK_ACC must be 1 or 2"
#endif
#ifndef SK_XSMEM
#define SK_XSMEM 0  // 1 (SK_MT == 1 only): stage the CTA's activations in shared memory as fp16 fragments
#endif
#if SK_XSMEM && SK_MT != 1
#error "SK_XSMEM needs SK_MT == 1"
#endif
// When the next kernel in the stream may launch (programmatic dependent launch, common/pdl.cuh):
// it then streams its own weights until this grid completes. 1: at entry, so it is launched as
// soon as it fits; 0: once this CTA's main loop is done. Measured on the H100 (docs/perf/NOTES.md,
// back-to-back ops): at M = 1 (64-74 registers, so two more CTAs per SM fit beside this kernel's)
// an entry trigger lets the next kernel -- and, since it triggers at its entry too, the one after
// -- flood the memory system with prefetches ahead of this kernel's own loads: 6.1 us per op
// (Q4_0 1x4096x4096) against 5.1 for the late trigger. At M = 8 (~93 registers: nothing else fits
// until a CTA leaves) the earliest trigger is best: 5.5 against 5.8.
#ifndef SK_PDL_EARLY
#define SK_PDL_EARLY (!SK_XSMEM)
#endif

#include "common/skinny_common.cuh"

// d (row g + 8h, block j) broadcast to both halves: j's half of the scale word, as an HMUL2 operand selector
static __device__ __forceinline__ __half2 sk_scale(const uint4& dq, int h, int j) {
    const unsigned dw = (&dq.x)[2 * h + j / 2];
    return (j & 1) ? __high2half2(as_h2(dw)) : __low2half2(as_h2(dw));
}

struct SkQ4_0 {
    static constexpr int PIECES = 2;  // 16-byte pieces per lane per (tile, group)
    // weights of block j (0..3) of the group, rows g (h = 0) and g + 8 (h = 1): the A fragments
    // of its two k-steps. Word w's bytes [b0 b1 b2 b3]: (b0, b2) and (b1, b3) are the pairs.
    static __device__ __forceinline__ void frags(const uint4 (&q)[PIECES], const uint4& dq, int j, unsigned (&a)[2][4]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned w = (&q[h].x)[j];
            const __half2 d2 = sk_scale(dq, h, j);
            // A regs: {row g pair 0, row g+8 pair 0, row g pair 1, row g+8 pair 1}; step 1 = high nibbles
            a[0][h] = dq_q4_lo(w, d2);
            a[0][2 + h] = dq_q4_lo(w >> 8, d2);
            a[1][h] = dq_q4_hi(w, d2);
            a[1][2 + h] = dq_q4_hi(w >> 8, d2);
        }
    }
};

struct SkQ8_0 {
    static constexpr int PIECES = 4;
    static __device__ __forceinline__ void frags(const uint4 (&q)[PIECES], const uint4& dq, int j, unsigned (&a)[2][4]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4& piece = q[2 * h + j / 2];
            const __half2 d2 = sk_scale(dq, h, j);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const unsigned w = (&piece.x)[2 * (j & 1) + s];  // word t (s = 0), t + 4 (s = 1)
                a[s][h] = dq_q8(w, d2);
                a[s][2 + h] = dq_q8(w >> 8, d2);
            }
        }
    }
};

static __device__ __forceinline__ unsigned f2_to_h2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

template <typename SF>
static __device__ __forceinline__ void skinny_f16(const sk_x_t* __restrict__ X, const unsigned char* __restrict__ Wp,
                                                  float* __restrict__ C, int M, int N, int K) {
    __shared__ float red[SK_WARPS][SK_R * SK_MT * 4][32];
#if SK_PDL_EARLY
    pdl_launch_dependents();  // see SK_PDL_EARLY
#endif
    const SkSlice<SF::PIECES> sl(Wp, N, K);
    const int lane = sl.lane, warp = sl.warp, g = sl.g, t = sl.t, nb = sl.nb, ngroups = sl.ngroups;
    const int tile0 = sl.tile0, gb = sl.gb, ge = sl.ge;

    // B operand rows: token 8 nt + g; rows >= M read row M - 1 and their results are never stored
    const sk_x_t* xrow[SK_MT];
#pragma unroll
    for (int nt = 0; nt < SK_MT; ++nt) xrow[nt] = X + (size_t)min(nt * 8 + g, M - 1) * K + 4 * t;

#if SK_XSMEM
    // The CTA's activations, read once with coalesced float4 loads, rounded to fp16 and stored as
    // the B fragments themselves: for block b (relative to the CTA's first), k-step s, token row
    // r < M and t, one 8-byte {b0, b1} -- so a lane's fragment is one conflict-free LDS.64 and
    // the loop below never waits on a global activation load. Rows >= M are not stored: lanes
    // of those rows read row M - 1 (results never stored), which is a broadcast for M = 1.
    extern __shared__ __align__(16) uint2 xs[];
    const int slices = gridDim.y * SK_WARPS;
    const int cta_gb = split_point(ngroups, blockIdx.y * SK_WARPS, slices);
    const int cta_ge = split_point(ngroups, (blockIdx.y + 1) * SK_WARPS, slices);
    const int cta_b0 = cta_gb * 4, cta_nb = (cta_ge - cta_gb) * 4;
    const int xs_row = min(g, M - 1);
#endif

    // SK_ACC: independent accumulator sets, MMA k-step s adding into set s % SK_ACC, summed at the
    // end -- each mma.sync waits for the one before it on the same accumulators, so one set makes
    // a chain of 2 MMAs per block through the warp's whole K slice
    float acc[SK_ACC][SK_R][SK_MT][4];
#pragma unroll
    for (int c = 0; c < SK_ACC; ++c)
#pragma unroll
        for (int r = 0; r < SK_R; ++r)
#pragma unroll
            for (int nt = 0; nt < SK_MT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[c][r][nt][i] = 0.0f;

    // Weight loads are software-pipelined: set A holds groups [G, G + U) while set B's loads for
    // [G + U, G + 2U) are in flight, then the roles swap. The loop body is written out twice
    // rather than copying B into A, because a register move of a load still in flight would
    // wait for it (the scoreboard), which is exactly the stall the pipeline is there to hide.
    typedef typename SkSlice<SF::PIECES>::WSet WSet;
    typedef typename SkSlice<SF::PIECES>::DSet DSet;
    auto load = [&](WSet& wq, DSet& wd, int G) { sl.load(wq, wd, G); };
    // Activation loads: x is small and shared by every CTA, so these hit L1/L2, but each one's
    // latency sits right before its MMA. A u step's loads are therefore issued together, before
    // any is converted (one latency per 4 blocks instead of one per block; 8 SK_MT float4
    // registers, so only for SK_MT <= 2). Blocks past K (the padding of the last group) re-read
    // block nb - 1: their weights are exactly 0, so they add 0 (x is finite, or the true
    // product is not finite anyway) -- no predicate stops the loads from being batched.
    constexpr int XJ = SK_MT <= 2 && !SK_XSMEM ? 4 : 1;  // blocks whose activations are loaded at once
    auto compute = [&](const WSet& wq, const DSet& wd, int G) {
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u) {
            if (G + u >= ge) break;
#pragma unroll
            for (int j0 = 0; j0 < 4; j0 += XJ) {
#if SK_XSMEM
                unsigned bf[SK_MT][2][2];
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const uint2 v = xs[((((G + u) * 4 + j0 - cta_b0) * 2 + s) * M + xs_row) * 4 + t];
                    bf[0][s][0] = v.x;
                    bf[0][s][1] = v.y;
                }
                {
                    const int j = j0;
#else
                SkXT::raw xv[XJ][SK_MT][2];
#pragma unroll
                for (int jj = 0; jj < XJ; ++jj) {
                    const int b = min((G + u) * 4 + j0 + jj, nb - 1);
#pragma unroll
                    for (int nt = 0; nt < SK_MT; ++nt) {
                        xv[jj][nt][0] = SkXT::load(xrow[nt] + b * QK);
                        xv[jj][nt][1] = SkXT::load(xrow[nt] + b * QK + 16);
                    }
                }
#pragma unroll
                for (int jj = 0; jj < XJ; ++jj) {
                    const int j = j0 + jj;
                    unsigned bf[SK_MT][2][2];
#pragma unroll
                    for (int nt = 0; nt < SK_MT; ++nt)
#pragma unroll
                        for (int s = 0; s < 2; ++s) SkXT::h2(xv[jj][nt][s], bf[nt][s][0], bf[nt][s][1]);  // the k permutation
#endif
#pragma unroll
                    for (int r = 0; r < SK_R; ++r) {
                        unsigned af[2][4];
                        SF::frags(wq[u][r], wd[u][r], j, af);
#pragma unroll
                        for (int s = 0; s < 2; ++s)
#pragma unroll
                            for (int nt = 0; nt < SK_MT; ++nt)
                                mma_f16(acc[s % SK_ACC][r][nt], af[s][0], af[s][1], af[s][2], af[s][3], bf[nt][s][0], bf[nt][s][1]);
                    }
                }
            }
        }
    };

    WSet wqA, wqB;
    DSet wdA, wdB;
    if (gb < ge) load(wqA, wdA, gb);  // in flight while the activations are staged
    // Programmatic dependent launch (sm_90, qgemm.matmul): the weights are the only memory read
    // above this line -- no kernel of an op chain writes them (a per-call repacking does, and
    // the launcher then launches this kernel without the attribute: common/pdl.cuh) -- so this CTA may start streaming
    // them while the previous kernel in the stream (which may produce X, or still read the buffer
    // that C points to) still runs; everything that touches X or C comes after the wait. Without the launch
    // attribute the wait returns at once.
    pdl_wait();
#if SK_XSMEM
    for (int r = 0; r < M; ++r)
        for (int i = threadIdx.x; i < cta_nb * 8; i += SK_WARPS * 32) {
            const int q = i % 8, bl = i / 8;  // q = 4 s + t
            const int b = cta_b0 + bl;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);  // padding blocks past K: zeros
            if (b < nb) v = sk_load_f4(X + (size_t)r * K + b * QK + 4 * q);
            xs[((bl * 2 + q / 4) * M + r) * 4 + q % 4] = make_uint2(f2_to_h2(v.x, v.z), f2_to_h2(v.y, v.w));
        }
    __syncthreads();
#endif
    for (int G = gb; G < ge; G += 2 * SK_UNROLL) {
        if (G + SK_UNROLL < ge) load(wqB, wdB, G + SK_UNROLL);
        compute(wqA, wdA, G);
        if (G + SK_UNROLL >= ge) break;
        if (G + 2 * SK_UNROLL < ge) load(wqA, wdA, G + 2 * SK_UNROLL);
        compute(wqB, wdB, G + SK_UNROLL);
    }

    // C fragment: acc[..][0..1] -> W row g, tokens 2t, 2t+1; acc[..][2..3] -> row g + 8
    sk_reduce_store<SK_MT>(red, [&](int r, int nt, int i) {
        return SK_ACC > 1 ? acc[0][r][nt][i] + acc[SK_ACC - 1][r][nt][i] : acc[0][r][nt][i];
    }, C, M, N, tile0);
}
