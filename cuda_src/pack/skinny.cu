// ggml Q4_0 / Q8_0 blocks [N, K/32] -> the skinny layout, on the GPU (`pack.q4_0`, `pack.q8_0`).
//
// The layout is drawn in qgemm/packing.py (whose numpy `pack` is this kernel's byte-for-byte
// reference) and docs/formats.md:
//   qs  [tiles of 16 rows][groups of 4 blocks][pieces][32 lanes (g, t)][16 B]
//       Q4_0: piece h       -> qs word t of blocks 4G .. 4G+3, row 16T + g + 8h
//       Q8_0: piece (h, p)  -> qs words t, t+4 of block 4G+2p, then of 4G+2p+1, row 16T + g + 8h
//   d   [tiles][groups][8 (g)][8 halves]: d(row 16T + g + 8h, block 4G + j) at half 4h + j
// Rows past N and blocks past K/32 are padding: d = 0 and quants that dequantize to exactly 0
// (nibbles 8 for Q4_0, bytes 0 for Q8_0), so they add exact zeros.
//
// A CTA repacks one tile of 16 rows x PK_GROUPS groups of 4 blocks, one thread per (row, group):
// the thread reads its group's 72 / 136 contiguous bytes (8-byte loads where the rows allow,
// 16-bit ones otherwise: a ggml block is 18 or 34 bytes, so its fields are only 2-byte aligned),
// consecutive threads taking consecutive groups of a row (coalesced), and puts what they become
// into shared memory in the output's order; then the CTA writes its output -- one contiguous
// range of quants and one of scales, since consecutive groups of a tile are consecutive in both
// parts -- in 16-byte stores, consecutive threads at consecutive addresses. (The first form wrote
// each thread's 64 bytes straight to global memory, 1 KB apart between neighbouring threads:
// 1.2 TB/s on the H100 against 1.7-1.8 for a thread per 16-byte output chunk and more here.)
// Every byte of the output is written, the padding included: it needs no zeroing.
//
// `status` (may be null: qgemm.matmul's per-call repacking checks nothing): int[2], both set to
// INT_MAX by the caller; each thread atomicMins into [0] the index row * (K/32) + block of
// a block whose dequantized weights d x q do not fit float16 (|d x q| >= 65520, the test of
// formats.f16_dequant_overflow, with its exact q), into [1] that of a block whose d is not
// finite. So the smallest index -- the first such block in row-major order -- comes back.
//
// Programmatic dependent launch (common/pdl.cuh): the output may be a buffer the previous
// kernel in the stream still reads (qgemm.matmul repacks into a per-stream scratch that the
// previous call's GEMM reads), so every store into P waits (the `status` atomics above the wait go
// to the caller's own int[2], which no earlier kernel reads); the loads above the wait read only
// weights.
// (qgemm launches it without the attribute: released early behind the previous op's GEMM, the
// Q8_0 repacking measured 30% slower on the H100 -- the wait is there for a launch that has it.)
#include <cuda_fp16.h>
#include "common/pdl.cuh"

#ifndef PK_Q8
#define PK_Q8 0  // 1: Q8_0 blocks (34 bytes), 0: Q4_0 (18 bytes)
#endif
#if PK_Q8
#define PK_BLOCK_BYTES 34
#define PK_PIECES 4
#define PK_PAD_WORD 0u  // int8 0
#define PK_QMAX 128.0f  // the largest |q| a block can hold
#else
#define PK_BLOCK_BYTES 18
#define PK_PIECES 2
#define PK_PAD_WORD 0x88888888u  // nibbles 8: 8 - 8 = 0
#define PK_QMAX 8.0f             // the largest |q - 8|
#endif
#define PK_F16_INF_FROM 65520.0f  // float32 values from here round to inf in float16

typedef unsigned short pk_u16;

// the largest |q - 8| (Q4_0) or |q| (Q8_0) of a block: only asked for the rare block whose d
// alone could overflow float16
static __device__ float pk_block_qmax(const unsigned char* __restrict__ blk) {
    int mx = 0;
#if PK_Q8
    for (int i = 0; i < 32; ++i) mx = max(mx, abs((int)(signed char)blk[2 + i]));
#else
    for (int i = 0; i < 16; ++i) mx = max(mx, max(abs((blk[2 + i] & 15) - 8), abs((blk[2 + i] >> 4) - 8)));
#endif
    return (float)mx;
}

#define PK_GROUP_BYTES (4 * PK_BLOCK_BYTES)
#define PK_GROUP_WORDS (PK_GROUP_BYTES / 2)  // 16-bit words: 36 (Q4_0), 68 (Q8_0)
#define PK_GROUPS 16                          // groups per CTA: 16 rows x 16 groups = 256 threads
#define PK_QS_CHUNKS (PK_PIECES * 32)         // 16-byte chunks of quants per (tile, group)
// shared memory: per group its quant chunks plus one chunk of padding (so the 16 groups of a
// warp's stores fall in different banks), then the scale chunks [group][g]
#define PK_QS_STRIDE (PK_QS_CHUNKS + 1)

