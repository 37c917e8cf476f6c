// Q4_0 / Q8_0 weights x float16 activations on fp16 tensor cores (mma.sync m16n8k16, fp32
// accumulate): the W4A16 production path.
//
// Why a second production path: with int8 MMA (common/mma_gemm.cuh) every 32-wide block adds a
// float epilogue per *output* (convert sumi, two FMAs), which costs more issue slots than the MMA.
// Here the block scale is folded into the weights while they are dequantized to fp16 -- a cost per
// *weight element*, shared by the BM rows of the tile -- and the MMAs accumulate across blocks
// with no epilogue at all. Activations stay fp16 (no Q8_1 rounding), so the result is closer to
// the float truth than llama.cpp's W4A8.
//
// Fragments (PTX ISA, mma.m16n8k16 .f16): with g = lane / 4, t = lane % 4,
//     A 16x16 row-major: loaded with ldmatrix.x4 from the fp16 tile (rows padded to 136 halves =
//                        272 B = 17 x 16 B: the 8 row addresses of each 8x8 matrix hit distinct banks)
//     B 16x8 col-major:  b0 = {B[2t][g], B[2t+1][g]},  b1 = {B[2t+8][g], B[2t+9][g]}
// A 32-value quant block is two k16 steps. For Q4_0 the values 2t, 2t+1, 2t+8, 2t+9 of step 0 are
// the LOW nibbles of qs[2t], qs[2t+1], qs[2t+8], qs[2t+9] and those of step 1 are the HIGH nibbles
// of the same four bytes: one 32-bit gather gives a thread both steps, interleaved
// [2t 2t+8 2t+1 2t+9] so that the magic-number dequantization below takes the pairs (2t, 2t+1)
// and (2t+8, 2t+9) with one LOP3 each: d (v - 8) rounded once to fp16 -- which is what
// qgemm.reference.exact_w4a16h models. Q8_0 bytes get the same treatment (1152, sign flip).
//
// Staging: cp.async, MMA_STAGES deep: fp16 activations in 16-byte pieces, weight blocks in 8-byte
// pieces (raw bytes, rows padded to 80 B for Q4_0 / 144 B for Q8_0); the same 2-byte fallback as
// the int8 kernel when rows are not aligned or K is not a multiple of 128.
#pragma once
#include "common/mma_gemm.cuh"

#define HF_A_ROW 272  // 128 halves of K per stage + 8 halves of padding, in bytes

static __device__ __forceinline__ void mma_f16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// Dequantization by magic numbers, shared by every fp16-path kernel (here, common/skinny_f16.cuh,
// and through it the wgmma kernels). A byte pair 16 bits apart -- bytes (0, 2) or, after a shift by
// 8, (1, 3) of a word -- goes under fp16's exponent of 1024 with one LOP3: (w & mask) | 0x64006400.
//   Q4_0 low nibbles:  1024 + q        -> HADD2 -1032        = q - 8 (exact)
//   Q4_0 high nibbles: 1024 + 16 q     -> HFMA2 x/16 - 72    = q - 8 (exact: small integers and a power of two)
//   Q8_0 bytes:        1024 + 128 + q  -> HADD2 -1152        = q     (the same LOP3 flips the sign bit)
// then one HMUL2 by the scale: d (q - 8) or d q rounded once to fp16 (qgemm.reference's
// dequantize_to_f16), the scale broadcast by HMUL2's operand selector where it is a half of a word.
static __device__ __forceinline__ unsigned lop3_and_or(unsigned x, unsigned mask, unsigned bits) {
    unsigned r;  // (x & mask) | bits
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));
    return r;
}
static __device__ __forceinline__ unsigned lop3_xor_under(unsigned x, unsigned mask, unsigned bits) {
    unsigned r;  // mask ? x ^ bits : bits
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));
    return r;
}
static __device__ __forceinline__ unsigned h2_bits(__half2 x) { return *reinterpret_cast<const unsigned*>(&x); }
static __device__ __forceinline__ __half2 as_h2(unsigned x) { return *reinterpret_cast<const __half2*>(&x); }
// pair (0, 2) of w (use w >> 8 for the pair (1, 3)) -> half2 of d (q - 8) / d q
static __device__ __forceinline__ unsigned dq_q4_lo(unsigned w, __half2 d2) {
    return h2_bits(__hmul2(__hsub2(as_h2(lop3_and_or(w, 0x000F000Fu, 0x64006400u)), __float2half2_rn(1032.0f)), d2));
}
static __device__ __forceinline__ unsigned dq_q4_hi(unsigned w, __half2 d2) {
    return h2_bits(__hmul2(__hfma2(as_h2(lop3_and_or(w, 0x00F000F0u, 0x64006400u)), __float2half2_rn(0.0625f),
                                   __float2half2_rn(-72.0f)), d2));
}
static __device__ __forceinline__ unsigned dq_q8(unsigned w, __half2 d2) {
    return h2_bits(__hmul2(__hsub2(as_h2(lop3_xor_under(w, 0x00FF00FFu, 0x64806480u)), __float2half2_rn(1152.0f)), d2));
}

