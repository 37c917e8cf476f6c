// Prefill on Hopper (sm_90a), second design: fp16 activations x Q4_0 / Q8_0 weights through wgmma
// with the *weights as the A operand, straight from registers* ("RS" wgmma), the activations as
// the B operand in 128-byte-swizzled shared memory.
//
// Why: common/wgmma_f16.cuh dequantizes every weight into shared memory and lets wgmma read both
// operands from there. Nsight Compute showed that kernel bound by its fill: ~250 instructions per
// thread per stage (dequantize, swizzled st.shared, address math) between two CTA barriers, and
// warp specialization did not help because the instruction count itself is the limit. Here the
// dequantized weights never touch shared memory: a warp's A fragment for its 16 weight rows is
// exactly what the skinny layout's dequantization (SkQ4_0 / SkQ8_0::frags) already produces in
// registers, so the fill is the ALU work alone, and only the raw quants pass through shared memory.
//
// Roles are swapped relative to the GEMM: the MMA's M (64 per warpgroup) are weight rows (output
// features n), its N (RS_BN = 64, 128 or 256) are tokens. D[n][token] lands in C[token][n].
//
// The k order. The skinny layout gives lane (g, t) qs word t of each block (bytes 4t .. 4t + 3),
// whose values sit at k 4t .. 4t + 3 (and 16 + the same for Q4_0's high nibbles); SkQ*::frags
// pairs bytes (0, 2) and (1, 3) of a word, so its fragment a0a1 holds k (4t, 4t + 2) and a4a5
// holds (4t + 1, 4t + 3). The tensor core reads the activations from shared memory in storage
// order, where lane (g, t)'s A fragment stands for positions (2t, 2t + 1) and (2t + 8, 2t + 9) of
// each k16 step. So the activations arrive in the *kperm16* layout (qgemm.packing.kperm16, written
// by the prologue convert.f16k): inside every 16, position j < 8 holds k = 2j and 8 + j holds
// 2j + 1 -- then position 2t holds k 4t, 2t + 1 holds 4t + 2, 2t + 8 holds 4t + 1 and 2t + 9 holds
// 4t + 3, exactly what the lane's own word gives. A product is unchanged when both operands' k are
// permuted alike, and the per-block scales are unaffected (the permutation stays inside a block).
// SkQ*::frags' output is then wgmma's register A layout for warp w of the warpgroup, rows
// 16w .. 16w + 15, with no byte shuffle between lanes. (The first version took natural-order
// activations and built each natural word from the pieces of lanes (g, t/2) and (g, t/2 + 2) with
// a PRMT: twice the shared-memory loads; kperm16 measured 3% faster for Q4_0 and 5% for Q8_0 at
// 2048x4096x4096 on the H100, docs/perf/NOTES.md.)
//
// CTA: RS_WGS warpgroups (64 weight rows each: warp w of warpgroup v owns the CTA's 16-row tile
// 4v + w), RS_BN tokens, K in stages of 128 (one group of 4 blocks of the skinny layout). A stage
// buffer holds the activation tile [RS_BN][128] fp16 (two 64-wide K atoms of RS_BN rows x 128 B,
// chunk c of row r at c ^ (r % 8): see common/wgmma_f16.cuh) and the CTA's raw quants and scales,
// all copied with cp.async 16 B (activations past K zero-filled: 0 x garbage could be NaN).
//
// Pipeline (RS_STAGES buffers, stages s + 1 .. s + RS_STAGES - 2 in flight while s is used):
//   wait for stage s's copies, fence.proxy.async (cp.async writes -> visible to wgmma), barrier;
//   for each half of the stage (2 blocks = 4 k-steps): wait_group 1 (the same half of stage s - 1
//   retired: its fragment registers are free), dequantize into them, wgmma.fence, 4 wgmma, commit;
//   then refill the buffer of stage s - 2 (its wgmma retired before the barrier) with stage
//   s + RS_STAGES - 2.
// So the dequantization of one half-stage runs while the tensor core works on the previous one,
// with one CTA barrier per stage, and the fragment registers are double-buffered per half.
//
// RS_WS = 1 (qgemm.registry._rs_config's choice above 64 tokens, and up to 64 tokens at K >= 8192;
// the #define's default is 0): warp specialization. A third warpgroup does all the copying
// (what the MMA threads copied above, each producer thread standing in for RS_WGS of them), and the MMA
// warpgroups never copy and never meet at a CTA barrier: per buffer, an mbarrier `full` completes
// when every producer thread's copies into it have landed (cp.async.mbarrier.arrive.noinc), and
// `empty` when each MMA warp has seen the buffer's wgmma retire. A buffer is refilled as soon as it
// is free (RS_STAGES - 1 stages in flight instead of RS_STAGES - 2), and the MMA warps drop to ~132
// registers (no copy addresses). Measured 8% faster at 512 and 2048 tokens (docs/perf/NOTES.md).
//
// RS_SAN_ARRIVALS = 1 (checking only, never tuned): the same ring with arrivals compute-sanitizer's
// racecheck can follow. The production form relies on two rules of the PTX ISA that racecheck
// does not model (session 48, docs/perf/NOTES.md): cp.async.mbarrier.arrive tracks *all* earlier
// cp.async of the thread (the first buffers' weights are copied before any arrival), and one lane's
// arrival on `empty` after __syncwarp releases the whole warp's reads of the buffer. Here each
// producer thread waits for its copies and arrives plainly, and every MMA thread arrives on
// `empty`; racecheck then reports no hazard in any configuration, which checks the ring's buffer
// indices, phases and counts. tools/sanitize_configs.py passes it.
//
// K may be split across CTAs (blockIdx.z, RS_SPLITK) when the tile grid leaves SMs idle: those add
// into a zeroed C with atomics.
#pragma once
#include "common/skinny_f16.cuh"
#include "common/wgmma.cuh"
#include "common/pdl.cuh"

