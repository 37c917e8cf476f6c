// The read ceilings of the benchmark (qgemm.bench.read_ceiling): the fastest that a kernel which
// only reads N bytes, once and in order, runs on this GPU when launched back to back the way the
// bench times a decode op. A decode GEMV reads its weights once and writes a few kilobytes, so the
// copy bandwidth (bytes read + written by a 512 MB device-to-device copy) is not quite its roof:
// a few megabytes per launch pay the launch, the ramp of the DRAM queues and the last wave's tail
// every time. This kernel pays the same and nothing else.
//
// Two ceilings, by where the reads sit against programmatic dependent launch (common/pdl.cuh;
// both release the next launch at entry):
//   RD_DEPENDENT 0: no wait before the loads. Consecutive launches overlap completely, as if
//     each op's weights were independent of the op before -- the upper bound for any op.
//   RD_DEPENDENT 1: pdl_wait before the first load, as if every byte depended on the previous
//     op's result. A decode op's weights never do (only its activations), so a decode kernel that
//     starts its weight loads before its wait can be faster than this; one that cannot is bounded
//     by it.
//
// Each CTA reads one contiguous slice, RD_UNROLL 16-byte loads per thread per iteration,
// bypassing L1 (the bytes are used once). The XOR of what a CTA read goes to out[blockIdx.x]: the
// loads stay live, and a test can check that every byte was read.
#include "common/pdl.cuh"

#ifndef RD_UNROLL
#define RD_UNROLL 2
#endif
#ifndef RD_DEPENDENT
#define RD_DEPENDENT 0
#endif

static __device__ __forceinline__ uint4 load_once(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

extern "C" __global__ void stream_read(const uint4* __restrict__ buf, unsigned long long n16, unsigned* __restrict__ out) {
    pdl_launch_dependents();
#if RD_DEPENDENT
    pdl_wait();
#endif
    const unsigned long long per = (n16 + gridDim.x - 1) / gridDim.x;
    const unsigned long long begin = blockIdx.x * per;
    const unsigned long long end = begin + per < n16 ? begin + per : n16;
    const unsigned step = blockDim.x;
    unsigned acc = 0u;
    unsigned long long i = begin + threadIdx.x;
    for (; i + (RD_UNROLL - 1) * step < end; i += RD_UNROLL * step) {
        uint4 v[RD_UNROLL];
#pragma unroll
        for (int u = 0; u < RD_UNROLL; ++u) v[u] = load_once(buf + i + u * step);
#pragma unroll
        for (int u = 0; u < RD_UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < end; i += step) {
        const uint4 v = load_once(buf + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __shared__ unsigned part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned w = 1; w < (blockDim.x + 31) / 32; ++w) acc ^= part[w];
#if !RD_DEPENDENT
        pdl_wait();  // the previous launch may still write out[]
#endif
        out[blockIdx.x] = acc;
    }
}
