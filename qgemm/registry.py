"""The kernel registry: one entry per kernel, `family.variant` -> source, entry symbol, op,
launch geometry, minimum arch. Adding a kernel is one .cu file under cuda_src/ and one entry here.
"""

from __future__ import annotations

import difflib
import threading
from dataclasses import dataclass, field
from typing import Callable

from . import ops
from .ops import Launch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KernelSpec:
    name: str  # "family.variant"
    op: ops.Op
    step: int  # tutorial step that introduces it
    source: str  # path under cuda_src/
    entry: str  # extern "C" symbol
    geometry: Callable[[int, int, int], Launch]  # (M, N, K) -> grid, block, dynamic smem
    description: str
    min_arch: int = 75  # NVRTC 13 targets sm_75 and newer
    arch_suffix: str = ""  # "a" for arch-specific features (wgmma needs sm_90a)
    defines: dict = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def variant(self) -> str:
        return self.name.split(".", 1)[1]


def _thread_per_output(m: int, n: int, k: int) -> Launch:
    return Launch(grid=(cdiv(n, 16), cdiv(m, 16), 1), block=(16, 16, 1))


def _tile_64x64(m: int, n: int, k: int) -> Launch:
    return Launch(grid=(cdiv(n, 64), cdiv(m, 64), 1), block=(16, 16, 1))


def _tile_16x16(m: int, n: int, k: int) -> Launch:
    return Launch(grid=(cdiv(n, 16), cdiv(m, 16), 1), block=(16, 16, 1))


def _warp_dot(m: int, n: int, k: int) -> Launch:
    # common/warp_dot.cuh: 4 warps per CTA side by side along N, each on a 4x4 block of C
    return Launch(grid=(cdiv(n, 16), cdiv(m, 4), 1), block=(128, 1, 1))


def _quantize_rows(m: int, n: int, k: int) -> Launch:
    return Launch(grid=(cdiv(k, 1024), m, 1), block=(256, 1, 1))  # 8 warps x 4 blocks of 32


_SPECS = [
    KernelSpec("fp32.naive", ops.FP32, 1, "fp32/naive.cu", "fp32_naive", _thread_per_output,
               "FP32 GEMM, one thread per output, operands straight from global memory"),
    KernelSpec("fp32.tiled", ops.FP32, 1, "fp32/tiled.cu", "fp32_tiled", _tile_64x64,
               "FP32 GEMM, 64x64 shared-memory tiles, 4x4 outputs per thread"),
    KernelSpec("quantize.q8_1", ops.QUANTIZE_Q8_1, 2, "quantize/q8_1.cu", "quantize_q8_1", _quantize_rows,
               "float32 activations -> Q8_1 blocks (d, s = sum x), as ggml-cuda's quantize_q8_1"),
    KernelSpec("w4a16.naive", ops.W4A16, 3, "w4a16/naive.cu", "w4a16_naive", _thread_per_output,
               "Q4_0 weights x float32 activations, one thread per output, unpacked on the fly"),
    KernelSpec("w4a16.tiled", ops.W4A16, 3, "w4a16/tiled.cu", "w4a16_tiled", _tile_64x64,
               "Q4_0 weights x float32 activations, W tile dequantized into shared memory"),
    KernelSpec("w8a16.naive", ops.W8A16, 3, "w8a16/naive.cu", "w8a16_naive", _thread_per_output,
               "Q8_0 weights x float32 activations, one thread per output"),
    KernelSpec("w8a16.tiled", ops.W8A16, 3, "w8a16/tiled.cu", "w8a16_tiled", _tile_64x64,
               "Q8_0 weights x float32 activations, W tile dequantized into shared memory"),
    KernelSpec("w4a8.naive", ops.W4A8, 4, "w4a8/naive.cu", "w4a8_naive", _thread_per_output,
               "Q8_1 x Q4_0, one thread per output, byte-by-byte sumi + d_w(d_a sumi - 8 s_a)"),
    KernelSpec("w4a8.tiled", ops.W4A8, 4, "w4a8/tiled.cu", "w4a8_tiled", _tile_16x16,
               "Q8_1 x Q4_0, 16x16 shared-memory tiles, byte-by-byte integer math"),
    KernelSpec("w4a8.dp4a", ops.W4A8, 4, "w4a8/dp4a.cu", "w4a8_dp4a", _warp_dot,
               "Q8_1 x Q4_0, DP4A on the stored nibbles, a warp per 4x4 outputs, coalesced loads"),
    KernelSpec("w4a8.tiled_dp4a", ops.W4A8, 4, "w4a8/tiled_dp4a.cu", "w4a8_tiled_dp4a", _tile_64x64,
               "Q8_1 x Q4_0, 64x64 shared-memory tiles, 4x4 outputs per thread, DP4A"),
    KernelSpec("w4a8.vec_dp4a", ops.W4A8, 4, "w4a8/vec_dp4a.cu", "w4a8_vec_dp4a", _tile_64x64,
               "tiled_dp4a + 16-byte vector loads of the Q8_1 activations, 4 blocks per stage"),
    KernelSpec("w8a8.naive", ops.W8A8, 4, "w8a8/naive.cu", "w8a8_naive", _thread_per_output,
               "Q8_1 x Q8_0, one thread per output, byte-by-byte sumi + d_w d_a sumi"),
    KernelSpec("w8a8.dp4a", ops.W8A8, 4, "w8a8/dp4a.cu", "w8a8_dp4a", _warp_dot,
               "Q8_1 x Q8_0, DP4A, a warp per 4x4 outputs, coalesced loads"),
    KernelSpec("w8a8.tiled_dp4a", ops.W8A8, 4, "w8a8/tiled_dp4a.cu", "w8a8_tiled_dp4a", _tile_64x64,
               "Q8_1 x Q8_0, 64x64 shared-memory tiles, 4x4 outputs per thread, DP4A"),
]

REGISTRY: dict[str, KernelSpec] = {s.name: s for s in _SPECS}
assert len(REGISTRY) == len(_SPECS), "duplicate kernel names in the registry"

_kernels: dict[str, ops.Kernel] = {}
_kernels_lock = threading.Lock()


def names() -> list[str]:
    return list(REGISTRY)


def spec(name: str) -> KernelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), REGISTRY, n=3, cutoff=0.4)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"no kernel named {name!r}{hint} (qgemm list shows all {len(REGISTRY)})") from None


def get(name: str) -> ops.Kernel:
    """The callable kernel `name` (memoized: a second get() returns the same object, no I/O)."""
    k = _kernels.get(name)
    if k is None:
        s = spec(name)
        with _kernels_lock:
            k = _kernels.setdefault(name, ops.Kernel(s))
    return k


def list_kernels(family: str | None = None, op: str | None = None) -> list[KernelSpec]:
    out = list(REGISTRY.values())
    if family:
        out = [s for s in out if s.family == family]
    if op:
        out = [s for s in out if s.op.name == op]
    return out


def resolve(names_or_all: list[str] | None, all_: bool) -> list[KernelSpec]:
    """CLI helper: explicit names (or family names like 'w4a16') or --all."""
    if all_:
        return list(REGISTRY.values())
    if not names_or_all:
        raise ValueError("name at least one kernel, or pass --all")
    out: list[KernelSpec] = []
    for n in names_or_all:
        fam = list_kernels(family=n)
        out.extend(fam if fam and n not in REGISTRY else [spec(n)])
    return out
