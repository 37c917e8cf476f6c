// float32 activations -> float16 (round to nearest even, __float2half_rn), 8 values per thread
// with 16-byte loads and stores where the row allows. The prologue of the W4A16 tensor-core path.
// `status` bit 0: a non-finite input; bit 1: a finite value beyond half's range (it would become inf).
#include <cuda_fp16.h>

extern "C" __global__ void __launch_bounds__(256)
convert_f32_to_f16(const float* __restrict__ X, __half* __restrict__ Y, int M, int K, int* __restrict__ status) {
#if __CUDA_ARCH__ >= 900
    // let a kernel launched after this one with programmatic dependent launch (the wgmma GEMMs)
    // start its independent prologue now; it waits for this grid's completion before reading Y
    asm volatile("griddepcontrol.launch_dependents;\n");
#endif
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
