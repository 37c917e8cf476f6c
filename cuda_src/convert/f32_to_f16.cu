// float32 activations -> float16 (round to nearest even, __float2half_rn), 8 values per thread
// with 16-byte loads and stores where the row allows. The prologue of the W4A16 tensor-core path.
// `status` bit 0: a non-finite input; bit 1: a finite value beyond half's range (it would become inf).
// Programmatic dependent launch (common/pdl.cuh): the GEMM queued behind this kernel may start
// its weight copies at once (it waits for this grid before reading Y), and this kernel itself may
// be launched while the previous op finishes: it waits for that before it reads X (the previous
// op's output) or writes Y (a staging buffer the previous op's GEMM may still be reading).
// Z (nz floats, may be null): the split-K GEMM behind this kernel adds into it with atomics, so it
// is zeroed here rather than by a memset, which would stand between the two ops' kernels.
#include <cuda_fp16.h>
#include "common/pdl.cuh"

extern "C" __global__ void __launch_bounds__(256)
convert_f32_to_f16(const float* __restrict__ X, __half* __restrict__ Y, int M, int K, int* __restrict__ status,
                   float* __restrict__ Z, long long nz) {
    // The GEMM behind may launch now and copy its first weights -- unless it splits K (nz > 0):
    // launched that early, the split-K wgmma_rs ran 2 us (64x4096x4096) to 12 us (64x4096x14336)
    // slower per op on the H100 (docs/perf/NOTES.md; without the early trigger it still launches
    // as a dependent when this grid ends, which is where its gain is).
    if (nz == 0) pdl_launch_dependents();
    pdl_wait();
    if (nz > 0) {
        const long long nthreads = (long long)gridDim.x * blockDim.x, tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        if ((((size_t)Z) & 15) == 0) {
            for (long long j = tid; j < nz / 4; j += nthreads) reinterpret_cast<float4*>(Z)[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            for (long long j = nz / 4 * 4 + tid; j < nz; j += nthreads) Z[j] = 0.0f;
        } else {
            for (long long j = tid; j < nz; j += nthreads) Z[j] = 0.0f;
        }
    }
    const size_t total = (size_t)M * K;
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= total) return;
    int bad = 0;
    if (i + 8 <= total && (((size_t)(X + i)) & 15) == 0) {
        const float4 a = *(const float4*)(X + i), b = *(const float4*)(X + i + 4);
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        __align__(16) __half h[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            h[j] = __float2half_rn(v[j]);
            if (!isfinite(v[j])) bad |= 1;
            else if (isinf(__half2float(h[j]))) bad |= 2;
        }
        *(int4*)(Y + i) = *(const int4*)h;
    } else {
        for (size_t j = i; j < i + 8 && j < total; ++j) {
            const __half h = __float2half_rn(X[j]);
            if (!isfinite(X[j])) bad |= 1;
            else if (isinf(__half2float(h))) bad |= 2;
            Y[j] = h;
        }
    }
    if (bad) atomicOr(status, bad);
}
