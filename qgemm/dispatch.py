"""`qgemm.matmul`: float activations x pre-quantized ggml weights, on the fastest registered path.

    c = qgemm.matmul(x, w)                       # x float32/float16 [M, K]; w Q4_0/Q8_0 [N, K/32]
    print(qgemm.explain(512, 4096, 4096, "q4_0"))  # which kernels, which configuration, and why

With weights from `qgemm.pack_weights` (repacked once, at load):
- M >= 17 on sm_90: `convert.f16k` (float16 / bfloat16 activations: `convert.f16k_f16` /
  `convert.f16k_bf16`) + `w4a16.wgmma_rs` /
  `w8a16.wgmma_rs` (asynchronous warpgroup MMA, the weights dequantized into registers as its A
  operand);
and on sm_80+, no prologue kernel (float32 activations; float16 / bfloat16: the `_f16` / `_bf16`
variants of the same kernels):
- M = 1: `w4a8.skinny` / `w8a8.skinny` alone -- int8 tensor cores with the token on the MMA's N side,
  the weight words used as fragments (Q4_0 after one mask), the activations quantized per block by
  the kernel;
- otherwise M <= 32: `w4a16.skinny` / `w8a16.skinny` alone -- fp16 tensor cores with the tokens on the
  MMA's N side, 16-byte weight loads, the activations read (and rounded to fp16) by the kernel.
Otherwise a prologue kernel prepares the activations on the GPU, then the GEMM runs:
- M <= 8 (decode): `quantize.q8_1` + `w4a8.gemv` / `w8a8.gemv`, which stream each weight byte
  once (llama.cpp's own scheme: Q8_1 activations, integer dot products);
- otherwise on sm_80+: `convert.f16` + `w4a16.mma` / `w8a16.mma` (fp16 tensor cores, the block
  scales folded into the dequantized weights: measured faster than the int8 `w4a8.mma`, whose
  per-block float epilogue costs more than its MMAs, and closer to the float result than Q8_1);
  tile/split-K come from `qgemm tune` results when present, else the default heuristic;
- below sm_80: the DP4A kernels `w4a8.vec_dp4a` / `w8a8.tiled_dp4a` after `quantize.q8_1`.
(The prologues for 16-bit activations: `_PROLOGUES`.)
Except on sm_90 from M = REPACK_MIN_M (17 for Q4_0, 256 for Q8_0): there the ggml blocks are
repacked on the GPU first, in every call (`pack.q4_0` / `pack.q8_0` into a scratch copy as large
as the weights, kept per stream and per CUDA graph capture), and the packed path's `wgmma_rs`
kernel runs -- 1.0-1.4x faster than `w4a16.mma` on the blocks at those M (one 3% loss: Q4_0
32x4096x14336), 1.8-2.5x from M = 512.
`path=` overrides the GEMM kernel (any registered kernel taking these weights: `w4a8.mma`, ...; a
skinny or wgmma kernel given ggml blocks repacks them per call the same way).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from . import formats as F
from . import registry, runtime, tuning
from .ops import x_alignment
from .packing import PackedWeights, packed_nbytes, unkperm16

_DEFAULTS = {
    "q4_0": {"gemv": "w4a8.gemv", "mma": "w4a16.mma", "dp4a": "w4a8.vec_dp4a", "skinny": "w4a16.skinny",
             "skinny_i8": "w4a8.skinny", "wgmma": "w4a16.wgmma_rs"},
    "q8_0": {"gemv": "w8a8.gemv", "mma": "w8a16.mma", "dp4a": "w8a8.tiled_dp4a", "skinny": "w8a16.skinny",
             "skinny_i8": "w8a8.skinny", "wgmma": "w8a16.wgmma_rs"},
}
# the int8 tensor-core GEMMs: ggml blocks, float32 scales (what takes weights the fp16 paths cannot)
_INT8_MMA = {"q4_0": "w4a8.mma", "q8_0": "w8a8.mma"}
GEMV_MAX_M = 8  # the GEMV kernels' most activation rows (GEMV_M <= 8, their registry max_m)
# packed weights, float32 activations: the skinny kernels up to this M (H100: 2.5x faster than
# w4a16.mma at M = 16, 1.35x at 32, slower at 64 where every CTA re-reads 64 rows of activations)
SKINNY_MAX_M = 32  # (the kernels themselves take up to registry.SKINNY_MAX_M = 64 with path=)
# packed weights on sm_90: the register-A wgmma kernels from this M (H100, kernel alone: 512x4096x4096
# 30 us vs 48 for the shared-memory w4a16.wgmma and 80 for w4a16.mma; 32x4096x4096 9.8 vs 12.1 for
# the skinny kernel, 32x4096x14336 24.8 vs 44.4; at M = 16 the skinny kernel is faster, 8.7 vs 9.4)
# (a variant rounding the float32 activations itself, staged through registers, measured 1.5x slower
# than convert.f16 + this kernel at 512x4096x4096: docs/perf/NOTES.md)
WGMMA_MIN_M = 17
# packed weights, float32 activations, one token: the int8 skinny kernels (activations quantized per
# block by the kernel, no dequantization of the weights). H100, whole op, same process, untuned
# first version: Q4_0 1x4096x4096 4.7 vs 4.9-5.1 us for the fp16 kernel, 1x4096x14336 11.4 vs 14.7;
# Q8_0 5.7 vs 5.9-6.2, 21.5-21.9 vs 23.2 (tuned and trimmed since: 3.8 / 9.8 / 5.6 / 20.8 in the
# session-9 bench). From two tokens on they are slower (the quantization is per token, the
# dequantization it saves per weight): 2x4096x4096 Q8_0 9.8 vs 6.2.
SKINNY_I8_MAX_M = 1
# ggml blocks (not packed) on sm_90: from this M the op repacks the weights on the GPU first, on
# every call (`pack.q4_0` / `pack.q8_0` into a per-stream scratch buffer), then runs the packed
# path's wgmma kernel, instead of convert.f16 + w4a16.mma / w8a16.mma on the blocks. H100, whole op,
# hot, N = 4096 (tools/repack_probe.py: docs/perf/repack-h100.json, session 36), us, blocks ->
# repacked per call (-> with pack_weights once):
#   Q4_0 K = 4096: M = 17 20.2 -> 14.4 (8.4), 32 16.5 -> 14.5, 64 19.5 -> 14.9, 512 82.9 -> 40.7 (29.0),
#        2048 330 -> 130 (119); K = 14336: 17 51.5 -> 45.8, 32 44.3 -> 45.6 (the one loss, 3%),
#        128 77.4 -> 57.1, 512 269 -> 124 (98)
#   Q8_0 (twice the bytes to repack): K = 4096: 64 22.9 -> 24.2, 128 31.1 -> 29.5, 256 50.1 -> 36.8,
#        512 91.9 -> 50.7 (30.1); K = 14336: 128 79.4 -> 83.9, 256 153 -> 107, 512 295 -> 152 (103)
# The repacking alone, hot: 4.8 / 25.0 us for Q4_0 at K = 4096 / 14336, 10.9 / 47.8 for Q8_0.
# Q8_0 at 128 tokens wins at K = 4096 but loses at K = 14336: 256 is the smallest M measured to win
# at both.
REPACK_MIN_M = {"q4_0": 17, "q8_0": 256}


def _repack_fits(n: int, k: int) -> bool:
    """Whether one pack.* launch repacks an [N, K] matrix: its grid has a row of CTAs per 16 rows
    (grid.y <= 65535) and its block index is an int. Beyond, matmul keeps the kernels that read
    ggml blocks (a path= that needs the packed layout says so: Plan.check_launch)."""
    return n <= 16 * 65535 and n * (k // F.QK) <= 2**31 - 1


@dataclass
class Plan:
    """What `matmul` runs for one shape (made by `plan`): the prologue kernel that prepares the
    activations (`quantizer`; None when the GEMM reads x itself), the GEMM `kernel` and its
    configuration (`defines`), where that came from (`source`: "default", "tuned" or "override")
    and why (`reason`). `str(plan)` is what `explain` prints."""

    m: int
    n: int
    k: int
    fmt: str
    x_dtype: str
    quantizer: str | None  # the prologue kernel (quantize / convert), None when x is already in the kernel's format
    kernel: str
    defines: dict = field(default_factory=dict)
    source: str = "default"  # "default", "tuned", "override"
    reason: str = ""
    packed: bool = False  # the kernel reads the skinny layout (qgemm.pack_weights), not ggml blocks -- False
    # where a call with packed weights runs on their ggml-block copy (below sm_80, or M > 32 off
    # sm_90: w4a16.mma / the DP4A kernels)
    repack: str | None = None  # ggml blocks repacked on the GPU by this kernel first, on every call (pack.*)

    def __str__(self) -> str:
        cfg = " ".join(f"{k}={v}" for k, v in self.defines.items())
        pro = registry.get(self.quantizer).op if self.quantizer else None
        layout = registry.get(self.kernel).act_layout
        layout = f" in the {layout} layout (the k order of the kernel's weight fragments)" if layout else ""
        step1 = (f"  1. {self.quantizer}: x -> {pro.out.name}{layout} on the GPU\n" if pro
                 else "  1. (x is already in the kernel's format)\n")
        if self.quantizer is None and self.packed:
            step1 = f"  1. (none: the kernel reads the {_X_NAMES[self.x_dtype]} activations itself)\n"
        if self.repack:
            step1 = (f"  0. {self.repack}: w (ggml blocks) -> the skinny layout on the GPU, on every call "
                     "(qgemm.pack_weights(w) does it once)\n" + step1)
        held = " (ggml blocks, repacked per call)" if self.repack else " (packed)" if self.packed else ""
        return (f"M={self.m} N={self.n} K={self.k} {self.fmt} weights{held}, "
                f"{self.x_dtype} activations:\n" + step1 +
                f"  2. {self.kernel}{' (' + cfg + ')' if cfg else ''} [{self.source}]\n"
                f"  why: {self.reason}")

    @property
    def staged_format(self):
        """(shape, dtype) of the prologue's output buffer, or None."""
        if self.quantizer is None:
            return None
        out = registry.get(self.quantizer).op.out
        return (self.m, self.k // out.block), out.dtype

    def reference(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The exact-math result of this plan on host arrays (float64): the prologue's output as
        the CPU computes it, byte for byte, then the kernel's reference."""
        kernel = registry.get(self.kernel)
        x = np.asarray(x)
        if x.ndim != 2 or x.shape != (self.m, self.k):
            raise ValueError(f"plan.reference: x must be [M, K] = [{self.m}, {self.k}] for this plan, got shape {x.shape}")
        w = F.as_blocks(w, F.get_format(self.fmt), "W")
        if w.shape != (self.n, self.k // F.QK):
            raise ValueError(f"plan.reference: w must be {self.fmt} blocks [N, K/32] = [{self.n}, {self.k // F.QK}] for "
                             f"this plan, got shape {w.shape}")
        staged = registry.get(self.quantizer).op.cpu(x) if self.quantizer else x
        if kernel.act_layout is not None:  # the kernel's k order is the op's, permuted alike on both sides
            staged = unkperm16(staged)
        return kernel.op.exact(staged, w)

    @property
    def op(self):
        """The GEMM kernel's Op (its operand formats)."""
        return registry.get(self.kernel).op

    def check_launch(self) -> None:
        """ValueError where a kernel of the plan would need a grid beyond CUDA's limits (very large M)."""
        if self.repack is not None:
            registry.get(self.repack).check_launch(self.m, self.n, self.k)
        if self.quantizer is not None:
            registry.get(self.quantizer).check_launch(self.m, 0, self.k)
        registry.get(self.kernel).check_launch(self.m, self.n, self.k, self.defines or None)

    def launch(self, dx, dw, dq, dc, status, stream=None, dpack=None) -> None:
        """Queue the kernels on device arrays (the hot path: no checks, no allocation). Kernels
        that support it (KernelSpec.pdl) are launched with programmatic dependent launch: the GEMM
        streams its first weights while its prologue (or, without one, the previous op) finishes,
        and the prologue's launch overlaps the previous op's tail. The split-K zeroing of C is done
        by the prologue where it can (the convert.* prologues: KernelSpec.zeroes), so no memset
        stands between two ops' kernels there. With no prologue, the skinny kernels' K split
        across CTAs (SK_GSPLIT > 1: the fp16-MMA skinny kernels' default from 2 tokens at K >=
        8192, except Q8_0 at 9-16) is zeroed by a kernel of their module, qgemm_zero_output, which
        keeps the GEMM's PDL launch (Kernel.launch); a split mma kernel with no prologue (float16
        x on ggml blocks: w4a16.mma / w8a16.mma from 9 tokens) gets a memset, and so does a split
        int8 GEMM behind quantize.q8_1 (path=), queued before the quantizer.
        With `repack`, `dw` is the ggml blocks and `dpack` the buffer they are repacked into; the
        GEMM then reads its weights after that kernel has completed (no programmatic dependent
        launch: it reads its weights above its pdl_wait, and here an earlier kernel wrote them)."""
        kernel = registry.get(self.kernel)
        defines = self.defines or kernel.config_for(self.m, self.n, self.k)
        if self.repack is not None:
            registry.get(self.repack).launch_pack(dw, dpack, self.n, self.k, stream=stream)
            dw = dpack
        zeroed = False
        if self.quantizer is not None:
            zeroed = kernel.geometry(self.m, self.n, self.k, defines).zero_output
            registry.get(self.quantizer).launch_quantize(dx, dq, self.m, self.k, status, stream=stream,
                                                         zero=dc if zeroed else None)
        else:
            dq = dx
        kernel.launch(dq, dw, dc, self.m, self.n, self.k, stream=stream, defines=defines, zeroed=zeroed,
                      pdl=self.repack is None)

    @property
    def packed_weights_bytes(self) -> int:
        """Bytes of the buffer the per-call repacking writes (0 without one)."""
        return packed_nbytes(self.fmt, self.n, self.k) if self.repack else 0


_X_DTYPES = {"float32": "f32", "float16": "f16", "half": "f16", "bfloat16": "bf16"}
_X_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
_X_OF_DTYPE = {F.F32.dtype: "f32", F.F16.dtype: "f16", F.BF16.dtype: "bf16"}
# the prologue that turns x (by its type) into what a GEMM kernel reads: (the kernel's A format,
# its activation layout) -> {x type: prologue kernel, or None where the kernel reads x as it is}.
# A type missing from an entry cannot feed that kernel.
_PROLOGUES = {
    ("q8_1", None): {"f32": "quantize.q8_1", "f16": "quantize.q8_1_f16", "bf16": "quantize.q8_1_bf16"},
    ("f16", "kperm16"): {"f32": "convert.f16k", "f16": "convert.f16k_f16", "bf16": "convert.f16k_bf16"},
    ("f16", None): {"f32": "convert.f16", "f16": None, "bf16": "convert.f16_bf16"},
    ("f32", None): {"f32": None},
    ("bf16", None): {"bf16": None},
}
# the decode kernels that read x themselves come in one variant per x type (registry: SK_X)
_X_SUFFIX = {"f32": "", "f16": "_f16", "bf16": "_bf16"}


def _np_dtype_name(dt) -> str | None:
    if not isinstance(dt, (type, np.dtype)):  # np.dtype(None) is float64, np.dtype({}) a void type
        return None
    try:
        dt = np.dtype(dt)
    except (TypeError, ValueError):
        return None
    return "bfloat16" if F.is_bf16(dt) else dt.name


def plan(m: int, n: int, k: int, fmt: str = "q4_0", x_dtype: str = "f32", path: str | None = None,
         packed: bool = False, arch: str | None = None) -> Plan:
    """The Plan `matmul` follows for x [M, K] (`x_dtype` "f32", "f16" or "bf16", or a numpy dtype) times
    `fmt` weights [N, K] ("q4_0" or "q8_0"); nothing is launched.

    packed: the weights are a qgemm.PackedWeights (the skinny kernels may be used).
    path: a registered GEMM kernel to run instead of the default choice (`explain` lists them).
    arch: plan for this architecture (e.g. "sm_90") instead of the GPU's -- the untuned defaults,
    so a plan for an H100 can be read on a machine without one. With neither a GPU nor `arch`,
    the default choice is sm_80's (the Hopper-only wgmma paths never appear: pass arch="sm_90" to
    read an H100's), and a `path` is not checked against any architecture.

    ValueError for another format or x dtype, M, N or K not a positive int below 2^31, K not a
    multiple of 32, or a `path` that does not compute this product (UnknownNameError, a
    ValueError, for no such kernel); UnsupportedArchError for an `arch` NVRTC cannot target or a
    `path` the architecture cannot run; TypeError for a `packed` that is not a bool."""
    return _plan(m, n, k, fmt, x_dtype, path, packed, arch, "plan")


def _path_takes(s, fmt: str) -> bool:
    """Whether path= can name kernel spec `s` for `fmt` weights: a GEMM of those weights whose
    activations a prologue makes (Q8_1, f16) or that reads them itself (the kernels of the
    repacked weight layout: float32 / float16 / bfloat16 or Q8_1)."""
    layout = s.weight_layout is not None
    return (s.op.kind == "gemm" and s.op.w is not None and s.op.w.name == fmt
            and s.op.a.name in (("f32", "f16", "bf16", "q8_1") if layout else ("q8_1", "f16")))


def _plan(m, n, k, fmt, x_dtype, path, packed, arch, who: str) -> Plan:
    """plan(), its messages naming `who`: the public call the arguments came to (plan, explain, matmul)."""
    if not isinstance(packed, (bool, np.bool_)):
        raise TypeError(f"{who}: packed must be True or False (the weights are a qgemm.PackedWeights), got {packed!r}")
    fmt = F.get_format(fmt, who).name
    if fmt not in _DEFAULTS:
        raise ValueError(f"{who}: weights must be q4_0 or q8_0 blocks, got {fmt}")
    named = x_dtype if isinstance(x_dtype, str) else _np_dtype_name(x_dtype)
    given = x_dtype
    x_dtype = _X_DTYPES.get(named, named)
    if x_dtype not in _X_NAMES:
        raise ValueError(f"{who}: x_dtype must be 'f32', 'f16' or 'bf16' (float32, float16 or bfloat16 activations), "
                         f"got {named or given!r}")
    for what, v in (("M", m), ("N", n), ("K", k)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not 0 < v < 2**31:
            raise ValueError(f"{who}: {what} must be a positive integer below 2^31, got {v!r}")
    # numpy integers pass the check above, but the configuration arithmetic needs Python ints: an
    # unsigned ceil division wraps and M*K overflows int32
    m, n, k = int(m), int(n), int(k)
    if k % F.QK:
        raise ValueError(f"{who}: K must be a multiple of {F.QK} (the block size), got K={k}")
    if arch is not None:
        from . import jit

        jit.check_arch_supported(jit.normalize_arch(arch))  # sm_75 .. what NVRTC targets
        cc = jit.parse_arch(arch)[0]
    else:
        cc = runtime.device_info().cc if runtime.gpu_available() else None
    choice = _DEFAULTS[fmt]
    repack = False
    if path is not None:
        s = registry.spec(path)
        layout = s.weight_layout is not None
        if not _path_takes(s, fmt):
            takes = [n for n in registry.names() if _path_takes(registry.spec(n), fmt)]
            raise ValueError(f"{who}: path {path!r} computes {s.op}; for {fmt} weights path= takes a GEMM kernel of {fmt} "
                             f"weights that matmul can feed: {', '.join(takes)}")
        if s.max_m is not None and m > s.max_m:
            raise ValueError(f"{who}: path {path} handles M <= {s.max_m}, got M={m}")
        repack = layout and not packed  # ggml blocks: repacked on the GPU on every call
        if x_dtype not in _PROLOGUES[(s.op.a.name, s.act_layout)]:
            variant = path.removesuffix("_bf16").removesuffix("_f16") + _X_SUFFIX[x_dtype]
            raise ValueError(f"{who}: path {path} reads {_X_NAMES[s.op.a.name]} activations itself, got "
                             f"{_X_NAMES[x_dtype]}" + (f" (its {_X_NAMES[x_dtype]} variant is {variant})"
                                                       if variant in registry.REGISTRY else ""))
        if cc is not None and not s.runs_on(cc):
            from .errors import UnsupportedArchError

            raise UnsupportedArchError(f"{who}: path {path} needs {s.arch_needed}, planned for sm_{cc}")
        name, source, reason = path, "override", "requested with path="
    elif not packed and cc == 90 and m >= max(REPACK_MIN_M[fmt], WGMMA_MIN_M) and _repack_fits(n, k):  # blocks: repacked per call
        name, source, repack = choice["wgmma"], "default", True
        reason = (f"M={m} >= {max(REPACK_MIN_M[fmt], WGMMA_MIN_M)} on sm_90 with {fmt} blocks: asynchronous wgmma with the "
                  "weights dequantized into registers as its A operand while the previous half-stage multiplies")
    elif packed and cc == 90 and m >= WGMMA_MIN_M:
        name, source = choice["wgmma"], "default"
        reason = (f"M={m} >= {WGMMA_MIN_M} with packed weights on sm_90: asynchronous wgmma with the weights "
                  "dequantized into registers as its A operand while the previous half-stage multiplies")
    elif packed and m <= SKINNY_I8_MAX_M and (cc is None or cc >= 80):
        name, source = choice["skinny_i8"] + _X_SUFFIX[x_dtype], "default"
        reason = (f"M={m} with packed weights: int8 tensor cores, tokens on the MMA's N side, each weight byte read "
                  "once in 16-byte loads and used as the MMA fragment (Q8_0 as is, Q4_0 after one mask per nibble "
                  f"half); the kernel quantizes the {_X_NAMES[x_dtype]} activations per 32-block itself (no prologue kernel)")
    elif packed and m <= SKINNY_MAX_M and (cc is None or cc >= 80):
        name, source = choice["skinny"] + _X_SUFFIX[x_dtype], "default"
        reason = (f"M={m} <= {SKINNY_MAX_M} with packed weights: tokens on the MMA's N side, each weight byte read once "
                  f"in 16-byte loads, the {_X_NAMES[x_dtype]} activations read directly (no prologue kernel)")
    elif m <= GEMV_MAX_M:
        name, source = choice["gemv"], "default"
        reason = f"M={m} <= {GEMV_MAX_M}: decode is bound by reading the weights once; a GEMV streams them"
    elif cc is None or cc >= 80:
        name, source = choice["mma"], "default"
        reason = (f"M={m}: fp16 tensor cores with the block scales folded into the dequantized weights "
                  "(no per-block epilogue)" + ("" if cc else " (no GPU here: assuming sm_80+)"))
    else:
        name, source = choice["dp4a"], "default"
        reason = f"sm_{cc} has no int8 mma.sync m16n8k32: DP4A fallback"
    k_obj = registry.get(name)
    quantizer = _PROLOGUES[(k_obj.op.a.name, k_obj.act_layout)][x_dtype]
    defines = {}
    if k_obj.spec.config is not None:
        from . import tuning

        tuned = tuning.lookup(name, m, n, k) if arch is None else None
        if tuned is not None:
            defines, source = tuned, "tuned" if source == "default" else source
        elif arch is not None:  # that architecture's untuned defaults, within its shared memory per block
            defines = k_obj.default_config(m, n, k, 132, jit.smem_per_block_optin(cc) if cc is not None else None)
        else:
            defines = k_obj.config_for(m, n, k)
    if defines.get("GEMV_PDL") and cc is not None and cc >= 90:  # PDL is a no-op before sm_90
        reason += ("; it starts beside its quantizer (programmatic dependent launch) and requests its first weights "
                   "before it waits for the quantized activations")
    if defines.get("RS_WS"):
        wgs = defines.get("RS_WGS", 2)
        reason += (f"; warp-specialized: a copying warpgroup feeds the {'MMA warpgroup' if wgs == 1 else f'{wgs} MMA warpgroups'}"
                   " through mbarriers")
    if repack:
        reason += ("; it reads the skinny weight layout, so the ggml blocks are repacked on the GPU first, on every "
                   "call (pass w = qgemm.pack_weights(w) to repack once, at load)")
    sm_count = 132 if arch is not None or not runtime.gpu_available() else runtime.device_info().sm_count
    reason += _grid_reason(k_obj, m, n, k, defines, sm_count)
    return Plan(m, n, k, fmt, x_dtype, quantizer, name, defines, source, reason, k_obj.packed,
                f"pack.{fmt}" if repack else None)


_matmul_plans: dict = {}



def _matmul_plan(m, n, k, fmt, x_dtype, path, packed) -> Plan:
    """_plan(..., "matmul"), memoized: the plan is a function of these arguments, the GPU (fixed
    for the process) and the stored tuning (tuning.state(), in the key). Only matmul's own calls
    share these Plan objects (plan() returns fresh ones a caller may change); a failing call is
    not memoized, so its error comes every time."""
    key = (m, n, k, fmt, x_dtype, path, packed, tuning.state())
    try:
        p = _matmul_plans.get(key)
    except TypeError:  # an unhashable path=: _plan says what it must be
        return _plan(m, n, k, fmt, x_dtype, path, packed, None, "matmul")
    if p is None:
        p = runtime.remember(_matmul_plans, key, _plan(m, n, k, fmt, x_dtype, path, packed, None, "matmul"), 1024)
    return p


def _grid_reason(k_obj, m: int, n: int, k: int, defines: dict, sm_count: int) -> str:
    """A plan's grid in its own numbers. `wgmma_rs`'s tile (its default chooses tile and K split by
    how the grid fills the SMs, `registry._rs_config`): the weight rows and tokens of a CTA and,
    unsplit, the CTAs of the grid. The decode kernels' CTA (their defaults choose tiles per CTA and
    warps by the waves the grid makes, `registry._skinny_config`): its 16-row weight tiles and warps,
    the CTAs per SM its registers were capped for (SK_MINB) and, unsplit, the CTAs of the grid. Any
    kernel's K split, where it has one: the output tiles alone are too few CTAs (or leave the last
    wave short) for the SMs, so each tile's K is shared by several CTAs."""
    g = k_obj.geometry(m, n, k, defines)
    ctas = math.prod(g.grid)
    text = ""
    if "RS_BN" in defines:
        text = f"; tiles of {64 * defines.get('RS_WGS', 2)} weight rows x {defines['RS_BN']} tokens"
        if g.split <= 1:
            text += f": {ctas} CTAs for {sm_count} SMs"
    elif "SK_R" in defines and "SK_WARPS" in defines:
        r = defines["SK_R"]
        text = f"; {r} tile{'s' if r > 1 else ''} of 16 weight rows per CTA of {defines['SK_WARPS']} warps"
        if defines.get("SK_MINB", 1) > 1:  # __launch_bounds__' second argument: ptxas caps the registers
            text += f", its registers capped so that {defines['SK_MINB']} fit an SM"
        if g.split <= 1:
            text += f": {ctas} CTAs for {sm_count} SMs"
    if g.split > 1:
        text += (f"; K split {g.split} ways: {ctas // g.split} output tiles make {ctas} CTAs for {sm_count} SMs, each "
                 "adding its partial sums into the output, zeroed first")
    return text


def explain(m: int, n: int, k: int, fmt: str = "q4_0", x_dtype: str = "f32", path: str | None = None,
            packed: bool = False, arch: str | None = None) -> str:
    """Which kernels `matmul` runs for this shape on this GPU (or `arch`, e.g. "sm_90"), with
    which configuration, and why (packed=True: for weights made by qgemm.pack_weights), as text;
    where a kernel's grid would be beyond CUDA's limits (matmul's ValueError), the text says so.
    The arguments and errors are `plan`'s."""
    if arch is not None:
        from . import jit

        where = f"{jit.normalize_arch(arch)} (requested; untuned defaults for 132 SMs)"
    else:
        where = runtime.device_info().name + f" ({runtime.device_arch()})" if runtime.gpu_available() else "no GPU"
    p = _plan(m, n, k, fmt, x_dtype, path, packed, arch, "explain")
    try:
        p.check_launch()
        refused = ""
    except ValueError as e:  # what matmul would raise before launching
        refused = f"\nmatmul refuses this shape in one call: {e}"
    return f"qgemm.matmul on {where}\n" + str(p) + refused


# ---------------------------------------------------------------------------------------------

_workspace_lock = threading.Lock()
_workspace: OrderedDict[tuple, runtime.DeviceArray] = OrderedDict()
_WORKSPACE_STREAMS = 8  # per tag: the least recently used stream's buffer is freed beyond this
# the views _scratch handed out, by ((tag, stream key), shape, dtype) -> (buffer, view): an eager
# call takes the same one to three views every time, and making each anew (its byte count, a
# DeviceArray) was ~4 us of host time apiece. A view is reused only while its buffer is still the
# stream's current one for the tag; the entries of an evicted buffer go with it.
_scratch_views: dict = {}


_PER_THREAD_STREAM = 2  # CU_STREAM_PER_THREAD


def _stream_key(stream):
    return _handle_key(int(runtime.as_stream(stream).handle))


def _handle_key(handle: int):
    # the per-thread default stream (cuda.core's default under CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1)
    # is one handle for a different stream in each thread: its ops run concurrently, so no shared scratch.
    # Keyed by the Thread object, not its ident: an ident is reused once a thread ends, perhaps with its
    # work still queued; the key holds the object, so no later thread gets that key.
    return (handle, threading.current_thread()) if handle == _PER_THREAD_STREAM else handle


_queue_locks: dict = {}
_thread_queue = threading.local()
_ASK = object()


def _queue_lock(stream, skey=_ASK) -> threading.Lock:
    """One lock per stream, held while an op takes the stream's scratch and queues its kernels (and,
    for a host call, until it has read the status word back). Two threads sharing a stream would
    otherwise interleave their launches -- quantize A, quantize B, GEMM A -- and A's GEMM would read
    B's activations from the one staging buffer, or A read B's overflow flag. Consecutive ops of one
    thread need no more: the stream orders them, and a PDL-launched prologue writes the staging
    buffer only after its wait for the previous kernel. skey: _stream_key(stream), when the
    caller has it (a driver handle read and a few Python calls: matmul asks once per call)."""
    key = _stream_key(stream) if skey is _ASK else skey
    if isinstance(key, tuple):  # the per-thread default stream is this thread's alone, and so is its lock:
        lock = getattr(_thread_queue, "lock", None)  # kept in the table, its key would hold every finished Thread
        if lock is None:
            lock = _thread_queue.lock = threading.Lock()
        return lock
    with _workspace_lock:
        lock = _queue_locks.get(key)
        if lock is None:
            lock = _queue_locks[key] = threading.Lock()
    return lock


def _scratch(tag: str, shape, dtype, stream=None, cid=_ASK, skey=_ASK) -> runtime.DeviceArray:
    """Reusable device scratch (staged activations, status word), one per stream: no cuMemAlloc
    per call, and ops queued on two streams at once never share a staging buffer. During a CUDA
    graph capture, one per capture instead: the graph's replays may run on any stream, beside
    eager calls on the capturing one or replays of another graph captured there. `cid`: the
    stream's capture id (runtime.capture_id) when the caller already asked; `skey`: its
    _stream_key, likewise."""
    if cid is _ASK:
        cid = runtime.capture_id(stream)
    if skey is _ASK:
        skey = _stream_key(stream)
    if cid is not None:
        return _graph_scratch(tag, math.prod(shape) * np.dtype(dtype).itemsize, shape, dtype, stream, cid, skey)
    key = (tag, skey)
    vkey = (key, tuple(shape), dtype)
    with _workspace_lock:
        hit = _scratch_views.get(vkey)
        if hit is not None and _workspace.get(key) is hit[0]:
            _workspace.move_to_end(key)
            return hit[1]
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        buf = _workspace.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = runtime.DeviceArray.empty((max(nbytes, 1),), np.uint8)
            _workspace[key] = buf
            same_tag = [k for k in _workspace if k[0] == tag]
            gone = {key} | set(same_tag[:-_WORKSPACE_STREAMS])  # the replaced buffer's views, the evicted ones'
            for v in [v for v in _scratch_views if v[0] in gone]:
                del _scratch_views[v]
            for old in same_tag[:-_WORKSPACE_STREAMS]:
                del _workspace[old]  # freed once no view holds it (cuMemFree waits for the GPU)
                if not any(k[1] == old[1] for k in _workspace):  # that stream's last buffer: its lock goes too
                    _queue_locks.pop(old[1], None)  # (a later op there makes a new one; a holder keeps its own)
        _workspace.move_to_end(key)
        view = runtime.DeviceArray(buf.ptr, tuple(shape), dtype, owner=buf)
        runtime.remember(_scratch_views, vkey, (buf, view), 256)
    return view


# the buffer each capture's ops share, by (tag, stream, capture id); a capture that needs more
# takes a bigger one (the smaller stays held for the capture: the ops captured before use it)
_graph_buffers: dict = {}


def _graph_scratch(tag: str, nbytes: int, shape, dtype, stream, cid: int, skey=_ASK) -> runtime.DeviceArray:
    """Scratch private to one capture: never handed to eager calls or to another capture, and held
    as long as the graph can be replayed (runtime.hold_for_capture: with a qgemm Graph, until it is
    deleted; with a caller's capture, torch.cuda.graph, for the process -- qgemm cannot see that
    graph go). Ops of one capture share it: the graph orders them as the stream did."""
    key = (tag, _stream_key(stream) if skey is _ASK else skey, cid)
    with _workspace_lock:
        buf = _graph_buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = _graph_buffers[key] = runtime.DeviceArray.empty((max(nbytes, 1),), np.uint8)
            runtime.hold_for_capture(cid, buf)
    return runtime.DeviceArray(buf.ptr, tuple(shape), dtype, owner=buf)


def _forget_capture(cid: int) -> None:
    """A qgemm Graph took its capture's buffers (runtime.Graph): drop the lookup entries."""
    with _workspace_lock:
        for key in [k for k in _graph_buffers if k[2] == cid]:
            del _graph_buffers[key]


_FLOAT_WEIGHTS_HINT = ("; float weights are quantized once, at load: qgemm.pack_weights(w, 'q4_0' or 'q8_0') on the GPU "
                       "(or qgemm.quantize_q4_0 / quantize_q8_0 on the host)")


def _weights(w, fmt: str | None, on_device: bool, stream=None, who: str = "matmul"):
    """(blocks as host or device array in their block dtype, format name). who: the caller, for messages."""
    def refuse_floats(dt, shape):
        if dt.kind == "f" or F.is_bf16(dt):
            raise ValueError(f"{who}: weights must be Q4_0 or Q8_0 blocks [N, K/32], got {runtime.dtype_name(dt)} "
                             f"{tuple(shape)}" + _FLOAT_WEIGHTS_HINT)

    if on_device:
        d = runtime.as_device_array(w, stream)
        refuse_floats(d.dtype, d.shape)
        if fmt is None:
            fmt = {F.Q4_0.dtype: "q4_0", F.Q8_0.dtype: "q8_0"}.get(d.dtype)
            if fmt is None:
                raise ValueError(f"{who}: cannot tell the weight format of a {d.dtype} device array; pass fmt='q4_0' or 'q8_0'")
        f = F.get_format(fmt, who)
        if f.name not in ("q4_0", "q8_0"):  # a float matrix would be read as K "blocks" per row
            raise ValueError(f"{who}: weights must be q4_0 or q8_0 blocks, got fmt={fmt!r} "
                             f"(a {runtime.dtype_name(d.dtype)} {d.shape} device array)")
        if d.dtype == np.uint8:
            if d.ndim != 2 or d.shape[1] % f.dtype.itemsize:
                raise ValueError(f"{who}: raw {f.name} weights must be uint8 [N, (K/32)*{f.dtype.itemsize}], got {d.shape}")
            d = d.view(f.dtype)
        elif d.dtype != f.dtype:
            came = F.block_format_of(d.dtype)
            raise ValueError(f"{who}: weights must be {f.name} blocks, got {came + ' blocks' if came else runtime.dtype_name(d.dtype)} "
                             f"{d.shape}")
        if d.ndim != 2:
            raise ValueError(f"{who}: weights must be 2-D [N, K/32] blocks, got shape {d.shape}")
        if 0 in d.shape:
            raise ValueError(f"{who}: weights must have N >= 1 rows and K/32 >= 1 blocks, got shape {d.shape}")
        return d, f.name
    if isinstance(w, (list, tuple)):  # np.asarray of a list of blocks would not give blocks back
        raise ValueError(f"{who}: weights must be a numpy array of Q4_0 / Q8_0 blocks [N, K/32] (or raw uint8 bytes with "
                         f"fmt=), or a device array, got {type(w).__name__}")
    a = runtime.host_array(w, who, "the weights")
    refuse_floats(a.dtype, a.shape)
    if isinstance(fmt, str):
        fmt = fmt.lower()  # "Q4_0" as "q4_0", as the CLI and plan() take it
    if fmt is None:
        fmt = {F.Q4_0.dtype: "q4_0", F.Q8_0.dtype: "q8_0"}.get(a.dtype)
        if fmt is None:
            came = F.block_format_of(a.dtype)
            raise ValueError(f"{who}: weights must be Q4_0 or Q8_0 blocks (qgemm.quantize_q4_0/q8_0, or raw "
                             f"gguf bytes with fmt=), got {came + ' blocks' if came else a.dtype} {a.shape}")
    if fmt not in ("q4_0", "q8_0"):
        raise ValueError(f"{who}: weights must be q4_0 or q8_0, got fmt={fmt!r}")
    b = F.as_blocks(a, fmt, f"{who}: weights")
    if b.ndim != 2:
        raise ValueError(f"{who}: weights must be 2-D [N, K/32] blocks, got shape {b.shape}")
    if 0 in b.shape:
        raise ValueError(f"{who}: weights must have N >= 1 rows and K/32 >= 1 blocks, got shape {b.shape}")
    bad = F.nonfinite_block(b, ("d",))  # a corrupt file
    if bad is not None:
        _, (row, blk), value = bad
        raise ValueError(f"{who}: weight block scales must be finite; row {row}, block {blk} has d = {value}")
    return np.ascontiguousarray(b), fmt


def matmul(x, w, fmt: str | None = None, *, path: str | None = None, out=None, stream=None):
    """C[..., N] = x[..., K] . dequant(W)[N, K]^T, W ggml Q4_0 / Q8_0 blocks [N, K/32] (or raw gguf
    bytes with fmt=); C is float32 whatever x is.

    x: float32, float16 or bfloat16 [..., K], C-contiguous; leading dimensions are rows of one GEMM,
    as in torch's F.linear (a 1-D x [K] returns [N]). bfloat16: torch / JAX device tensors, or a
    host array of ml_dtypes.bfloat16 (or of numpy's 2-byte void '|V2', as qgemm.formats.f32_to_bf16
    makes). A 16-bit x is computed exactly as the same values as float32 (every path widens it
    exactly; the decode kernels read it themselves), bit for bit where the kernel configuration is
    the same; bfloat16 values past half's 65504 on an fp16 tensor-core path are refused as float32
    ones are.
    - Host x and w: a new numpy array, synchronously. Host weights are uploaded on *every* call:
      for repeated use, pack them once (`qgemm.pack_weights`) or keep them on the device.
    - Device x and w (torch, CuPy, anything with `__cuda_array_interface__` or `__dlpack__`,
      `qgemm.DeviceArray`): a new `qgemm.DeviceArray` (`torch.from_dlpack(c)` wraps it, no copy),
      or `out=` -- a writable C-contiguous float32 device array of exactly [..., N] -- written and
      returned; queued on `stream`, no host copies.
    - w = `qgemm.pack_weights(w)`: x host or device, the result follows x. On sm_80+ with float32
      x, M <= 32 (M <= 16 on sm_90, where the wgmma kernels take over) runs one decode kernel
      reading the packed layout (docs/production.md). `qgemm.explain` shows the path for a shape.
      Given ggml blocks, sm_90 from M = 17 (Q4_0) / 256 (Q8_0) repacks them on the GPU in every
      call into a scratch buffer of the weights' size (one per stream, or per CUDA graph capture)
      and runs the wgmma kernel; pack_weights does that once.

    fmt: "q4_0" or "q8_0", needed when w is raw uint8 bytes [N, (K/32) * block bytes] (as gguf
    stores them); otherwise read from w's block dtype. path: a GEMM kernel to run instead of the
    default (as `plan`). stream: any stream `qgemm.runtime.as_stream` takes; None is the legacy
    default stream, which is not torch's current stream: pass `torch.cuda.current_stream()` to
    order with torch's work. Safe to call from several threads; capturable in a CUDA graph with
    device arrays, `out=` and the capturing stream (docs/pytorch.md).

    ValueError before any launch for operands of the wrong dtype, shape or format, mismatched K,
    one host and one device operand (other than packed weights), non-finite host activations or
    weight scales, a bad `out=` or `path`, and (host or packed) weights whose d x q overflows
    float16 on an fp16 tensor-core path; ValueError after the launch (the result discarded) when
    host activations overflow the prologue's float16 / Q8_1 format. Device activations are not
    checked (that would need a synchronization); a NaN or inf among them makes its row of the
    result non-finite on every path. NoGPUError without a GPU, UnsupportedArchError for a `path`
    this GPU cannot run, CompileError / CudaError when NVRTC or the driver fails.
    """
    # (the eager call's host time is what a decode step pays per op outside a CUDA graph: each
    # operand's array interface is read once, the stream converted once, the plan memoized)
    dx = runtime.device_array_or_none(x, stream)
    x_on_device = dx is not None
    packed = w if isinstance(w, PackedWeights) else None
    if packed is not None:  # weights already on the GPU; host activations are uploaded, the result comes back
        if fmt is not None and F.get_format(fmt, "matmul").name != packed.fmt:
            raise ValueError(f"matmul: fmt={fmt!r} but the packed weights are {packed.fmt}")
        fmt = packed.fmt
        w_on_device = True
    else:
        dw = runtime.device_array_or_none(w, stream)
        w_on_device = dw is not None
        if w_on_device:
            w = dw  # (its array interface read once, as x's)
        if x_on_device != w_on_device:
            raise ValueError("matmul: x and w must both be host (numpy) arrays or both device arrays "
                             "(or w a qgemm.pack_weights result)")
    if not x_on_device:
        dx = runtime.host_array(x, "matmul", "x")
        if F.is_bf16(dx.dtype):
            dx = F.as_bf16(dx)  # ml_dtypes' bfloat16 as qgemm holds it (the same bytes)
    x_dtype = _X_OF_DTYPE.get(dx.dtype)
    if x_dtype is None:
        raise ValueError(f"matmul: activations must be float32, float16 or bfloat16 [..., K], got {runtime.dtype_name(dx.dtype)}")
    if dx.ndim < 1:
        raise ValueError(f"matmul: activations must be [..., K] (at least 1-D), got shape {dx.shape}")
    wb, fmt = (packed.blocks, fmt) if packed is not None else _weights(w, fmt, w_on_device, stream)
    # leading dimensions (batch, sequence, ...) are rows of one GEMM, as in torch's F.linear: a
    # C-contiguous [..., K] is [M, K] with M their product, and the result [..., N] is [M, N]
    lead = dx.shape[:-1]
    if dx.ndim != 2:
        rows = int(np.prod(lead, dtype=np.int64))
        if rows == 0:
            raise ValueError(f"matmul: activations of shape {dx.shape} have no rows (M = product of the leading "
                             f"dimensions = 0)")
        dx = dx.reshape(rows, dx.shape[-1])
    m, k = dx.shape
    if m == 0:
        raise ValueError(f"matmul: activations of shape {dx.shape} have no rows (M = 0)")
    n, kw = wb.shape[0], wb.shape[1] * F.QK
    if k != kw:
        raise ValueError(f"matmul: K mismatch: x has K={k}, weights have K={kw} ({wb.shape[1]} blocks of 32)")
    shape_c = tuple(lead) + (n,)
    p = _matmul_plan(m, n, k, fmt, x_dtype, path, packed is not None)
    if m > 65535 or (p.repack is not None and not _repack_fits(n, k)):  # only then can a grid pass CUDA's limits
        p.check_launch()  # (grid.y <= 65535 row tiles; a path= repacking too many rows); not on the hot path
    # what can be checked without the GPU is, first: a bad input says so on any machine
    x32 = None if x_on_device else F.to_float32(dx)  # host x as float32 (no copy for float32), for the checks
    if x32 is not None and not np.isfinite(x32).all():
        raise ValueError("matmul: activations must be finite")
    if p.op.unit == "hmma":  # the weights are dequantized by one float16 multiply each
        bad = packed.f16_overflow if packed is not None else (None if w_on_device else F.f16_dequant_overflow(wb, fmt))
        if bad is not None:
            row, blk, d = bad
            c = _DEFAULTS[fmt]
            safe = (repr(c["gemv"]) if m <= GEMV_MAX_M else f"{_INT8_MMA[fmt]!r} ({c['dp4a']!r} below sm_80)")
            raise ValueError(f"matmul: {p.kernel} dequantizes the weights to float16, and row {row}, block {blk} "
                             f"(d = {d:g}) holds a weight d x q beyond half's range (65504); pass path={safe} "
                             f"(Q8_1 activations, integer dot products, float32 scales) for these weights")
    result = runtime.device_array_or_none(out, stream) if out is not None else None
    if out is not None and result is None:
        raise ValueError(f"matmul: out= must be a float32 device array {shape_c} (torch, CuPy, qgemm.DeviceArray); "
                         f"a host call returns a new numpy array, got {type(out).__name__}")
    runtime.require_gpu("qgemm.matmul")
    runtime.prepare_call(stream, "matmul", None if x_on_device else (
        "host (numpy) arrays cannot be used while a CUDA graph is being captured (their upload and the read-back "
        "are synchronous); capture device arrays, with out= and stream= the capturing stream"))
    stream = runtime.launch_stream(stream)  # once: a caller's stream is checked (driver calls) on each conversion
    if not x_on_device:
        if p.quantizer is None and p.op.a.name in ("f32", "bf16") and p.op.unit == "hmma" and dx.size:
            # these kernels round x to float16 themselves, with no prologue to flag what overflows
            amax = float(np.abs(x32).max())
            if amax >= F.F16_INF_FROM:
                raise ValueError(f"matmul: the activations overflow the GPU format of this path ({p.kernel} rounds them "
                                 f"to float16): |x| max {amax:g} is beyond half's range (65504); scale them down")
        dx = runtime.DeviceArray.from_host(np.ascontiguousarray(dx))
    if not w_on_device:
        wb = runtime.DeviceArray.from_host(wb)
    runtime.check_alignment(dx, "matmul", "the activations")
    if not p.packed or p.repack is not None:
        runtime.check_alignment(wb, "matmul", "the weight blocks")
    if p.packed:
        if p.repack is None:
            wb = packed.packed
        align = x_alignment(p.op.a)
        if dx.ptr % align and p.quantizer is None:  # read by the kernel itself, four values per load
            raise ValueError(f"matmul: {p.kernel} needs the activations on a {align}-byte boundary, got address {dx.ptr:#x}")
    if out is not None:
        if result.readonly:
            raise ValueError(f"matmul: out= is read-only ({type(out).__name__} exports it so); pass a writable device array")
        if result.shape != shape_c or result.dtype != np.float32:
            raise ValueError(f"matmul: out must be float32 {shape_c}, got {result.dtype} {result.shape}")
        runtime.check_alignment(result, "matmul", "out=")
    else:
        result = runtime.DeviceArray.empty(shape_c, np.float32)
    dc = result if len(shape_c) == 2 else result.reshape(m, n)
    staged = p.staged_format
    handle = stream.handle  # a cuda.core Stream here; reading its handle costs ~1 us, so once
    skey = _handle_key(int(handle))
    with _queue_lock(stream, skey):
        cid = runtime.stream_capture_id(handle)  # one driver query for all the buffers (prepare_call made the context current)
        dq = _scratch("prologue", *staged, stream, cid, skey) if staged else None
        dpack = _scratch("repacked", (p.packed_weights_bytes,), np.uint8, stream, cid, skey) if p.repack else None
        status = _scratch("status", (1,), np.int32, stream, cid, skey)
        if not x_on_device:  # only a host call reads the prologue's flags; a device call queues no memset, which
            status.fill_bytes(0, stream)  # would stand between this op's kernels and the previous op's (PDL)
        p.launch(dx, wb, dq, dc, status, stream=stream, dpack=dpack)
        flag = int(status.to_host()[0]) if not x_on_device else 0
    if not x_on_device:
        if flag:
            raise ValueError("matmul: the activations overflow the GPU format of this path: a value (float16) or a Q8_1 "
                             "block scale or sum beyond half's range (65504); scale them down")
        return result.to_host()
    return out if out is not None else result
