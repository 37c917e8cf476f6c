// Integer dot products on ggml blocks, and the per-block scale formulas.
//
// W4A8 (Q8_1 activations x Q4_0 weights). Q4_0 stores q_w in [0, 15] for w = d_w (q_w - 8), and
// Q8_1 stores a ~ d_a q_a with s_a = sum of the original a. Over one block:
//     sum_i a_i w_i ~ d_a d_w sum_i q_a,i (q_w,i - 8) = d_w (d_a sumi - 8 d_a sum_i q_a,i)
//                   ~ d_w (d_a sumi - 8 s_a),        sumi = sum_i q_a,i q_w,i  (stored nibbles)
// so the integer dot product runs on the unsigned nibbles and the -8 is paid once per block.
//
// DP4A pairing against the real Q4_0 layout: the 4 bytes qs[4i .. 4i+3] hold elements 4i..4i+3 in
// their low nibbles and 16+4i .. 16+4i+3 in their high nibbles. So
//     lo = packed & 0x0F0F0F0F   pairs with A's int i      (elements 4i   .. 4i+3)
//     hi = (packed >> 4) & 0x0F0F0F0F  pairs with A's int i+4 (elements 16+4i .. 16+4i+3)
// (The debugging story's test data packed adjacent pairs, (w1 << 4) | w0; its final kernel pairs
// nibbles for that layout and is wrong on real ggml weights: docs/dp4a.md works through it.)
#pragma once
#include "common/blocks.cuh"

static __device__ __forceinline__ int dp4a(int a, int b, int c) {
    return __dp4a(a, b, c);  // c + sum of the four signed byte products
}

// stored Q4_0 nibbles of 4 qs bytes -> (elements 4i..4i+3, elements 16+4i..16+4i+3) as bytes
static __device__ __forceinline__ void q4_0_split(int packed, int& lo, int& hi) {
    lo = packed & 0x0F0F0F0F;
    hi = (packed >> 4) & 0x0F0F0F0F;
}

static __device__ __forceinline__ float2 q8_1_ds(const block_q8_1* b) {
    return make_float2(__half2float(b->d), __half2float(b->s));
}

// The W4A8 block result from an integer dot product over the whole block.
static __device__ __forceinline__ float w4a8_block(float d_w, float d_a, float s_a, int sumi) {
    return d_w * (d_a * (float)sumi - 8.0f * s_a);
}

// Scalar byte-by-byte W4A8 block dot (the naive rungs): what DP4A replaces.
static __device__ __forceinline__ int sumi_q4_0_q8_1_scalar(const block_q4_0* w, const block_q8_1* a) {
    int sumi = 0;
#pragma unroll
    for (int j = 0; j < QK / 2; ++j) {
        const int q = w->qs[j];
        sumi += (int)a->qs[j] * (q & 0x0F) + (int)a->qs[j + QK / 2] * (q >> 4);
    }
    return sumi;
}

static __device__ __forceinline__ int sumi_q8_0_q8_1_scalar(const block_q8_0* w, const block_q8_1* a) {
    int sumi = 0;
#pragma unroll
    for (int j = 0; j < QK; ++j) sumi += (int)a->qs[j] * (int)w->qs[j];
    return sumi;
}
