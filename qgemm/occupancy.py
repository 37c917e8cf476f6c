"""How many CTAs of a compiled kernel one SM holds at once, and how many waves a grid of them takes.

The decode kernels' defaults are chosen by waves (docs/production.md, sessions 56-59): a grid
that spills a few CTAs past what the SMs hold runs a second, mostly idle wave. What an SM holds is
the least of four limits -- CTAs per SM, threads per SM, registers and shared memory -- each from
the architecture's documented limits (the CUDA C++ Programming Guide, "Technical Specifications per
Compute Capability") and the kernel's compiled resources (`qgemm compile` shows them). This module
computes it without a GPU, for the architectures qgemm compiles for in CI; on a GPU the driver
answers the same question (`cuda.core`'s `Kernel.occupancy`), and tests/test_gpu_kernels.py checks
the two agree on sm_90.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SMLimits:
    max_ctas: int       # resident CTAs per SM
    max_threads: int    # resident threads per SM
    smem: int           # shared memory per SM a kernel can use, bytes
    smem_reserved: int  # shared memory the system takes per CTA, bytes
    registers: int = 65536


# compute capability -> limits (sm_75 ... sm_90: what qgemm compiles for in CI)
LIMITS = {
    75: SMLimits(max_ctas=16, max_threads=1024, smem=64 * 1024, smem_reserved=0),
    80: SMLimits(max_ctas=32, max_threads=2048, smem=164 * 1024, smem_reserved=1024),
    86: SMLimits(max_ctas=16, max_threads=1536, smem=100 * 1024, smem_reserved=1024),
    87: SMLimits(max_ctas=16, max_threads=1536, smem=164 * 1024, smem_reserved=1024),
    89: SMLimits(max_ctas=24, max_threads=1536, smem=100 * 1024, smem_reserved=1024),
    90: SMLimits(max_ctas=32, max_threads=2048, smem=228 * 1024, smem_reserved=1024),
}

# Registers are allocated per warp in units of 256, and an SM's register file is four partitions of
# 16 K registers, one per warp scheduler: a warp's registers lie in one partition.
_REG_UNIT, _PARTITIONS = 256, 4
_SMEM_UNIT = 128  # shared memory is allocated per CTA in units of 128 bytes


@dataclass(frozen=True)
class Occupancy:
    ctas_per_sm: int
    limited_by: tuple[str, ...]  # the limits that bind: "CTAs", "threads", "registers", "shared memory"

    def waves(self, ctas: int, sm_count: int) -> float:
        """How many times the SMs' CTA slots a grid of `ctas` fills (2.1: two full waves and a tenth)."""
        return ctas / (self.ctas_per_sm * sm_count) if self.ctas_per_sm else float("inf")


def resident_ctas(cc: int, threads: int, registers: int, smem: int) -> Occupancy:
    """CTAs of `threads` threads, `registers` registers a thread and `smem` bytes of shared memory
    (static + dynamic) one SM of compute capability `cc` (e.g. 90) holds at once. ValueError for an
    architecture without a table entry (LIMITS) or a CTA that cannot run at all."""
    lim = LIMITS.get(cc)
    if lim is None:
        raise ValueError(f"occupancy: no limits table for sm_{cc} (known: "
                         + ", ".join(f"sm_{c}" for c in sorted(LIMITS)) + ")")
    if threads < 1 or registers < 0 or smem < 0:
        raise ValueError(f"occupancy: a CTA needs threads >= 1, registers >= 0 and smem >= 0, got {threads}, {registers}, {smem}")
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // _REG_UNIT) * _REG_UNIT
    by = {"CTAs": lim.max_ctas,
          "threads": lim.max_threads // (warps * 32),
          "registers": _PARTITIONS * (lim.registers // _PARTITIONS // per_warp) // warps,
          "shared memory": lim.smem // max(_SMEM_UNIT, -(-(smem + lim.smem_reserved) // _SMEM_UNIT) * _SMEM_UNIT)}
    n = min(by.values())
    if n == 0:
        what = ", ".join(k for k, v in by.items() if v == 0)
        raise ValueError(f"occupancy: a CTA of {threads} threads, {registers} registers a thread and {smem} bytes of shared "
                         f"memory does not fit an sm_{cc} SM ({what})")
    return Occupancy(n, tuple(k for k, v in by.items() if v == n))


def of_launch(cc: int, launch, resources) -> Occupancy:
    """`resident_ctas` of one launch: its block's threads and dynamic shared memory (an
    `ops.Launch`, from `Kernel.geometry`) with the compiled kernel's registers and static shared
    memory (`jit.CompiledKernel.resources[entry]`)."""
    threads = launch.block[0] * launch.block[1] * launch.block[2]
    return resident_ctas(cc, threads, resources.registers, resources.smem_static + launch.shmem)