struct HfQ4_0 {
    typedef block_q4_0 block_w;
    static constexpr int BYTES = 18;
    static constexpr int ROW = 80;
    // B fragments of k-steps 0 and 1 of block b for W row `row`: bytes [2t 2t+8 2t+1 2t+9] of qs
    static __device__ __forceinline__ void frags(const unsigned char* row, int b, int t, unsigned (&bf)[2][2]) {
        const unsigned char* qs = row + b * 18 + 2;
        const unsigned x = __byte_perm(lds16(qs + 2 * t), lds16(qs + 2 * t + 8), 0x5140);
        const __half2 d2 = __half2half2(*(const __half*)(row + b * 18));
        bf[0][0] = dq_q4_lo(x, d2);
        bf[0][1] = dq_q4_lo(x >> 8, d2);
        bf[1][0] = dq_q4_hi(x, d2);
        bf[1][1] = dq_q4_hi(x >> 8, d2);
    }
};

struct HfQ8_0 {
    typedef block_q8_0 block_w;
    static constexpr int BYTES = 34;
    static constexpr int ROW = 144;
    static __device__ __forceinline__ void frags(const unsigned char* row, int b, int t, unsigned (&bf)[2][2]) {
        const unsigned char* qs = row + b * 34 + 2;
        const __half2 d2 = __half2half2(*(const __half*)(row + b * 34));
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const unsigned x = __byte_perm(lds16(qs + 16 * s + 2 * t), lds16(qs + 16 * s + 2 * t + 8), 0x5140);
            bf[s][0] = dq_q8(x, d2);
            bf[s][1] = dq_q8(x >> 8, d2);
        }
    }
};

// fp16 activation rows [r0, r0+BM) x K values [k0, k0 + 128) -> sA rows of HF_A_ROW bytes
static __device__ __forceinline__ void hf_stage_a(unsigned char* sA, const __half* __restrict__ A, int M, int K, int r0,
                                                  int k0, bool fast) {
    if (fast) {
        for (int i = threadIdx.x; i < MMA_BM * 16; i += MMA_THREADS) {
            const int r = i / 16, c = i % 16;
            cp_async16(sA + r * HF_A_ROW + c * 16, A + (size_t)min(r0 + r, M - 1) * K + k0 + c * 8);
        }
    } else {
        for (int i = threadIdx.x; i < MMA_BM * 128; i += MMA_THREADS) {
            const int r = i / 128, c = i % 128;
            const __half v = (k0 + c < K) ? A[(size_t)min(r0 + r, M - 1) * K + k0 + c] : __float2half(0.0f);
            *(__half*)(sA + r * HF_A_ROW + 2 * c) = v;
        }
    }
}

template <typename WF>
static __device__ __forceinline__ void mma_f16_gemm(const __half* __restrict__ A, const typename WF::block_w* __restrict__ W,
                                                    float* __restrict__ C, int M, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int A_STAGE = MMA_BM * HF_A_ROW;
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
        hf_stage_a(sA + buf * A_STAGE, A, M, K, m0, b0 * QK, aligned);
        stage_rows<MMA_BN, WF::BYTES, WF::ROW, 8>(sW + buf * W_STAGE, (const unsigned char*)W, N, nb, n0, b0, aligned);
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
        cp_async_wait<MMA_STAGES - 2>();
        __syncthreads();
        const int next = s + MMA_STAGES - 1;
        if (next < n_stages) load_stage(next, next % MMA_STAGES);
        cp_async_commit();

        const unsigned char* a_st = sA + (s % MMA_STAGES) * A_STAGE;
        const unsigned char* w_st = sW + (s % MMA_STAGES) * W_STAGE;
        // Issue order matters: the ldmatrix and mma asm statements are volatile, so the compiler
        // keeps them in program order. All A fragments of a k-step are loaded first, then its
        // MT x NT independent MMAs go back to back; the next block's weight dequantization
        // (ordinary loads and ALU work, free to move) is written before them so it overlaps.
        unsigned bf[2][MMA_NT][2][2];
#pragma unroll
        for (int j = 0; j < MMA_NT; ++j) WF::frags(w_st + (wn * MMA_WN + j * 8 + g) * WF::ROW, 0, t, bf[0][j]);
#pragma unroll
        for (int b = 0; b < MMA_BK; ++b) {
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
                unsigned af[MMA_MT][4];
#pragma unroll
                for (int i = 0; i < MMA_MT; ++i) {
                    // ldmatrix.x4: lanes 8i .. 8i + 7 give the row addresses of matrix i. Lanes 0-15
                    // point at rows 0-15, k 0-7 (a0: rows 0-7, a1: rows 8-15), lanes 16-31 at the same
                    // rows, k 8-15 (a2, a3); each lane gets back (row g, k 2t, 2t + 1) of every
                    // matrix: the m16n8k16 A fragment in register order
                    const int row = wm * MMA_WM + i * 16 + (lane % 16);
                    const int col = b * 32 + ks * 16 + (lane / 16) * 8;
                    ldmatrix_x4(af[i], a_st + row * HF_A_ROW + col * 2);
                }
                if (ks == 1 && b + 1 < MMA_BK) {
#pragma unroll
                    for (int j = 0; j < MMA_NT; ++j)
                        WF::frags(w_st + (wn * MMA_WN + j * 8 + g) * WF::ROW, b + 1, t, bf[(b + 1) & 1][j]);
                }
#pragma unroll
                for (int i = 0; i < MMA_MT; ++i)
#pragma unroll
                    for (int j = 0; j < MMA_NT; ++j)
                        mma_f16(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], bf[b & 1][j][ks][0], bf[b & 1][j][ks][1]);
            }
        }
    }
    cp_async_wait<0>();
    mma_store(acc, C, M, N, m0, n0, wm, wn, g, t);
}
