// float16 activations -> the kperm16 layout of the Hopper prefill kernels (k deinterleaved inside
// every 16: common/convert.cuh), 8 values per thread. The prologue of `qgemm.matmul` with float16
// activations on the wgmma path; the values are copied, not changed, so `status` is never set
// (it is there for the prologue calling convention). PDL and the split-K zeroing of Z: the
// shared convert_begin (common/convert.cuh).
#include "common/convert.cuh"

extern "C" __global__ void __launch_bounds__(256)
convert_f16_kperm(const __half* __restrict__ X, __half* __restrict__ Y, int M, int K, int* __restrict__ status,
                  float* __restrict__ Z, long long nz) {
    convert_begin(Z, nz);  // PDL trigger and wait, the split-K output zeroed (common/convert.cuh)
    const size_t total = (size_t)M * K;
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;  // K % 16 == 0: both lanes of a chunk run
    if (i >= total) return;
    __align__(16) __half h[8];
    if ((((size_t)(X + i)) & 15) == 0) {
        *(int4*)h = *(const int4*)(X + i);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) h[j] = X[i + j];
    }
    store_kperm16(Y, i, total, h);
}