extern "C" __global__ void __launch_bounds__(256)
pack_skinny(const unsigned char* __restrict__ W, unsigned char* __restrict__ P, int N, int K, int* __restrict__ status) {
    __shared__ uint4 sq[PK_GROUPS * PK_QS_STRIDE];
    __shared__ uint2 sd[PK_GROUPS * 8 * 2];
    const int nb = K / 32, groups = (nb + 3) / 4, tiles = (N + 15) / 16;
    const int T = blockIdx.y, G0 = blockIdx.x * PK_GROUPS, ng = min(PK_GROUPS, groups - G0);
    const int gl = threadIdx.x % PK_GROUPS, rl = threadIdx.x / PK_GROUPS;  // this thread's group and row in the tile
    const int r = 16 * T + rl, G = G0 + gl, g = rl % 8, h = rl / 8;
    if (gl < ng) {
        // the group's bytes as 16-bit words (held in registers: every index below is a constant)
        pk_u16 v[PK_GROUP_WORDS];
        const bool row = r < N, whole = row && 4 * G + 4 <= nb;
        const unsigned char* src = W + ((size_t)r * nb + 4 * G) * PK_BLOCK_BYTES;
        if (whole && (((size_t)src) & 7) == 0) {  // nb % 4 == 0 and an 8-byte aligned start: 8-byte loads
#pragma unroll
            for (int j = 0; j < PK_GROUP_BYTES / 8; ++j) {
                const unsigned long long u = __ldg(reinterpret_cast<const unsigned long long*>(src) + j);
                v[4 * j] = (pk_u16)u, v[4 * j + 1] = (pk_u16)(u >> 16);
                v[4 * j + 2] = (pk_u16)(u >> 32), v[4 * j + 3] = (pk_u16)(u >> 48);
            }
        } else {
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const bool real = row && 4 * G + b < nb;
                const pk_u16* blk = reinterpret_cast<const pk_u16*>(src + b * PK_BLOCK_BYTES);
#pragma unroll
                for (int j = 0; j < PK_BLOCK_BYTES / 2; ++j)  // word 0: d = 0; then the padding quants
                    v[b * (PK_BLOCK_BYTES / 2) + j] = real ? __ldg(blk + j) : (j == 0 ? (pk_u16)0 : (pk_u16)(PK_PAD_WORD & 0xFFFF));
            }
        }
        if (status != nullptr && row) {
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                if (4 * G + b >= nb) break;
                const pk_u16 bits = v[b * (PK_BLOCK_BYTES / 2)];
                const float ad = fabsf(__half2float(__ushort_as_half(bits)));
                const int at = r * nb + 4 * G + b;
                if ((bits & 0x7C00u) == 0x7C00u) atomicMin(status + 1, at);  // inf or NaN
                if (ad * PK_QMAX >= PK_F16_INF_FROM && ad * pk_block_qmax(src + b * PK_BLOCK_BYTES) >= PK_F16_INF_FROM)
                    atomicMin(status, at);
            }
        }
        // qs word w of block b (block b starts at 16-bit word b * BLOCK_BYTES / 2, its qs one later)
#define PK_QS(b, w) ((unsigned)v[(b) * (PK_BLOCK_BYTES / 2) + 1 + 2 * (w)] | ((unsigned)v[(b) * (PK_BLOCK_BYTES / 2) + 2 + 2 * (w)] << 16))
        uint4* const q = sq + gl * PK_QS_STRIDE;  // chunk (piece, lane g * 4 + t) of this group
#pragma unroll
        for (int t = 0; t < 4; ++t) {
#if PK_Q8
#pragma unroll
            for (int p = 0; p < 2; ++p)  // piece (h, p): qs words t, t + 4 of block 2p, then of 2p + 1
                q[(2 * h + p) * 32 + g * 4 + t] = make_uint4(PK_QS(2 * p, t), PK_QS(2 * p, t + 4), PK_QS(2 * p + 1, t),
                                                            PK_QS(2 * p + 1, t + 4));
#else
            q[h * 32 + g * 4 + t] = make_uint4(PK_QS(0, t), PK_QS(1, t), PK_QS(2, t), PK_QS(3, t));  // piece h: word t of blocks 0..3
#endif
        }
#undef PK_QS
        // the 4 scales at halves 4h .. 4h + 3 of scale chunk (group, g)
        sd[(gl * 8 + g) * 2 + h] = make_uint2((unsigned)v[0] | ((unsigned)v[PK_BLOCK_BYTES / 2] << 16),
                                              (unsigned)v[PK_BLOCK_BYTES] | ((unsigned)v[3 * PK_BLOCK_BYTES / 2] << 16));
    }
    __syncthreads();
    pdl_wait();
    // the quants of groups G0 .. G0 + ng - 1 of tile T are one contiguous range, as are their scales
    const size_t tg = (size_t)T * groups + G0;
    uint4* const oq = reinterpret_cast<uint4*>(P) + tg * PK_QS_CHUNKS;
    for (int c = threadIdx.x; c < ng * PK_QS_CHUNKS; c += blockDim.x)
        oq[c] = sq[(c / PK_QS_CHUNKS) * PK_QS_STRIDE + c % PK_QS_CHUNKS];
    uint4* const od = reinterpret_cast<uint4*>(P) + (size_t)tiles * groups * PK_QS_CHUNKS + tg * 8;
    const uint4* const sd4 = reinterpret_cast<const uint4*>(sd);
    for (int c = threadIdx.x; c < ng * 8; c += blockDim.x) od[c] = sd4[c];
}