#ifndef RS_BN
#define RS_BN 128  // tokens per CTA: wgmma's N (64, 128 or 256)
#endif
#ifndef RS_WGS
#define RS_WGS 2  // warpgroups per CTA, 64 weight rows each
#endif
#ifndef RS_STAGES
#define RS_STAGES 4
#endif
#ifndef RS_SPLITK
#define RS_SPLITK 1
#endif
#ifndef RS_MINB
#define RS_MINB 1  // CTAs per SM the registers must allow (2: <= 128 registers, twice the warps to hide latency)
#endif
#ifndef RS_SAN_ARRIVALS
#define RS_SAN_ARRIVALS 0  // 1: racecheck-visible arrivals in the warp-specialized ring (see above)
#endif
#ifndef RS_WS
#define RS_WS 0  // 1: warp-specialized -- one more warpgroup only copies; per-buffer mbarriers instead of CTA barriers
#endif
#if RS_WS && RS_WGS > 2
#error "RS_WS: the copying warpgroup stands in for at most two MMA warpgroups"
#endif
#if RS_STAGES < 3
#error "RS_STAGES must be >= 3: the buffer of stage s - 1 is still read by its wgmma while stage s is used"
#endif
#define RS_THREADS (128 * RS_WGS)            // the warpgroups that multiply
#define RS_BLOCK (RS_THREADS + 128 * RS_WS)  // + the copying warpgroup when warp-specialized
#define RS_TILES (4 * RS_WGS)          // 16-row weight tiles per CTA
#define RS_ACT_BYTES (RS_BN * 128 * 2)  // [RS_BN tokens][128 K] fp16

#if RS_BN == 64
#define RS_WGMMA wgmma_rs_m64n64k16
#elif RS_BN == 128
#define RS_WGMMA wgmma_rs_m64n128k16
#elif RS_BN == 256
#define RS_WGMMA wgmma_rs_m64n256k16
#else
#error "RS_BN must be 64, 128 or 256"
#endif

