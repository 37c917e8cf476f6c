// Programmatic dependent launch (PDL, sm_90+): how qgemm's kernels overlap the kernel before them.
//
// A kernel launched with the programmatic-stream-serialization attribute (qgemm.runtime, where the
// GPU and cuda.core support it) may start once every CTA of the previous kernel in the stream has
// executed pdl_launch_dependents() (or exited), instead of after that kernel's completion. It must
// then call pdl_wait() -- which returns when the previous grid has completed and its memory is
// visible -- before it reads anything a previous kernel may write, and before it writes anything a
// previous kernel may still read. qgemm's kernels read only their weights (the mustafar.* kernels:
// the compressed KV cache) above the wait: a kernel that never triggers (any non-qgemm kernel)
// releases its dependents only at completion, so the weights they read are always final. The one
// qgemm kernel that writes weights -- the repacking pack.* (cuda_src/pack/skinny.cu), into a copy
// that the op's GEMM then reads -- is followed by a GEMM launched *without* the attribute
// (qgemm.matmul's Plan.launch, ops.Kernel given device blocks), which therefore starts only after
// the repacking has completed. Launched without the attribute, or on GPUs before sm_90, both are
// no-ops.
#pragma once

static __device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
