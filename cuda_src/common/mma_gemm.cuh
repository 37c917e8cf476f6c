// Int8 tensor-core GEMM on ggml blocks: Q8_1 activations x Q4_0 / Q8_0 weights, mma.sync m16n8k32.
//
// One m16n8k32 MMA consumes exactly one quant block along K, and its fragments line up with
// ggml's layouts (PTX ISA, "mma.m16n8k32" for .s8): with g = lane / 4 and t = lane % 4,
//     A (row-major 16x32):  a0 = row g, bytes 4t..4t+3      a1 = row g+8, bytes 4t..4t+3
//                           a2 = row g, bytes 16+4t..       a3 = row g+8, bytes 16+4t..
//     B (col-major 32x8):   b0 = col g, bytes 4t..4t+3      b1 = col g,   bytes 16+4t..
//     C (16x8 int32):       c0,c1 = row g,   cols 2t, 2t+1  c2,c3 = row g+8, cols 2t, 2t+1
// A Q8_1 row gives a0/a2 as its qs words t and t+4. For Q4_0, packed qs int t holds elements
// 4t..4t+3 in its low nibbles and 16+4t.. in its high nibbles, so ONE packed int per thread gives
// b0 = packed & 0x0F0F0F0F and b1 = (packed >> 4) & 0x0F0F0F0F (stored values 0..15, positive as
// s8). For Q8_0, b0/b1 are qs words t and t+4.
//
// Each MMA yields the integer sums of one block for a 16x8 tile; they are folded into float
// accumulators right away with the block's scales: acc += d_w (d_a sumi - 8 s_a) (Q4_0) or
// acc += d_w d_a sumi (Q8_0). That epilogue (a conversion and two FMAs per output per block) is
// the price of 32-wide block scales; it costs more issue slots than the MMA itself. (Tried: the
// exponent trick __int_as_float(0x4B400000 + x) - 12582912 instead of I2F measured 10% slower on
// the H100 at 512x4096x4096, so the plain conversion stays.)
//
// Data movement: the CTA streams raw block bytes global -> shared with cp.async (16-byte copies
// for the 36-byte Q8_1 blocks: 4 blocks = 144 B = 9 x 16; 8-byte copies for the 18/34-byte
// weight blocks), MMA_STAGES deep, and reads fragments from the raw layout. Row strides are
// padded so the 8 rows (g) x 4 words (t) of a fragment load hit 32 distinct banks:
// A 144 B = 36 words (4g + t), Q4_0 80 B = 20 words, Q8_0 144 B = 36 words.
// Rows past M/N are clamped to the last row (valid memory; never stored). When K is not a
// multiple of 128 (nb % 4 != 0: the 36-byte Q8_1 rows are then not 16-byte aligned), or A / W do
// not start on a 16- / 8-byte boundary, every stage is filled with plain 2-byte loads, the blocks
// past K/32 as zeros (d = 0: they add nothing) -- correct, slower.
//
// Split-K: with MMA_SPLITK > 1, blockIdx.z takes a slice of the K blocks and atomically adds its
// partial sums into C, which is zeroed before the kernel runs (by the convert.* prologue in
// qgemm.matmul, else a memset the launcher queues): for grids that would not fill the GPU.
#pragma once
#include "common/quant_dot.cuh"

#ifndef MMA_BM
#define MMA_BM 128
#endif
#ifndef MMA_BN
#define MMA_BN 128
#endif
#ifndef MMA_WARPS_M
#define MMA_WARPS_M 2
#endif
#ifndef MMA_WARPS_N
#define MMA_WARPS_N 4
#endif
#ifndef MMA_STAGES
#define MMA_STAGES 4
#endif
#ifndef MMA_SPLITK
#define MMA_SPLITK 1
#endif
#ifndef MMA_MINB
#define MMA_MINB 1  // __launch_bounds__ min blocks per SM: 2 caps registers so two CTAs fit
#endif
// (an explicit min-blocks of 1 made ptxas for sm_80 use 255 registers and spill, so it is only
// passed when > 1)
#if MMA_MINB > 1
#define MMA_LAUNCH_BOUNDS __launch_bounds__(MMA_THREADS, MMA_MINB)
#else
#define MMA_LAUNCH_BOUNDS __launch_bounds__(MMA_THREADS)
#endif
#define MMA_BK 4  // quant blocks per stage (128 values of K)
#define MMA_THREADS (32 * MMA_WARPS_M * MMA_WARPS_N)
#define MMA_WM (MMA_BM / MMA_WARPS_M)
#define MMA_WN (MMA_BN / MMA_WARPS_N)
#define MMA_MT (MMA_WM / 16)
#define MMA_NT (MMA_WN / 8)
static_assert(MMA_WM % 16 == 0 && MMA_WN % 8 == 0, "warp tile must be a multiple of 16x8");

#define MMA_A_ROW 144  // 4 x 36-byte Q8_1 blocks, already conflict-free (36 words)