// byte offset of (token row, k) in the activation tile (128-byte swizzle, 64-wide K atoms)
static __device__ __forceinline__ unsigned rs_sw(int row, int k) {
    return (unsigned)((k >> 6) * (RS_BN * 128) + row * 128 + ((((k & 63) >> 3) ^ (row & 7)) << 4) + ((k & 7) << 1));
}

static __device__ __forceinline__ void rs_cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// RS_WEF: the weights are copied with an L2 evict-first policy. Where an op's activations (the
// float32 input, the prologue's fp16 copy that every N tile re-reads) and output fit the L2 but the
// weights on top of them do not, the weight stream -- read once per wave -- then no longer pushes
// them out. Where the weights are re-read across waves (many token tiles) or fit with everything
// else, the policy costs: the launcher sets it per shape (qgemm.registry._rs_wef, measured).
#ifndef RS_WEF
#define RS_WEF 0
#endif
static __device__ __forceinline__ unsigned long long l2_evict_first_policy() {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}
static __device__ __forceinline__ void rs_cp_async16_hint(unsigned dst, const void* src, unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "l"(policy));
}

// What one copying thread (tid in [0, RS_THREADS)) copies of every stage. The addressing is
// computed once: the per-stage part is a pointer bump, because every thread copies the same chunks
// of every stage (SASS of the first version spent ~150 of its ~350 instructions per warp per stage
// recomputing clamped addresses).
//   activations: chunk column c = tid % 16 (8 halves) of token rows r0 + i ROW_STEP; with
//     ROW_STEP a multiple of 8 the swizzle term (r % 8) is the same for all of a thread's rows.
//   quants: the CTA's RS_TILES x GROUP_PIECES chunks of a group, PIECES per thread; scales:
//     8 chunks per tile. Weight tiles past N re-read the last tile (never stored).
// A must start on a 16-byte boundary (the launcher checks it); rows are then 16-byte aligned
// (K % 32 == 0). Chunks past M or K are zero-filled (0 x garbage could be NaN) from a valid
// address; only the CTAs on the M edge and the last K stage take that slower path.
template <typename SF>
struct RsCopier {
    static constexpr int GROUP_PIECES = SF::PIECES * 32;  // uint4 per (tile, group)
    static constexpr int ACT_ITERS = RS_BN * 16 / RS_THREADS, ROW_STEP = RS_THREADS / 16;
    static_assert(ROW_STEP % 8 == 0, "the swizzle term must not depend on i");
    const __half* a_src;
    const uint4* w_src[SF::PIECES];
    const uint4* d_src;
    unsigned a_dst;
    int tid, ar0, ac;
#if RS_WEF
    unsigned long long w_policy;
#endif

