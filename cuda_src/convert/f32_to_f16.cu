// float32 activations -> float16 (round to nearest even, __float2half_rn). The prologue of the
// fp16 tensor-core path. `status` bit 0: a non-finite input; bit 1: a finite value beyond half's
// range (it would become inf).
//
// Work is cut the way the GEMM behind consumes it: K in slices of 128 (one wgmma_rs stage), rows
// in blocks of 16. CTA (x, y) converts row block x of slices y, y + gridDim.y, ...: a thread owns
// one 16-byte column chunk (tid % 32) of rows tid / 32 + 8 j, and loads the next slice's chunks
// before it stores this one's, so two slices of loads are in flight.
//
// Two ways to hand Y to the GEMM:
// - plain (ready == null): the GEMM waits for this whole grid (griddepcontrol.wait);
// - streamed (ready != null, qgemm.matmul with programmatic dependent launch): after each slice,
//   the CTA publishes it -- its stores made visible at GPU scope (__threadfence by every thread,
//   then the CTA barrier), then ready[1 + slice] += 1 -- and the GEMM copies slice s as soon as
//   ready[1 + s] reaches the number of row blocks, while the rest is still being converted (the
//   GEMM zeroes the counts again when it ends: cuda_src/common/wgmma_rs_f16.cuh). The grid is then
//   small (about one CTA per SM, at most 40 registers a thread) so that it fits beside a wgmma_rs
//   CTA (384 threads of up to 144 registers).
//
// Programmatic dependent launch (common/pdl.cuh): this kernel may be launched while the previous
// op finishes, and waits for it before it reads X (the previous op's output) or writes Y (a
// staging buffer the previous op's GEMM may still be reading). It lets the GEMM behind it launch:
// - plain: at entry (the GEMM copies its first weights meanwhile), unless it also zeroes the
//   split-K GEMM's output (nz > 0): launched that early, the split-K wgmma_rs ran 2 us
//   (64x4096x4096) to 12 us (64x4096x14336) slower per op on the H100 (docs/perf/NOTES.md);
// - streamed: only after pdl_wait. The GEMM then polls `ready` instead of waiting for this grid,
//   so it must not start before the previous GEMM -- which zeroes `ready` -- has completed; and
//   every CTA of this grid is resident before the GEMM's CTAs launch (a grid's dependents launch
//   once all of its CTAs have triggered), so the slices the GEMM waits for always come.
// Z (nz floats, may be null): the split-K GEMM behind this kernel adds into it with atomics, so it
// is zeroed here rather than by a memset, which would stand between the two ops' kernels.
#include <cuda_fp16.h>
#include "common/pdl.cuh"

#define CV_ROWS 16     // rows per CTA and slice (256 threads = 8 rows of 32 chunks, 2 passes)
#define CV_SLICE 128   // K per slice: the GEMM's stage
#define CV_PASSES (CV_ROWS / 8)

struct CvSlice {
    float4 v[CV_PASSES];
};

// this thread's chunks of one slice: columns k .. k + 3 of rows r0 + 8 j whose bit j is set in
// `rows` (the rows inside M); zeros elsewhere (never stored). p = &X[r0][k], stride = 8 K.
static __device__ __forceinline__ CvSlice cv_load(const float* __restrict__ p, size_t stride, unsigned rows, bool vec) {
    CvSlice s;
#pragma unroll
    for (int j = 0; j < CV_PASSES; ++j, p += stride) {
        s.v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (rows & (1u << j)) {
            if (vec) {
                s.v[j] = __ldg(reinterpret_cast<const float4*>(p));
            } else {  // X not 16-byte aligned (a view at an odd offset); K % 4 == 0 keeps a chunk in one row
                s.v[j] = make_float4(p[0], p[1], p[2], p[3]);
            }
        }
    }
    return s;
}

static __device__ __forceinline__ int cv_round(float x, __half& h) {
    h = __float2half_rn(x);
    if (!isfinite(x)) return 1;
    return isinf(__half2float(h)) ? 2 : 0;
}

static __device__ __forceinline__ int cv_store(__half* __restrict__ q, size_t stride, const CvSlice& s, unsigned rows, bool vec) {
    int bad = 0;
#pragma unroll
    for (int j = 0; j < CV_PASSES; ++j, q += stride) {
        if (rows & (1u << j)) {
            __align__(8) __half h[4];
            bad |= cv_round(s.v[j].x, h[0]) | cv_round(s.v[j].y, h[1]) | cv_round(s.v[j].z, h[2]) | cv_round(s.v[j].w, h[3]);
            if (vec) {
                *reinterpret_cast<uint2*>(q) = *reinterpret_cast<const uint2*>(h);
            } else {
                q[0] = h[0], q[1] = h[1], q[2] = h[2], q[3] = h[3];
            }
        }
    }
    return bad;
}

extern "C" __global__ void __launch_bounds__(256)
convert_f32_to_f16(const float* __restrict__ X, __half* __restrict__ Y, int M, int K, int* __restrict__ status,
                   float* __restrict__ Z, long long nz, unsigned* __restrict__ ready) {
    if (ready == nullptr && nz == 0) pdl_launch_dependents();
    pdl_wait();
    if (ready != nullptr) pdl_launch_dependents();
    if (nz > 0) {
        const long long nthreads = (long long)gridDim.x * gridDim.y * blockDim.x;
        const long long tid = ((long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
        if ((((size_t)Z) & 15) == 0) {
            for (long long j = tid; j < nz / 4; j += nthreads) reinterpret_cast<float4*>(Z)[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            for (long long j = nz / 4 * 4 + tid; j < nz; j += nthreads) Z[j] = 0.0f;
        } else {
            for (long long j = tid; j < nz; j += nthreads) Z[j] = 0.0f;
        }
    }
    const int nslices = (K + CV_SLICE - 1) / CV_SLICE;
    const int r0 = blockIdx.x * CV_ROWS + threadIdx.x / 32, c = 4 * (threadIdx.x % 32);
    const bool vx = (((size_t)X) & 15) == 0, vy = (((size_t)Y) & 7) == 0;
    const size_t stride = (size_t)8 * K;
    unsigned rows = 0;
#pragma unroll
    for (int j = 0; j < CV_PASSES; ++j) rows |= (r0 + 8 * j < M ? 1u : 0u) << j;
    // (a thread's chunk lies past K only in the last slice, when K % 128 is 32, 64 or 96)
    int bad = 0;
    int s = blockIdx.y;
    CvSlice cur;
    if (s < nslices) cur = cv_load(X + (size_t)r0 * K + s * CV_SLICE + c, stride, (s * CV_SLICE + c < K ? rows : 0u), vx);
    for (; s < nslices; s += gridDim.y) {
        const int sn = s + gridDim.y;
        CvSlice nxt;
        if (sn < nslices) nxt = cv_load(X + (size_t)r0 * K + sn * CV_SLICE + c, stride, (sn * CV_SLICE + c < K ? rows : 0u), vx);
        bad |= cv_store(Y + (size_t)r0 * K + s * CV_SLICE + c, stride, cur, (s * CV_SLICE + c < K ? rows : 0u), vy);
        if (ready != nullptr) {
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) atomicAdd(ready + 1 + s, 1u);
        }
        cur = nxt;
    }
    if (bad) atomicOr(status, bad);
}