static __device__ __forceinline__ void mma_s8(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where part p of `total` items split into `parts` near-equal runs begins: total * p / parts in 32
// bits. A 64-bit division by a runtime value is a ~100-instruction subroutine call, and the decode
// kernels' first weight load waits for it; here total < 2^24 (K / 128 groups, K an int) and
// parts <= 256 (CTAs x warps along K), so the product fits.
static __device__ __forceinline__ int split_point(int total, int p, int parts) {
    return (int)(((unsigned)total * (unsigned)p) / (unsigned)parts);
}

// weights streamed global -> registers, read once: not kept in L1 (not volatile: the compiler may
// schedule it early)
static __device__ __forceinline__ uint4 ld_stream16(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

static __device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
static __device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
}
static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
static __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

static __device__ __forceinline__ unsigned short lds16(const unsigned char* p) { return *(const unsigned short*)p; }
static __device__ __forceinline__ int lds32_b2(const unsigned char* p) {  // 4 bytes at a 2-byte aligned address
    return (int)lds16(p) | ((int)lds16(p + 2) << 16);
}

struct MmaQ4_0 {
    typedef block_q4_0 block_w;
    static constexpr int BYTES = 18;
    static constexpr int ROW = 80;  // 72 B of data + 8 B pad (20 words: 20g + t distinct banks)
    static constexpr bool offset8 = true;
    // B fragment of block b for column (row of W) at `row`: packed int t
    static __device__ __forceinline__ void frag(const unsigned char* row, int b, int t, int& b0, int& b1) {
        q4_0_split(lds32_b2(row + b * 18 + 2 + 4 * t), b0, b1);
    }
};

struct MmaQ8_0 {
    typedef block_q8_0 block_w;
    static constexpr int BYTES = 34;
    static constexpr int ROW = 144;  // 136 B of data + 8 B pad (36 words)
    static constexpr bool offset8 = false;
    static __device__ __forceinline__ void frag(const unsigned char* row, int b, int t, int& b0, int& b1) {
        b0 = lds32_b2(row + b * 34 + 2 + 4 * t);
        b1 = lds32_b2(row + b * 34 + 2 + 4 * (t + 4));
    }
};

// Copy rows [r0, r0 + ROWS) x blocks [b0, b0 + MMA_BK) of a block matrix into raw shared rows.
// Fast path: cp.async in CHUNK-byte pieces (each row's bytes are contiguous in global memory).
template <int ROWS, int BYTES, int ROW, int CHUNK>
static __device__ __forceinline__ void stage_rows(unsigned char* sm, const unsigned char* __restrict__ g, int nrows,
                                                  int nb, int r0, int b0, bool fast) {
    constexpr int ROW_BYTES = MMA_BK * BYTES;
    if (fast) {
        constexpr int PER_ROW = ROW_BYTES / CHUNK;
        static_assert(ROW_BYTES % CHUNK == 0, "stage row must be a whole number of chunks");
        for (int i = threadIdx.x; i < ROWS * PER_ROW; i += MMA_THREADS) {
            const int r = i / PER_ROW, c = i % PER_ROW;
            const int gr = min(r0 + r, nrows - 1);
            const unsigned char* src = g + ((size_t)gr * nb + b0) * BYTES + c * CHUNK;
            if (CHUNK == 16) cp_async16(sm + r * ROW + c * CHUNK, src);
            else cp_async8(sm + r * ROW + c * CHUNK, src);
        }
    } else {
        // 2-byte copies (every block field is 2-byte aligned); blocks past nb become zeros, so
        // their scales are 0 and they add nothing.
        for (int i = threadIdx.x; i < ROWS * (ROW_BYTES / 2); i += MMA_THREADS) {
            const int r = i / (ROW_BYTES / 2), h = i % (ROW_BYTES / 2);
            const int gr = min(r0 + r, nrows - 1);
            const int b = (2 * h) / BYTES;
            unsigned short v = 0;
            if (b0 + b < nb) v = *(const unsigned short*)(g + ((size_t)gr * nb + b0) * BYTES + 2 * h);
            *(unsigned short*)(sm + r * ROW + 2 * h) = v;
        }
    }
}

// This CTA's slice of the K stages (MMA_BK blocks each) under split-K (blockIdx.z).
static __device__ __forceinline__ void mma_k_slice(int nb, int& s_begin, int& n_stages) {
    const int n_stages_total = (nb + MMA_BK - 1) / MMA_BK;
    const int per_split = (n_stages_total + MMA_SPLITK - 1) / MMA_SPLITK;
    s_begin = blockIdx.z * per_split;
    n_stages = max(min(n_stages_total, s_begin + per_split) - s_begin, 0);
}

// Write a warp's MT x NT accumulator fragments (c0,c1 = row g, cols 2t, 2t+1; c2,c3 = row g+8) to
// C, or add them atomically under split-K (C zeroed before the kernel: see the top of this file).
static __device__ __forceinline__ void mma_store(const float (&acc)[MMA_MT][MMA_NT][4], float* __restrict__ C, int M, int N,
                                                 int m0, int n0, int wm, int wn, int g, int t) {
#pragma unroll
    for (int i = 0; i < MMA_MT; ++i)
#pragma unroll
        for (int j = 0; j < MMA_NT; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m0 + wm * MMA_WM + i * 16 + g + 8 * h;
                const int n = n0 + wn * MMA_WN + j * 8 + 2 * t;
                if (m >= M) continue;
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    if (n + q >= N) continue;
                    float* dst = &C[(size_t)m * N + n + q];
                    if (MMA_SPLITK > 1) atomicAdd(dst, acc[i][j][2 * h + q]);
                    else *dst = acc[i][j][2 * h + q];
                }
            }
}