    __device__ __forceinline__ RsCopier(int tid_, const __half* A, const uint4* qs, const uint4* ds, int M, int K, int n0,
                                        int m0, int ntiles, int ngroups, int g_begin)
        : tid(tid_), ar0(tid_ / 16), ac(tid_ % 16) {
        a_src = A + (size_t)min(m0 + ar0, M - 1) * K + ac * 8;
        a_dst = rs_sw(ar0, ac * 8);
#pragma unroll
        for (int i = 0; i < SF::PIECES; ++i) {
            const int q = tid + i * RS_THREADS;  // RS_TILES * GROUP_PIECES == PIECES * RS_THREADS
            const int tile = min(n0 / 16 + q / GROUP_PIECES, ntiles - 1);
            w_src[i] = qs + ((size_t)tile * ngroups + g_begin) * GROUP_PIECES + q % GROUP_PIECES;
        }
        d_src = ds + ((size_t)min(n0 / 16 + tid / 8, ntiles - 1) * ngroups + g_begin) * 8 + tid % 8;
#if RS_WEF
        w_policy = l2_evict_first_policy();
#endif
    }
    // the activation tile of stage st (K from k0) into the buffer at shared address act
    __device__ __forceinline__ void act(unsigned act, int k0, bool full_rows, const __half* A, int M, int K, int m0) const {
        if (full_rows && k0 + 128 <= K) {
            const __half* src = a_src + k0;
            const size_t row_step = (size_t)ROW_STEP * K;
#pragma unroll
            for (int i = 0; i < ACT_ITERS; ++i, src += row_step) rs_cp_async16(act + a_dst + i * ROW_STEP * 128, src);
        } else {
#pragma unroll
            for (int i = 0; i < ACT_ITERS; ++i) {
                const int r = ar0 + i * ROW_STEP, k = k0 + ac * 8;
                wg_cp_async16_zfill(act + a_dst + i * ROW_STEP * 128, A + (size_t)min(m0 + r, M - 1) * K + min(k, K - 8),
                                    k < K && m0 + r < M);
            }
        }
    }
    // stage st's raw quants and scales (st counts from this CTA's first group) into the buffer's
    // weight part at shared address wq
    __device__ __forceinline__ void w(unsigned wq, int st) const {
        const unsigned wd = wq + RS_TILES * GROUP_PIECES * 16;
#pragma unroll
        for (int i = 0; i < SF::PIECES; ++i) w_copy(wq + (tid + i * RS_THREADS) * 16, w_src[i] + (size_t)st * GROUP_PIECES);
        if (tid < RS_TILES * 8) w_copy(wd + tid * 16, d_src + (size_t)st * 8);
    }
    // one 16-byte weight copy, with the L2 policy of RS_WEF
    __device__ __forceinline__ void w_copy(unsigned dst, const void* src) const {
#if RS_WEF
        rs_cp_async16_hint(dst, src, w_policy);
#else
        rs_cp_async16(dst, src);
#endif
    }
};

// One stage of the MMA: this warp's raw quants of the stage from shared memory into registers
// (each lane its own pieces: with kperm16 activations they are its fragments), then per
// half-stage (2 blocks = 4 k-steps): wait_group 1 (the same half of the previous stage retired:
// its fragment registers are free), dequantize into them, wgmma.fence, 4 wgmma, commit. So the
// dequantization of one half runs while the tensor core works on the previous one. After the
// second wait the whole previous stage has retired in this warpgroup: RELEASE (warp-specialized
// kernel) then frees its buffer for the producer.
template <typename SF, bool RELEASE>
static __device__ __forceinline__ void rs_mma_stage(const unsigned char* st, unsigned act, int lt, int g, int lane,
                                                    unsigned (&fr)[2][4][4], float (&d)[RS_BN / 2], unsigned release_bar) {
    constexpr int GROUP_PIECES = SF::PIECES * 32;
    const uint4* wq = reinterpret_cast<const uint4*>(st + RS_ACT_BYTES) + lt * GROUP_PIECES;
    const uint4 dq = reinterpret_cast<const uint4*>(st + RS_ACT_BYTES + RS_TILES * GROUP_PIECES * 16)[lt * 8 + g];
    uint4 nat[SF::PIECES];  // this lane's own pieces: natural fragments, the activations being kperm16
#pragma unroll
    for (int p = 0; p < SF::PIECES; ++p) nat[p] = wq[p * 32 + lane];
    const unsigned act_desc = wg_desc_lo(act);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        wgmma_wait<1>();
        if (RELEASE && u == 1) {
            __syncwarp();
            if (release_bar && (RS_SAN_ARRIVALS || (threadIdx.x % 32) == 0)) mbar_arrive(release_bar);
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) wg_fence_operand(fr[u][i / 4][i % 4]);
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            unsigned a[2][4];
            SF::frags(nat, dq, 2 * u + jj, a);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                fr[u][2 * jj][i] = a[0][i];
                fr[u][2 * jj + 1][i] = a[1][i];
            }
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const int step = 4 * u + kk;  // k-step of the stage: atom step / 4, 32 bytes per step inside it
            // one add per wgmma (measured: the full descriptor cost ~6 uniform instructions each)
            RS_WGMMA(d, fr[u][kk], wg_desc_at(act_desc, (step >> 2) * (RS_BN * 128) + (step & 3) * 32));
        }
        wgmma_commit();
    }
}

