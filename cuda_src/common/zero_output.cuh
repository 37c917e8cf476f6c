// Zeroing a split-K GEMM's output. A GEMM that splits K across CTAs adds each slice's partial
// sums into C with atomics, so C must hold zeros first. The convert.* prologues zero it
// themselves (convert.cuh). Where no prologue can -- the skinny kernels reading float32 / 16-bit x
// as given, with SK_GSPLIT > 1 (the fp16-MMA skinny kernels' default from 2 tokens at K >= 8192,
// except Q8_0 at 9-16 tokens; a tuned configuration otherwise) -- the launcher queues
// qgemm_zero_output, an entry of their modules (qgemm.ops.ZERO_ENTRY, KernelSpec.helpers),
// instead of a memset. A memset is no kernel: the GEMM behind it cannot be launched early
// (programmatic dependent launch, common/pdl.cuh), so it started only after the memset had
// completed, with nothing of its start hidden. H100, kernel alone, hot, memset against this
// kernel (docs/perf/NOTES.md, session 49): w4a16.skinny 2x4096x14336 17.8 -> 16.1 us, 16x4096x14336
// 25.3 -> 19.7; w8a16.skinny 8x4096x14336 25.7 -> 23.9. The mma and wgmma kernels keep the memset:
// launched without PDL, the mma kernels gained nothing from it (w4a8.mma 16x4096x4096 14.25 against
// 14.6), and in qgemm.matmul the split wgmma_rs always has a zeroing prologue.
// The Mustafar value modules keep a kernel of their own (mustafar_zero_output, common/mustafar.cuh:
// scalar stores, an int count, a CTA per 256 floats): with this one instead the value ops measured
// 0.15-0.4 us slower (H100, cold, one process, three alternating rounds: 32x16384x128 value fp16
// 26.56 -> 26.95 us, q2 23.72 -> 24.06; 32x4096 q2 10.30 -> 10.45; this kernel on that grid no
// better), cause not found.
// Modules that include this file only through another (convert.*, the wgmma kernels) carry the
// entry unused.
#pragma once
#include "common/pdl.cuh"

// Z[0 .. nz) = 0 by the whole grid, 16-byte stores where Z is 16-byte aligned.
static __device__ __forceinline__ void zero_floats(float* __restrict__ Z, long long nz) {
    const long long nthreads = (long long)gridDim.x * blockDim.x, tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((((size_t)Z) & 15) == 0) {
        for (long long j = tid; j < nz / 4; j += nthreads) reinterpret_cast<float4*>(Z)[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (long long j = nz / 4 * 4 + tid; j < nz; j += nthreads) Z[j] = 0.0f;
    } else {
        for (long long j = tid; j < nz; j += nthreads) Z[j] = 0.0f;
    }
}

// release_early = 1: the kernel behind may launch at once and stream its first weights while
// this one waits and zeroes (that kernel waits for this grid -- so for everything before it --
// before its first atomic add). 0: it launches as a dependent when this grid ends (measured
// slower for the skinny kernels: 2x4096x14336 17.2 us against 16.1). Either way this kernel waits
// for the kernel before it, which may still read or write `out` (the previous op writing the same
// C, say), before it stores a zero.
extern "C" __global__ void __launch_bounds__(256)
qgemm_zero_output(float* __restrict__ out, long long n, int release_early) {
    if (release_early) pdl_launch_dependents();
    pdl_wait();
    zero_floats(out, n);
}