template <typename WF>
static __device__ __forceinline__ void mma_gemm(const block_q8_1* __restrict__ A, const typename WF::block_w* __restrict__ W,
                                                float* __restrict__ C, int M, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int A_STAGE = MMA_BM * MMA_A_ROW;
    constexpr int W_STAGE = MMA_BN * WF::ROW;
    unsigned char* sA = smem;
    unsigned char* sW = smem + MMA_STAGES * A_STAGE;

    const int nb = K / QK;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int wm = warp / MMA_WARPS_N, wn = warp % MMA_WARPS_N;
    const int m0 = blockIdx.y * MMA_BM, n0 = blockIdx.x * MMA_BN;

    int s_begin, n_stages;
    mma_k_slice(nb, s_begin, n_stages);

    const bool aligned = (nb % MMA_BK) == 0 && (((size_t)A) & 15) == 0 && (((size_t)W) & 7) == 0;

    auto load_stage = [&](int s, int buf) {
        const int b0 = (s_begin + s) * MMA_BK;
        const bool fast = aligned;  // with nb % MMA_BK == 0 every stage is full
        stage_rows<MMA_BM, 36, MMA_A_ROW, 16>(sA + buf * A_STAGE, (const unsigned char*)A, M, nb, m0, b0, fast);
        stage_rows<MMA_BN, WF::BYTES, WF::ROW, 8>(sW + buf * W_STAGE, (const unsigned char*)W, N, nb, n0, b0, fast);
    };

    float acc[MMA_MT][MMA_NT][4];
#pragma unroll
    for (int i = 0; i < MMA_MT; ++i)
#pragma unroll
        for (int j = 0; j < MMA_NT; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

#pragma unroll
    for (int s = 0; s < MMA_STAGES - 1; ++s) {
        if (s < n_stages) load_stage(s, s);
        cp_async_commit();
    }

    for (int s = 0; s < n_stages; ++s) {
        // STAGES - 1 + s groups have been committed (the prologue's STAGES - 1, then one per
        // iteration); leaving STAGES - 2 pending means groups 0..s are complete: this thread's
        // copies of stage s have landed. The barrier makes every thread's copies visible, and
        // proves every warp has finished reading stage s - 1, whose buffer is refilled below
        cp_async_wait<MMA_STAGES - 2>();
        __syncthreads();
        // refill the buffer consumed in the previous iteration
        const int next = s + MMA_STAGES - 1;
        if (next < n_stages) load_stage(next, next % MMA_STAGES);
        cp_async_commit();

        const unsigned char* a_st = sA + (s % MMA_STAGES) * A_STAGE;
        const unsigned char* w_st = sW + (s % MMA_STAGES) * W_STAGE;
#pragma unroll
        for (int b = 0; b < MMA_BK; ++b) {
            int bf[MMA_NT][2];
            float dw[MMA_NT][2];
#pragma unroll
            for (int j = 0; j < MMA_NT; ++j) {
                const unsigned char* wrow = w_st + (wn * MMA_WN + j * 8 + g) * WF::ROW;
                WF::frag(wrow, b, t, bf[j][0], bf[j][1]);
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const unsigned char* wr = w_st + (wn * MMA_WN + j * 8 + 2 * t + q) * WF::ROW;
                    dw[j][q] = __half2float(*(const __half*)(wr + b * WF::BYTES));
                }
            }
#pragma unroll
            for (int i = 0; i < MMA_MT; ++i) {
                const unsigned char* r_lo = a_st + (wm * MMA_WM + i * 16 + g) * MMA_A_ROW + b * 36;
                const unsigned char* r_hi = r_lo + 8 * MMA_A_ROW;
                const int a0 = *(const int*)(r_lo + 4 + 4 * t), a2 = *(const int*)(r_lo + 4 + 4 * (t + 4));
                const int a1 = *(const int*)(r_hi + 4 + 4 * t), a3 = *(const int*)(r_hi + 4 + 4 * (t + 4));
                const float2 ds_lo = __half22float2(*(const __half2*)r_lo);
                const float2 ds_hi = __half22float2(*(const __half2*)r_hi);
#pragma unroll
                for (int j = 0; j < MMA_NT; ++j) {
                    int c[4] = {0, 0, 0, 0};
                    mma_s8(c, a0, a1, a2, a3, bf[j][0], bf[j][1]);
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const float2 ds = q < 2 ? ds_lo : ds_hi;
                        const float d_w = dw[j][q & 1];
                        const float sumf = (float)c[q];
                        acc[i][j][q] += WF::offset8 ? d_w * fmaf(ds.x, sumf, -8.0f * ds.y) : d_w * ds.x * sumf;
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    mma_store(acc, C, M, N, m0, n0, wm, wn, g, t);
}