// The split-K end (RS_SPLITK > 1): this CTA's partial tile is added into C with atomics. C[token][n]
// is contiguous along n, which the fragment spreads over lanes (lane g holds row g), so a scalar
// atomic per element was one reduction per output (64 x RS_BN per warpgroup) -- probed at ~1 us of the 10 us of
// 64x4096x4096 on the H100 (docs/perf/NOTES.md). The warpgroup instead writes its tile transposed
// to shared memory (the pipeline buffers are free once every MMA warp has passed the named barrier:
// all wgmma retired, no copy in flight) and adds 4 consecutive n per instruction
// (red.global.add.v4.f32, sm_90): a quarter of the reductions, each one 16-byte vector (half a
// 32-byte sector) instead of four 4-byte ones.
// Rows are padded to 68 floats: the scatter (lanes g = n, t = token pairs) then hits 32 distinct
// banks, and each row stays 16-byte aligned for the float4 reads. Vector adds need 16-byte aligned
// C rows (N % 4 == 0 and C itself aligned: tested at run time); anything else takes scalar atomics.
#define RS_EPI_LD 68
static_assert(RS_WGS * RS_BN * RS_EPI_LD * 4 <= 3 * 1024 * (RS_BN / 4),
              "the split-K transpose must fit in the pipeline buffers (>= 3 stages of RS_BN x 256 B)");

static __device__ __forceinline__ void rs_red_add_v4(float* p, float4 v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}

static __device__ __forceinline__ void rs_splitk_add(unsigned char* smem, const float (&d)[RS_BN / 2], float* __restrict__ C,
                                                     int M, int N, int m0, int nw0, int wgi, int warp_in_wg, int g, int t) {
    asm volatile("bar.sync 1, %0;\n" ::"n"(RS_THREADS) : "memory");  // the MMA warps only (the copier has returned)
    float* tile = reinterpret_cast<float*>(smem) + wgi * (RS_BN * RS_EPI_LD);  // [token][n of this warpgroup]
#pragma unroll
    for (int c = 0; c < RS_BN / 8; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            tile[(8 * c + 2 * t + (i & 1)) * RS_EPI_LD + 16 * warp_in_wg + g + 8 * (i >> 1)] = d[4 * c + i];
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wgi) : "memory");  // this warpgroup's tile is written
    const int tid = threadIdx.x % 128;
    const bool vec = (N % 4) == 0 && (((size_t)C) & 15) == 0;
#pragma unroll 4
    for (int idx = tid; idx < RS_BN * 16; idx += 128) {
        const int tok = idx / 16, q = idx % 16, n = nw0 + 4 * q;
        if (m0 + tok >= M || n >= N) continue;
        const float4 v = *reinterpret_cast<const float4*>(tile + tok * RS_EPI_LD + 4 * q);
        float* dst = C + (size_t)(m0 + tok) * N + n;
        if (vec && n + 4 <= N) {
            rs_red_add_v4(dst, v);
        } else {
            atomicAdd(dst, v.x);
            if (n + 1 < N) atomicAdd(dst + 1, v.y);
            if (n + 2 < N) atomicAdd(dst + 2, v.z);
            if (n + 3 < N) atomicAdd(dst + 3, v.w);
        }
    }
}

