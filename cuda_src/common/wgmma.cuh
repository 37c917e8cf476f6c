// Hopper (sm_90a) warpgroup-MMA primitives shared by the wgmma kernels (common/wgmma_f16.cuh: both
// operands from shared memory; common/wgmma_rs_f16.cuh: weights from registers): the shared-memory
// matrix descriptor, the wgmma instructions, their fences, and mbarriers.
//
// wgmma is asynchronous: it reads its shared-memory operands (and its register A operand, and
// writes its accumulators) some time after issue, until a wgmma.wait_group says the group is done.
// Hence the three hazards every kernel here respects: generic-proxy writes to shared memory
// (st.shared, cp.async) need fence.proxy.async before a wgmma may read them; registers a wgmma
// reads or accumulates into need wgmma.fence before the wgmma, and must not be touched again until
// a wait_group has retired it (ptxas serializes the wgmma, with a warning, when they are).
#pragma once
#include <cuda_fp16.h>

// wgmma shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 B apart.
// Low word: the start address / 16 (14 bits) and the leading byte offset field (1 << 16); high word:
// the stride between 8-row groups / 16 and the 128-byte swizzle mode (bit 62).
// wg_desc(addr + off) == wg_desc_at(wg_desc_lo(addr), off) for 16-byte multiples off while
// addr + off stays below 256 KB (all of shared memory), since the 14-bit address field in the low
// word then cannot carry: one 32-bit add per wgmma instead of recomputing and masking the whole
// descriptor.
static __device__ __forceinline__ unsigned wg_desc_lo(unsigned smem_addr) { return ((smem_addr & 0x3FFFF) >> 4) | (1u << 16); }
static __device__ __forceinline__ unsigned long long wg_desc_at(unsigned desc_lo, unsigned off) {
    return ((unsigned long long)((1024 >> 4) | (1u << 30)) << 32) | (desc_lo + (off >> 4));
}
static __device__ __forceinline__ unsigned long long wg_desc(unsigned smem_addr) { return wg_desc_at(wg_desc_lo(smem_addr), 0); }

static __device__ __forceinline__ void wg_cp_async16_zfill(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

#define WG_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// D[64 x 128] += A[64 x 16] . B[128 x 16]^T, both K-major in shared memory
static __device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long da, unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, 1, 1, 1, 0, 0;\n"
        : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24), WG_ACC8(32), WG_ACC8(40), WG_ACC8(48), WG_ACC8(56)
        : "l"(da), "l"(db));
}

static __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// an optimization barrier on one register: the compiler may not move its definitions or uses
// across it (CUTLASS's warpgroup_fence_operand). Used after a wait_group so that the next values of
// a register an in-flight wgmma reads are not computed into it before that wgmma has retired.
static __device__ __forceinline__ void wg_fence_operand(unsigned& r) { asm volatile("" : "+r"(r)::"memory"); }
static __device__ __forceinline__ void wg_fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
static __device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

static __device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// wait until the phase of parity `parity` has completed. A ring's buffer b serves stages b,
// b + STAGES, ... (round r = s / STAGES), and each of its mbarriers completes one phase per round:
// stage s's data is phase r of full[b] (parity r & 1); refilling b for round r >= 1 needs the
// consumers' release of round r - 1, phase r - 1 of empty[b]. One parity bit suffices because no
// waiter can fall two phases behind: the other side cannot complete the next phase before this
// one acts.
static __device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}


// D[64 x 64] += A[64 x 16] . B[64 x 16]^T, A from registers (the m16n8k16 A fragment of warp w's
// rows 16w .. 16w + 15), B K-major in shared memory
static __device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[32], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
        : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// D[64 x 128] += A[64 x 16] . B[128 x 16]^T, A from registers (the m16n8k16 A fragment of warp w's
// rows 16w .. 16w + 15), B K-major in shared memory
static __device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
        : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24), WG_ACC8(32), WG_ACC8(40), WG_ACC8(48), WG_ACC8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// D[64 x 256] += A[64 x 16] . B[256 x 16]^T, A from registers (the m16n8k16 A fragment of warp w's
// rows 16w .. 16w + 15), B K-major in shared memory
static __device__ __forceinline__ void wgmma_rs_m64n256k16(float (&d)[128], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"
        : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24), WG_ACC8(32), WG_ACC8(40), WG_ACC8(48), WG_ACC8(56), WG_ACC8(64), WG_ACC8(72), WG_ACC8(80), WG_ACC8(88), WG_ACC8(96), WG_ACC8(104), WG_ACC8(112), WG_ACC8(120)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
