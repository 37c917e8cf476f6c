// ggml block formats, byte-for-byte. Shared by every kernel in cuda_src/.
//
// A block covers QK = 32 consecutive values along K (the reduction dimension).
//
//   block_q4_0  {half d; uint8 qs[16];}         18 B   x[j] = d * ((qs[j] & 0xF) - 8),
//                                                      x[j+16] = d * ((qs[j] >> 4) - 8)   (j < 16)
//   block_q8_0  {half d; int8 qs[32];}          34 B   x[j] = d * qs[j]
//   block_q8_1  {half d; half s; int8 qs[32];}  36 B   x[j] ~ d * qs[j],  s = sum of the original x
//
// Alignment hazard: sizeof(block_q4_0) = 18 and sizeof(block_q8_0) = 34, so in an array of blocks
// only every other block starts on a 4-byte boundary. Their qs may be read 2 bytes at a time
// (load_int_b2), never as int. block_q8_1 is 36 B, so its qs (offset 4) can be read as int
// (load_int_b4).
#pragma once
#include <cuda_fp16.h>

#define QK 32

typedef unsigned char qg_u8;
typedef signed char qg_i8;

// max(a, b) that is NaN when either is (fmaxf drops a NaN operand). The activation quantizers take
// a block's amax through it, so a NaN value makes the block's scale NaN and every product with the
// block NaN, as on the fp16 paths; with fmaxf the NaN became code 0 and the result finite (on device
// operands nothing else would say so: reading a kernel's status word would need a synchronization).
static __device__ __forceinline__ float qg_fmax_nan(float a, float b) {
#if __CUDA_ARCH__ >= 800
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));  // one FMNMX, as fmaxf
    return r;
#else
    return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
#endif
}

struct block_q4_0 {
    __half d;
    qg_u8 qs[QK / 2];
};
struct block_q8_0 {
    __half d;
    qg_i8 qs[QK];
};
struct block_q8_1 {
    __half d;
    __half s;
    qg_i8 qs[QK];
};

static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes (ggml layout)");
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes (ggml layout)");
static_assert(sizeof(block_q8_1) == 36, "block_q8_1 must be 36 bytes (ggml layout)");
static_assert(alignof(block_q4_0) == 2 && alignof(block_q8_0) == 2 && alignof(block_q8_1) == 2,
              "blocks are 2-byte aligned: only 16-bit loads are safe on q4_0/q8_0 arrays");

// 4 bytes starting at int index i of a 2-byte aligned buffer, as two 16-bit loads.
static __device__ __forceinline__ int load_int_b2(const void* p, int i) {
    const unsigned short* x16 = (const unsigned short*)p;
    return (int)x16[2 * i] | ((int)x16[2 * i + 1] << 16);
}

// 4 bytes starting at int index i of a 4-byte aligned buffer. i is an *int* index, not a byte
// index: load_int_b4(qs, i + 4) reads bytes 16 + 4i .. 19 + 4i, which is exactly what the Q4_0
// high nibbles pair with (docs/dp4a.md, docs/debugging.md).
static __device__ __forceinline__ int load_int_b4(const void* p, int i) {
    return ((const int*)p)[i];
}