template <typename SF>
static __device__ __forceinline__ void wgmma_rs_f16_gemm(const __half* __restrict__ A, const unsigned char* __restrict__ Wp,
                                                         float* __restrict__ C, int M, int N, int K) {
    constexpr int GROUP_PIECES = SF::PIECES * 32;                     // uint4 per (tile, group)
    constexpr int W_BYTES = RS_TILES * (GROUP_PIECES * 16 + 8 * 16);  // raw quants + scales of a stage
    constexpr int STAGE_BYTES = (RS_ACT_BYTES + W_BYTES + 1023) / 1024 * 1024;
    extern __shared__ unsigned char rs_smem_raw[];
    const unsigned raw = (unsigned)__cvta_generic_to_shared(rs_smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // the swizzle pattern is on absolute address bits
    unsigned char* const smem = rs_smem_raw + (base - raw);

    // the next op's first kernel may launch now (it waits for this grid before touching memory
    // this one uses): its launch latency hides under this kernel's last wave
    pdl_launch_dependents();
    const int tid = threadIdx.x, lane = tid % 32, wgi = tid / 128, warp_in_wg = (tid / 32) % 4;
    const int g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * (64 * RS_WGS), m0 = blockIdx.y * RS_BN;
    const int nb = K / QK, ngroups = (nb + 3) / 4, ntiles = (N + 15) / 16;
    const int g_begin = (int)((long long)ngroups * blockIdx.z / RS_SPLITK);
    const int n_stages = (int)((long long)ngroups * (blockIdx.z + 1) / RS_SPLITK) - g_begin;
    const uint4* qs = reinterpret_cast<const uint4*>(Wp);
    const uint4* ds = qs + (size_t)ntiles * ngroups * GROUP_PIECES;
    const bool a_full_rows = m0 + RS_BN <= M;

    float d[RS_BN / 2];  // this warpgroup's 64 weight rows x RS_BN tokens
#pragma unroll
    for (int i = 0; i < RS_BN / 2; ++i) d[i] = 0.0f;
    unsigned fr[2][4][4];  // A fragments of the two half-stages (k-steps 0-3, 4-7)
    const int lt = 4 * wgi + warp_in_wg;  // this warp's 16-row tile in the CTA

#if RS_WS
    // Warp-specialized: the last warpgroup only copies, the others only dequantize and multiply;
    // per buffer, `full` (128 producer arrivals, each fired by cp.async.mbarrier.arrive when that
    // thread's copies so far have landed) and `empty` (one arrival per consumer warp once the
    // stage's wgmma have retired). No CTA barrier in the loop, and the producer refills a buffer as
    // soon as it is free: RS_STAGES - 1 stages in flight instead of RS_STAGES - 2.
    const unsigned bars = base + RS_STAGES * STAGE_BYTES;  // full[b] at bars + 8 b, empty[b] at bars + 8 (RS_STAGES + b)
    if (tid == 0)
        for (int b = 0; b < RS_STAGES; ++b) {
            mbar_init(bars + 8 * b, 128);
            mbar_init(bars + 8 * (RS_STAGES + b), RS_SAN_ARRIVALS ? RS_THREADS : RS_THREADS / 32);
        }
    __syncthreads();
    if (wgi == RS_WGS) {
        // producer thread p copies what threads p + 128 i of the non-specialized kernel copy
        const RsCopier<SF> cp0(tid - RS_THREADS, A, qs, ds, M, K, n0, m0, ntiles, ngroups, g_begin);
#if RS_WGS > 1
        const RsCopier<SF> cp1(tid - RS_THREADS + 128, A, qs, ds, M, K, n0, m0, ntiles, ngroups, g_begin);
#endif
        auto copy = [&](int s, bool act, bool w) {
            const unsigned buf = base + (s % RS_STAGES) * STAGE_BYTES;
            const int k0 = (g_begin + s) * 128;
            if (w) {
                cp0.w(buf + RS_ACT_BYTES, s);
#if RS_WGS > 1
                cp1.w(buf + RS_ACT_BYTES, s);
#endif
            }
            if (act) {
                cp0.act(buf, k0, a_full_rows, A, M, K, m0);
#if RS_WGS > 1
                cp1.act(buf, k0, a_full_rows, A, M, K, m0);
#endif
            }
        };
        // the first buffers' weights before waiting for the previous grid (see below)
        for (int s = 0; s < RS_STAGES && s < n_stages; ++s) copy(s, false, true);
        pdl_wait();
        for (int s = 0; s < n_stages; ++s) {
            const int b = s % RS_STAGES;
            if (s >= RS_STAGES) mbar_wait(bars + 8 * (RS_STAGES + b), ((s / RS_STAGES) - 1) & 1);
            copy(s, true, s >= RS_STAGES);
#if RS_SAN_ARRIVALS
            asm volatile("cp.async.wait_all;\n" ::: "memory");
            mbar_arrive(bars + 8 * b);
#else
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bars + 8 * b) : "memory");
#endif
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }
    pdl_wait();
    for (int s = 0; s < n_stages; ++s) {
        const int b = s % RS_STAGES;
        mbar_wait(bars + 8 * b, (s / RS_STAGES) & 1);
        // the copies were cp.async (generic proxy), wgmma reads through the async proxy
        fence_proxy_async();
        rs_mma_stage<SF, true>(smem + b * STAGE_BYTES, base + b * STAGE_BYTES, lt, g, lane, fr, d,
                               s > 0 ? bars + 8 * (RS_STAGES + (s - 1) % RS_STAGES) : 0u);
    }
#else
    const RsCopier<SF> cp(tid, A, qs, ds, M, K, n0, m0, ntiles, ngroups, g_begin);
    // The weights of the first stages do not depend on the previous kernel (the activations'
    // convert.f16k): with programmatic dependent launch (qgemm.matmul) this CTA may already run
    // while that kernel finishes, so it starts their copies and only then waits for the grid it
    // depends on (griddepcontrol.wait returns at once when launched without the attribute).
    // Commit groups stay one per stage: group 0 holds the early weights too.
#pragma unroll
    for (int s = 0; s < RS_STAGES - 2; ++s)
        if (s < n_stages) cp.w(base + s * STAGE_BYTES + RS_ACT_BYTES, s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < RS_STAGES - 2; ++s) {
        if (s < n_stages) cp.act(base + s * STAGE_BYTES, (g_begin + s) * 128, a_full_rows, A, M, K, m0);
        cp_async_commit();
    }
    for (int s = 0; s < n_stages; ++s) {
        const int buf = s % RS_STAGES;
        cp_async_wait<RS_STAGES - 3>();
        fence_proxy_async();
        __syncthreads();
        rs_mma_stage<SF, false>(smem + buf * STAGE_BYTES, base + buf * STAGE_BYTES, lt, g, lane, fr, d, 0u);
        // the refill of the buffer of stage s - 2 (retired before the barrier) goes after this
        // stage's wgmma are issued, so the tensor core is fed before this warp's copy work (between
        // the two halves, ptxas serializes every wgmma: C7513, tested in tests/test_cli_registry.py)
        if (s + RS_STAGES - 2 < n_stages) {
            const int s2 = s + RS_STAGES - 2, buf2 = s2 % RS_STAGES;
            cp.act(base + buf2 * STAGE_BYTES, (g_begin + s2) * 128, a_full_rows, A, M, K, m0);
            cp.w(base + buf2 * STAGE_BYTES + RS_ACT_BYTES, s2);
        }
        cp_async_commit();
    }
#endif
    wgmma_wait<0>();

    // accumulator layout (m64nNk16, f32): warp w owns rows 16w .. 16w + 15 (weight rows);
    // d[4c + 0..1] = (row g, cols 8c + 2t + 0..1), d[4c + 2..3] = (row g + 8, same cols) (tokens)
    if (RS_SPLITK > 1) {
        rs_splitk_add(smem, d, C, M, N, m0, n0 + 64 * wgi, wgi, warp_in_wg, g, t);
        return;
    }
    const int row0 = n0 + 64 * wgi + 16 * warp_in_wg + g;
#pragma unroll
    for (int c = 0; c < RS_BN / 8; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int tok = m0 + 8 * c + 2 * t + (i & 1), n = row0 + 8 * (i >> 1);
            if (tok < M && n < N) C[(size_t)tok * N + n] = d[4 * c + i];
        }
}
