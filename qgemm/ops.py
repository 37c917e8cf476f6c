"""Ops (what a kernel computes, in which operand formats) and `Kernel`, the callable around a
registered kernel: input checks, device transfer, launch, output.

Shape convention everywhere: C[M,N] = A[M,K] . W[N,K]^T; M = tokens (activations), N = output
features (weights), K = reduction. Quantized operands are blocks along K: [rows, K/32].
"""

from __future__ import annotations

from collections.abc import Mapping

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import formats as F
from . import jit, packing, reference, runtime
from .errors import UnsupportedArchError


@dataclass(frozen=True)
class Op:
    """What a kernel computes. `unit` names the arithmetic that bounds it (for the roofline)."""

    name: str  # "fp32", "w4a16", "w4a8", "quantize_q8_1", ...
    title: str
    kind: str  # "gemm", "quantize", "pack" (weights -> a kernel layout) or "attention" (AttentionOp)
    a: F.Format  # activations [M, K]
    w: F.Format | None  # weights [N, K] (None for a quantizer)
    out: F.Format
    unit: str  # "fp32" (FFMA), "dp4a", "imma", "hmma" or "memory"
    exact_tol: float  # max relative error vs the exact-math reference
    nmse_tol: float  # max NMSE vs float64 ground truth (quantization level)
    exact: Callable | None = None
    cpu: Callable | None = None  # quantize-kind ops: the CPU function the kernel must match byte for byte
    k_align: int = 1  # K must also be a multiple of this (a layout's chunk, e.g. kperm16)
    out_natural: Callable | None = None  # quantize ops that write a layout: their output back in [M, K] order

    def __str__(self) -> str:
        if self.kind == "quantize":
            return f"{self.title}: X {self.a} [M,K] -> Y {self.out} {'[M,K/32]' if self.out.quantized else '[M,K]'}"
        if self.kind == "pack":
            return f"{self.title}: W {self.a} [N,K/32] -> the skinny layout (uint8 bytes, docs/formats.md)"
        wshape = "[N,K/32]" if self.w.quantized else "[N,K]"
        ashape = "[M,K/32]" if self.a.quantized else "[M,K]"
        return f"{self.title}: A {self.a} {ashape} x W {self.w} {wshape}^T -> C {self.out} [M,N]"

    @property
    def weights(self) -> F.Format | None:
        """The format of the weight matrix the op takes: W for a GEMM, the blocks a `pack` op
        repacks, None for the activation-side ops (quantize / convert)."""
        return self.a if self.kind == "pack" else self.w

    @property
    def k_multiple(self) -> int:
        """What K must be a multiple of: 32 with any quantized operand, and the chunk of the op's
        activation layout (`k_align`)."""
        return max(self.a.block, self.w.block if self.w else 1, self.out.block if self.kind == "quantize" else 1, self.k_align)


FP32 = Op("fp32", "FP32 GEMM", "gemm", F.F32, F.F32, F.F32, "fp32", 2e-5, 1e-8, reference.exact_fp32)
W4A16 = Op("w4a16", "W4A16", "gemm", F.F32, F.Q4_0, F.F32, "fp32", 2e-5, 2e-2, reference.exact_w4a16)
W8A16 = Op("w8a16", "W8A16", "gemm", F.F32, F.Q8_0, F.F32, "fp32", 2e-5, 1e-3, reference.exact_w8a16)
W4A8 = Op("w4a8", "W4A8", "gemm", F.Q8_1, F.Q4_0, F.F32, "dp4a", 1e-5, 2e-2, reference.exact_w4a8)
W8A8 = Op("w8a8", "W8A8", "gemm", F.Q8_1, F.Q8_0, F.F32, "dp4a", 1e-5, 1e-3, reference.exact_w8a8)
W4A16H = Op("w4a16h", "W4A16 (fp16 MMA)", "gemm", F.F16, F.Q4_0, F.F32, "hmma", 5e-5, 2e-2, reference.exact_w4a16h)
W8A16H = Op("w8a16h", "W8A16 (fp16 MMA)", "gemm", F.F16, F.Q8_0, F.F32, "hmma", 5e-5, 1e-3, reference.exact_w8a16h)
# skinny kernels: float32 activations rounded to fp16 in registers, weights in the skinny layout
# (qgemm.packing) but given as ggml blocks (the kernel object packs them)
W4A16S = Op("w4a16s", "W4A16 skinny (f32 in, fp16 MMA)", "gemm", F.F32, F.Q4_0, F.F32, "hmma", 5e-5, 2e-2, reference.exact_w4a16s)
W8A16S = Op("w8a16s", "W8A16 skinny (f32 in, fp16 MMA)", "gemm", F.F32, F.Q8_0, F.F32, "hmma", 5e-5, 1e-3, reference.exact_w8a16s)
# skinny int8 kernels: float32 activations quantized to int8 by the kernel (float32 scale per block)
W4A8S = Op("w4a8s", "W4A8 skinny (f32 in, int8 MMA)", "gemm", F.F32, F.Q4_0, F.F32, "imma", 1e-5, 2e-2, reference.exact_w4a8s)
W8A8S = Op("w8a8s", "W8A8 skinny (f32 in, int8 MMA)", "gemm", F.F32, F.Q8_0, F.F32, "imma", 1e-5, 1e-3, reference.exact_w8a8s)
# the same kernels reading float16 / bfloat16 activations (SK_X): the values widened to float32
# exactly, so in one configuration each variant's result is bit for bit the float32 kernel's on
# the same values (the exact references are the float32 kernels', which widen 16-bit x themselves)
W4A16S_F16 = Op("w4a16s_f16", "W4A16 skinny (f16 in, fp16 MMA)", "gemm", F.F16, F.Q4_0, F.F32, "hmma", 5e-5, 2e-2, reference.exact_w4a16s)
W8A16S_F16 = Op("w8a16s_f16", "W8A16 skinny (f16 in, fp16 MMA)", "gemm", F.F16, F.Q8_0, F.F32, "hmma", 5e-5, 1e-3, reference.exact_w8a16s)
W4A8S_F16 = Op("w4a8s_f16", "W4A8 skinny (f16 in, int8 MMA)", "gemm", F.F16, F.Q4_0, F.F32, "imma", 1e-5, 2e-2, reference.exact_w4a8s)
W8A8S_F16 = Op("w8a8s_f16", "W8A8 skinny (f16 in, int8 MMA)", "gemm", F.F16, F.Q8_0, F.F32, "imma", 1e-5, 1e-3, reference.exact_w8a8s)
W4A16S_BF16 = Op("w4a16s_bf16", "W4A16 skinny (bf16 in, fp16 MMA)", "gemm", F.BF16, F.Q4_0, F.F32, "hmma", 5e-5, 2e-2,
                 reference.exact_w4a16s)
W8A16S_BF16 = Op("w8a16s_bf16", "W8A16 skinny (bf16 in, fp16 MMA)", "gemm", F.BF16, F.Q8_0, F.F32, "hmma", 5e-5, 1e-3,
                 reference.exact_w8a16s)
W4A8S_BF16 = Op("w4a8s_bf16", "W4A8 skinny (bf16 in, int8 MMA)", "gemm", F.BF16, F.Q4_0, F.F32, "imma", 1e-5, 2e-2,
                reference.exact_w4a8s)
W8A8S_BF16 = Op("w8a8s_bf16", "W8A8 skinny (bf16 in, int8 MMA)", "gemm", F.BF16, F.Q8_0, F.F32, "imma", 1e-5, 1e-3,
                reference.exact_w8a8s)


def _quantizers(fmt: F.Format, nmse_tol: float, cpu: Callable) -> tuple[Op, Op, Op]:
    """The quantize ops into `fmt` from float32, float16 and bfloat16: each kernel's bytes are
    `cpu` (qgemm.formats' quantizer) of the values widened to float32, which is exact."""
    return tuple(Op(f"quantize_{fmt.name}{suffix}", f"Quantize {title}to {fmt.name.upper()}", "quantize", a, None, fmt,
                    "memory", 0.0, nmse_tol, cpu=lambda x: cpu(F.to_float32(x)))
                 for a, suffix, title in ((F.F32, "", ""), (F.F16, "_f16", "f16 "), (F.BF16, "_bf16", "bf16 ")))


# the activations' Q8_1 quantizers (ggml-cuda's quantize_q8_1), and ggml's reference weight
# quantizers on the GPU (quantize.q4_0 / quantize.q8_0: float weights at load, qgemm.pack_weights)
QUANTIZE_Q8_1, QUANTIZE_Q8_1_F16, QUANTIZE_Q8_1_BF16 = _quantizers(F.Q8_1, 1e-3, F.quantize_q8_1)
QUANTIZE_Q4_0, QUANTIZE_Q4_0_F16, QUANTIZE_Q4_0_BF16 = _quantizers(F.Q4_0, 2e-2, F.quantize_q4_0)
QUANTIZE_Q8_0, QUANTIZE_Q8_0_F16, QUANTIZE_Q8_0_BF16 = _quantizers(F.Q8_0, 1e-3, F.quantize_q8_0)

CONVERT_F16 = Op("convert_f16", "Convert to f16", "quantize", F.F32, None, F.F16, "memory", 0.0, 1e-6,
                 cpu=lambda x: np.asarray(x, dtype=np.float32).astype(np.float16))
# the prologues of the Hopper prefill kernels: fp16 in the kperm16 layout (qgemm.packing.kperm16)
CONVERT_F16K = Op("convert_f16k", "Convert to f16 (kperm16 layout)", "quantize", F.F32, None, F.F16, "memory", 0.0, 1e-6,
                  cpu=lambda x: packing.kperm16(np.asarray(x, dtype=np.float32).astype(np.float16)), k_align=16,
                  out_natural=packing.unkperm16)
PERMUTE_F16K = Op("permute_f16k", "Permute f16 to the kperm16 layout", "quantize", F.F16, None, F.F16, "memory", 0.0, 0.0,
                  cpu=lambda x: packing.kperm16(np.asarray(x, dtype=np.float16)), k_align=16, out_natural=packing.unkperm16)
CONVERT_F16_BF16 = Op("convert_f16_bf16", "Convert bf16 to f16", "quantize", F.BF16, None, F.F16, "memory", 0.0, 1e-6,
                      cpu=lambda x: F.to_float32(x).astype(np.float16))
CONVERT_F16K_BF16 = Op("convert_f16k_bf16", "Convert bf16 to f16 (kperm16 layout)", "quantize", F.BF16, None, F.F16, "memory",
                       0.0, 1e-6, cpu=lambda x: packing.kperm16(F.to_float32(x).astype(np.float16)), k_align=16,
                       out_natural=packing.unkperm16)
# the weights' one-time repacking on the GPU (qgemm.pack_weights; qgemm.matmul per call on ggml blocks):
# ggml blocks [N, K/32] -> the skinny layout, byte for byte packing.pack
PACK_Q4_0 = Op("pack_q4_0", "Repack Q4_0", "pack", F.Q4_0, None, F.Q4_0, "memory", 0.0, 0.0,
               cpu=lambda w: packing.pack(w, "q4_0"))
PACK_Q8_0 = Op("pack_q8_0", "Repack Q8_0", "pack", F.Q8_0, None, F.Q8_0, "memory", 0.0, 0.0,
               cpu=lambda w: packing.pack(w, "q8_0"))

OPS = {op.name: op for op in (FP32, W4A16, W8A16, W4A8, W8A8, W4A16H, W8A16H, W4A16S, W8A16S, W4A8S, W8A8S,
                              W4A16S_F16, W8A16S_F16, W4A8S_F16, W8A8S_F16, W4A16S_BF16, W8A16S_BF16, W4A8S_BF16, W8A8S_BF16,
                              QUANTIZE_Q8_1, QUANTIZE_Q8_1_F16, QUANTIZE_Q8_1_BF16, QUANTIZE_Q4_0, QUANTIZE_Q4_0_F16,
                              QUANTIZE_Q4_0_BF16, QUANTIZE_Q8_0, QUANTIZE_Q8_0_F16, QUANTIZE_Q8_0_BF16, CONVERT_F16, CONVERT_F16K, CONVERT_F16_BF16,
                              CONVERT_F16K_BF16, PERMUTE_F16K, PACK_Q4_0, PACK_Q8_0)}


# ---------------------------------------------------------------------------------------------
# operand checks (host and device), all before anything launches


def _describe(x) -> str:
    if runtime.is_device_array(x) and not isinstance(x, np.ndarray):
        try:
            d = runtime.as_device_array(x)
            return f"device array {runtime.dtype_name(d.dtype)} {d.shape}"
        except Exception:
            return f"device object {type(x).__name__}"
    a = np.asarray(x)
    names = {f.dtype: f"{f.name} blocks" for f in F.FORMATS.values() if f.quantized}
    return f"{names.get(a.dtype) or runtime.dtype_name(a.dtype)} {a.shape}"


def _check_host(x, fmt: F.Format, role: str, op: Op, who: str | None = None) -> np.ndarray:
    name = who or op.name  # the kernel the user called, for messages
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name}: {role} must be a numpy array or a device array, got {type(x).__name__}")
    if fmt.quantized:
        if x.dtype != fmt.dtype and x.dtype != np.uint8:
            raise ValueError(
                f"{name}: {role} must be {fmt.name} blocks ({fmt.description}) [rows, K/32], got {_describe(x)}"
                + _format_hint(x, fmt)
            )
        if x.ndim != 2:
            raise ValueError(f"{name}: {role} must be 2-D [rows, K/32] {fmt.name} blocks, got shape {x.shape}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: {role} must be C-contiguous (np.ascontiguousarray), got strides {x.strides}")
        b = F.as_blocks(x, fmt, f"{name}: {role}")
        bad = F.nonfinite_block(b)
        if bad is not None:
            field, (row, blk), value = bad
            raise ValueError(f"{name}: {role} block {field} values must be finite; row {row}, block {blk} has "
                             f"{field} = {value}")
        if op.unit == "hmma" and fmt.name in ("q4_0", "q8_0"):  # dequantized by one float16 multiply per weight
            _refuse_f16_overflow(F.f16_dequant_overflow(b, fmt.name), name, role)
        return b
    if fmt is F.BF16 and F.is_bf16(x.dtype):
        x = F.as_bf16(x)  # ml_dtypes' bfloat16 as qgemm holds it (the same bytes)
    if x.dtype != fmt.dtype:
        raise ValueError(f"{name}: {role} must be {runtime.dtype_name(fmt.dtype)} [rows, K], got {_describe(x)}"
                         + _format_hint(x, fmt))
    if x.ndim != 2:
        raise ValueError(f"{name}: {role} must be 2-D [rows, K], got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: {role} must be C-contiguous (np.ascontiguousarray), got strides {x.strides}")
    x32 = F.to_float32(x)
    if not np.isfinite(x32).all():  # checked where it is cheap: host calls are synchronous anyway
        raise ValueError(f"{name}: {role} must be finite; found inf or NaN")
    if op.unit == "hmma" and fmt in (F.F32, F.BF16) and x32.size:  # the skinny fp16 kernels round x to half
        amax = float(np.abs(x32).max())
        if amax >= F.F16_INF_FROM:
            raise ValueError(f"{name}: {role} overflows float16, which this kernel rounds it to: |x| max {amax:g} is "
                             "beyond half's range (65504); scale it down, or use an int8 kernel (w4a8.* / w8a8.*)")
    return x


def _refuse_f16_overflow(over, name: str, role: str) -> None:
    """ValueError for weights that an fp16 tensor-core kernel would dequantize to inf:
    `over` is formats.f16_dequant_overflow's (row, block, d), or None."""
    if over is not None:
        row, blk, d = over
        raise ValueError(f"{name}: {role} row {row}, block {blk} (d = {d:g}) holds a weight d x q beyond "
                         f"float16's range (65504), which this fp16 tensor-core kernel would turn into inf; "
                         f"the int8 kernels (w4a8.* / w8a8.*) take such weights")


def _format_hint(x, fmt: F.Format) -> str:
    for other in F.FORMATS.values():
        if other.quantized and x.dtype == other.dtype and other is not fmt:
            return f" (these are {other.name} blocks; this kernel takes {fmt.name})"
    return ""


def _check_device(x, fmt: F.Format, role: str, op: Op, stream=None, who: str | None = None) -> runtime.DeviceArray:
    name = who or op.name  # the kernel the user called, for messages
    d = runtime.as_device_array(x, stream)  # (DLPack: the producer's pending work ordered before `stream`)
    if fmt.quantized:
        if d.dtype == np.uint8:  # raw bytes from torch/CuPy: [rows, nb * itemsize]
            if d.ndim != 2 or d.shape[1] % fmt.dtype.itemsize:
                raise ValueError(
                    f"{name}: {role} as raw bytes must be uint8 [rows, (K/32)*{fmt.dtype.itemsize}] ({fmt.name}), got {_describe(d)}"
                )
            d = d.view(fmt.dtype)
        elif d.dtype != fmt.dtype:
            raise ValueError(f"{name}: {role} must be {fmt.name} blocks on the device, got {_describe(d)}")
    elif d.dtype != fmt.dtype:
        raise ValueError(f"{name}: {role} must be {runtime.dtype_name(fmt.dtype)} [rows, K] on the device, got {_describe(d)}")
    if d.ndim != 2:
        raise ValueError(f"{name}: {role} must be 2-D, got shape {d.shape}")
    runtime.check_alignment(d, name, role)
    return d


def x_alignment(fmt: F.Format) -> int:
    """The byte boundary a kernel that reads its activations itself (the packed-layout kernels)
    needs them on: four values per load, so 8 bytes for float16 / bfloat16, else 16."""
    return 8 if fmt in (F.F16, F.BF16) else 16


def _k_of(shape: tuple[int, ...], fmt: F.Format) -> int:
    return shape[1] * fmt.block


# ---------------------------------------------------------------------------------------------
# kernels

PACK_UNSET = 2**31 - 1  # a pack.* kernel's status word before any block was flagged (it keeps the smallest index)


def packed_scale(dp, fmt: str, n: int, k: int, row: int, blk: int) -> float:
    """The float16 scale d of block `blk` of row `row`, read back from a packed buffer on the
    device (one element: for error messages)."""
    off = packing.scale_offset(fmt, n, k, row, blk)
    return float(runtime.DeviceArray(dp.ptr + off, (1,), np.float16, owner=dp).to_host()[0])


@dataclass
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shmem: int = 0  # dynamic shared memory bytes
    split: int = 1  # K split across CTAs: each adds its partial sums into C
    # launched with programmatic dependent launch when the kernel's spec supports it (KernelSpec.pdl)
    # and PDL is on: a configuration may turn it off where starting early costs more than it gives
    pdl: bool = True

    @property
    def zero_output(self) -> bool:
        """Split-K kernels accumulate into C with atomics, so C is zeroed first."""
        return self.split > 1

    def check(self, who: str, shape: str) -> None:
        """ValueError when CUDA cannot launch this grid (x < 2^31, y and z <= 65535 CTAs): a kernel
        whose grid grows with M along y handles at most 65535 of its row tiles in one call."""
        limits = (2**31 - 1, 65535, 65535)
        if 0 in self.grid:  # an empty operand, not a grid too large
            raise ValueError(f"{who}: {shape} has nothing to compute (a dimension of 0; every one must be >= 1)")
        if any(not 0 < d <= lim for d, lim in zip(self.grid, limits)):
            raise ValueError(f"{who}: {shape} needs a launch grid of {tuple(self.grid)} CTAs, beyond what CUDA launches "
                             "(x < 2^31, y and z <= 65535): split the call along M")


# The entry that zeroes a split-K GEMM's output before the GEMM adds into it (cuda_src/common/
# zero_output.cuh), a helper of the skinny kernels' modules (KernelSpec.helpers): queued instead of
# a memset, so that the kernel behind it is still launched with programmatic dependent launch. Its
# block: __launch_bounds__(256), a grid-stride loop of float4 stores.
ZERO_ENTRY = "qgemm_zero_output"
ZERO_THREADS = 256


def launch_zero_output(mod, out, count: int, stream=None, release_early: bool = True) -> None:
    """Queue `mod`'s qgemm_zero_output on the first `count` floats of the device array `out`:
    it waits for the kernel before it (programmatic dependent launch), then zeroes; release_early
    lets the kernel behind it launch at once (it waits for this grid before its first atomic add)."""
    blocks = min(max(-(-count // (4 * ZERO_THREADS)), 1), 1024)
    mod.launch(ZERO_ENTRY, (blocks, 1, 1), (ZERO_THREADS, 1, 1), 0,
               (out.ptr, np.int64(count), np.int32(bool(release_early))), stream=stream, pdl=True)


# configuration keys that shape only the launch (registry geometry), never the code: not passed to
# NVRTC, so configurations that differ only in them share one compile and one cache entry
LAUNCH_ONLY = frozenset({"SK_GSPLIT"})  # the skinny kernels' K split across CTAs: gridDim.y


class Kernel:
    """A registered kernel, ready to call: `c = k(a, w)` (`print(k.op)` shows its operand formats).

    Host numpy operands -> host (numpy) result (the call is synchronous). Device operands
    (`__cuda_array_interface__` or `__dlpack__`: torch, CuPy, qgemm.DeviceArray) -> the result
    stays on the device as a DeviceArray (or is written into `out=`), queued on `stream`. A
    kernel with its own weight layout (`*.skinny*`, `*.wgmma_rs`) given ggml blocks on the device
    repacks them on the GPU on every call, into a new buffer (pass `qgemm.pack_weights(w)` to do
    it once); a quantize / convert / pack kernel reads its flags back, so the call waits for the
    GPU.
    """

    def __init__(self, spec, arch: str | None = None):
        self.spec = spec
        self.name = spec.name
        self.op: Op = spec.op
        self._arch = arch
        self._loaded: dict[tuple, runtime.LoadedKernel] = {}
        self._launches: dict[tuple, tuple] = {}  # (M, N, K, defines) -> (module, Launch, int32 M N K): launch()'s memo
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<qgemm kernel {self.name}: {self.op}>"

    # -- compilation ---------------------------------------------------------------------------
    def compile(self, arch: str | None = None, defines: dict | None = None, **kw) -> jit.CompiledKernel:
        """NVRTC-compile (or fetch from the cache) for `arch`, default the GPU's, with the
        kernel's default configuration or `defines`. Needs no GPU when `arch` is given.
        UnsupportedArchError where the kernel cannot target `arch`; CompileError when NVRTC fails."""
        if defines is not None and not isinstance(defines, Mapping):
            raise ValueError(f"{self.name}.compile: defines must be a mapping of #define names to values "
                             f"(e.g. {{'SK_WARPS': 8}}), got {type(defines).__name__}")
        arch = jit.normalize_arch(arch or self._arch or runtime.device_arch())
        cc, _ = jit.parse_arch(arch)
        if not self.spec.runs_on(cc):  # sm_90a features (wgmma) exist on sm_90 only, not on later archs
            raise UnsupportedArchError(f"{self.name} needs {self.spec.arch_needed}; {arch} was requested")
        if self.spec.arch_suffix and not arch.endswith(self.spec.arch_suffix):
            arch = arch + self.spec.arch_suffix
        full = {k: v for k, v in {**self.spec.defines, **(defines or {})}.items() if k not in LAUNCH_ONLY}
        return jit.compile_kernel(self.name, self.spec.source, [self.spec.entry, *self.spec.helpers], arch, full, **kw)

    def _module(self, defines: dict | None = None) -> runtime.LoadedKernel:
        key = tuple(sorted((k, v) for k, v in (defines or {}).items() if k not in LAUNCH_ONLY))
        mod = self._loaded.get(key)
        if mod is None:
            with self._lock:
                mod = self._loaded.get(key)
                if mod is None:
                    runtime.require_gpu(f"running {self.name}")
                    info = runtime.device_info()
                    if not self.spec.runs_on(info.cc):
                        raise UnsupportedArchError(
                            f"{self.name} needs {self.spec.arch_needed}, but the GPU ({info.name}) is {info.arch}"
                        )
                    ck = self.compile(info.arch, defines)
                    mod = runtime.LoadedKernel(ck.cubin, ck.entries, self.name)  # the kernel and its helpers
                    self._loaded[key] = mod
        return mod

    def config_for(self, m: int, n: int, k: int) -> dict:
        """The #defines a launch of this shape uses: a tuned entry if `qgemm tune` stored one for
        this GPU and shape bucket (and it fits this shape), else the kernel's default heuristic,
        within the GPU's shared memory per block."""
        if self.spec.config is None:
            return {}
        from . import tuning

        tuned = tuning.lookup(self.name, m, n, k)
        if tuned is not None:
            return tuned
        if not runtime.gpu_available():
            return self.spec.config(m, n, k, 132)
        info = runtime.device_info()
        return self.default_config(m, n, k, info.sm_count, info.smem_per_block_optin)

    def default_config(self, m: int, n: int, k: int, sm_count: int = 132, smem_limit: int | None = None) -> dict:
        """The kernel's default heuristic for a shape; where its tiles need more shared memory per
        block than `smem_limit` (sm_86 / sm_89 / sm_120 allow 99 KB, the heuristics are tuned on
        227 KB parts), the candidate configuration that uses the most of it instead. {} for a
        kernel without launch-time configurations (as config_for)."""
        if self.spec.config is None:
            return {}
        d = self.spec.config(m, n, k, sm_count)
        if smem_limit is None or self.spec.candidates is None or self.geometry(m, n, k, d).shmem <= smem_limit:
            return d
        fits = [(self.geometry(m, n, k, c).shmem, i, c) for i, c in enumerate(self.spec.candidates(m, n, k))]
        fits = [f for f in fits if f[0] <= smem_limit]
        return max(fits, key=lambda f: (f[0], -f[1]))[2] if fits else d

    # -- calling -------------------------------------------------------------------------------
    def __call__(self, a, w=None, *, out=None, stream=None):
        """GEMM kernels: `k(a, w)` -> C float32 [M, N] = A . W^T, A 2-D (no leading dimensions:
        qgemm.matmul takes those) and A, W in `k.op`'s formats -- e.g. `w4a16.tiled` float32 A,
        the fp16-MMA `w4a16.mma` float16 A, `w4a8.*` Q8_1 blocks (qgemm.quantize_q8_1) -- both
        numpy or both device arrays (W may be a PackedWeights, with device A). Quantize / convert
        kernels: `k(x)` -> Q8_1 blocks [M, K/32] or float16 [M, K]. `pack.*` kernels: `k(w)` ->
        the weights' skinny layout as uint8 bytes (what `packing.pack` makes). `mustafar.*` kernels:
        `k(q_or_p, compressed_cache)` (qgemm.kvcache.scores / attend). Host operands -> numpy
        result; device operands -> device result, or `out=` (a writable device array of the
        result's dtype and shape, or its raw uint8 bytes), queued on `stream`.

        ValueError for operands of the wrong number, format, shape or K (host operands: also
        non-finite values), or M beyond a decode kernel's max_m, before the launch; after it, for
        a quantizer input that is not finite or passes half's range. NoGPUError without a GPU;
        UnsupportedArchError where the GPU cannot run the kernel."""
        if getattr(self.spec, "runner", None) is not None:  # e.g. mustafar.*: (queries, compressed cache)
            return self.spec.runner(self, a, w, out=out, stream=stream)
        if self.op.kind == "quantize":
            if w is not None:
                raise ValueError(f"{self.name} takes one operand (the {runtime.dtype_name(self.op.a.dtype)} activations), got two")
            return self._call_quantize(a, out=out, stream=stream)
        if self.op.kind == "pack":
            if w is not None:
                raise ValueError(f"{self.name} takes one operand (the {self.op.a.name} weight blocks [N, K/32]), got two")
            return self._call_pack(a, out=out, stream=stream)
        if w is None:
            raise ValueError(f"{self.name} takes two operands: A ({self.op.a}) and W ({self.op.w})")
        return self._call_gemm(a, w, out=out, stream=stream)

    def _check_m(self, m: int) -> None:
        if self.spec.max_m is not None and m > self.spec.max_m:
            raise ValueError(f"{self.name} handles at most M={self.spec.max_m} rows of activations (a decode kernel); got M={m}")

    # -- weights in a kernel-specific layout (KernelSpec.weight_layout, qgemm.packing) ------------
    @property
    def packed(self) -> bool:
        """Whether the kernel reads its weights in a layout of its own (qgemm.packing's skinny
        layout), made from the ggml blocks by upload_weights or qgemm.pack_weights."""
        return getattr(self.spec, "weight_layout", None) is not None

    def upload_weights(self, w: np.ndarray) -> runtime.DeviceArray:
        """Host weights in the op's W format -> the device buffer this kernel reads (repacked for
        kernels with a weight layout: a one-time cost, not part of a launch)."""
        if self.packed:
            return runtime.DeviceArray.from_host(packing.pack(w, self.op.w.name))
        return runtime.DeviceArray.from_host(w)

    # -- activations in a kernel-specific layout (KernelSpec.act_layout: "kperm16") ----------------
    @property
    def act_layout(self) -> str | None:
        """The kernel's own activation layout ("kperm16", qgemm.packing.kperm16), or None."""
        return getattr(self.spec, "act_layout", None)

    def upload_activations(self, a: np.ndarray) -> runtime.DeviceArray:
        """Host activations in the op's A format -> the device buffer this kernel reads (in its
        activation layout, when it has one; qgemm.matmul's prologue writes that layout itself)."""
        if self.act_layout is not None:
            return runtime.DeviceArray.from_host(packing.kperm16(a))
        return runtime.DeviceArray.from_host(a)

    def _device_activations(self, da: runtime.DeviceArray, m: int, k: int, stream=None) -> runtime.DeviceArray:
        """Device activations (checked) as this kernel reads them: permuted on the GPU by the
        layout's prologue kernel into a new buffer when the kernel has an activation layout."""
        if self.act_layout is None:
            return da
        from . import registry

        perm = registry.get("convert.f16k_f16")
        dq = runtime.DeviceArray.empty((m, k), np.float16)
        status = runtime.DeviceArray.from_host(np.zeros(1, dtype=np.int32))
        perm.launch_quantize(da, dq, m, k, status, stream=stream)
        return dq

    def _device_weights(self, w, stream=None) -> runtime.DeviceArray:
        """Device weights as this kernel reads them: a PackedWeights' skinny buffer, or ggml
        blocks (repacked on the GPU, into a new buffer, when the kernel needs its layout).
        `shape_of` has checked the format."""
        if isinstance(w, packing.PackedWeights):
            return w.packed if self.packed else w.blocks
        d = _check_device(w, self.op.w, "W", self.op, stream, self.name)
        if self.packed:  # repacked on the GPU (pack.q4_0 / pack.q8_0) into a buffer of this call's
            from . import registry

            n, k = d.shape[0], d.shape[1] * F.QK
            pack = registry.get(f"pack.{self.op.w.name}")
            pack.check_launch(0, n, k)
            dp = runtime.DeviceArray.empty((packing.packed_nbytes(self.op.w.name, n, k),), np.uint8)
            pack.launch_pack(d, dp, n, k, stream=stream)
            return dp
        return d

    def shape_of(self, a, w) -> tuple[int, int, int]:
        """(M, N, K) of operands in this kernel's formats, validating them."""
        if isinstance(w, packing.PackedWeights):
            if w.fmt != self.op.w.name:
                raise ValueError(f"{self.name}: W must be {self.op.w.name} weights, got PackedWeights of {w.fmt}")
            if self.op.unit == "hmma":  # found when they were packed (a device array of blocks is not checked)
                _refuse_f16_overflow(w.f16_overflow, self.name, "W")
            w = w.blocks
        on_device = [runtime.is_device_array(x) and not isinstance(x, np.ndarray) for x in (a, w)]
        if on_device[0] != on_device[1]:
            raise ValueError(
                f"{self.name}: A and W must both be host (numpy) arrays or both device arrays; got A: {_describe(a)}, W: {_describe(w)}"
            )
        chk = _check_device if on_device[0] else _check_host
        a_, w_ = chk(a, self.op.a, "A", self.op, who=self.name), chk(w, self.op.w, "W", self.op, who=self.name)
        m, ka = a_.shape[0], _k_of(a_.shape, self.op.a)
        n, kw = w_.shape[0], _k_of(w_.shape, self.op.w)
        if ka != kw:
            raise ValueError(f"{self.name}: K mismatch: A {_describe(a)} has K={ka}, W {_describe(w)} has K={kw}")
        if ka <= 0 or ka % self.op.k_multiple:
            raise ValueError(f"{self.name}: K must be a positive multiple of {self.op.k_multiple}, got K={ka}")
        if m <= 0 or n <= 0:
            raise ValueError(f"{self.name}: M and N must be positive, got M={m}, N={n}")
        self._check_m(m)
        return m, n, ka

    def _out(self, out, shape, dtype, stream=None):
        if out is None:
            return runtime.DeviceArray.empty(shape, dtype)
        o = runtime.as_output_array(out, self.name, stream)
        if o.shape != tuple(shape) or o.dtype != np.dtype(dtype):
            if not (o.dtype == np.uint8 and o.nbytes == int(np.prod(shape)) * np.dtype(dtype).itemsize):
                raise ValueError(f"{self.name}: out must be {np.dtype(dtype)} {tuple(shape)}, got {_describe(o)}")
            o = o.reshape(-1).view(dtype).reshape(shape)
        runtime.check_alignment(o, self.name, "out=")
        return o

    def _call_gemm(self, a, w, out=None, stream=None):
        m, n, k = self.shape_of(a, w)
        device = not isinstance(a, np.ndarray)
        if not device and out is not None and isinstance(out, np.ndarray):
            raise ValueError(f"{self.name}: out= must be a device array; host calls return a new numpy array")
        defines = self.config_for(m, n, k)  # once, for the grid check and the launch
        self.check_launch(m, n, k, defines)
        self._module()  # no GPU, or a GPU too old: fail before allocating anything
        staged = not device or self.act_layout is not None or (self.packed and not isinstance(w, packing.PackedWeights))
        runtime.prepare_call(stream, self.name, None if not staged else (
            "this call cannot be captured into a CUDA graph (it uploads, reads back or stages operands synchronously); "
            "capture qgemm.matmul, or this kernel on device arrays in its own formats"))
        stream = runtime.launch_stream(stream)  # once: a caller's stream is checked (driver calls) on each conversion
        if device:
            da = _check_device(a, self.op.a, "A", self.op, stream, self.name)
            dw = self._device_weights(w, stream)
            align = x_alignment(self.op.a)
            if self.packed and da.ptr % align and self.act_layout is None:
                raise ValueError(f"{self.name}: A must start on a {align}-byte boundary (4 values per load), got address {da.ptr:#x}")
            da = self._device_activations(da, m, k, stream)
        else:
            da = self.upload_activations(_check_host(a, self.op.a, "A", self.op, self.name))
            dw = self.upload_weights(_check_host(w, self.op.w, "W", self.op, self.name))
        dc = self._out(out, (m, n), np.float32, stream)
        # weights repacked on the GPU just now (device ggml blocks): the kernel must not start before
        # that repacking is complete -- it reads its weights above its pdl_wait (common/pdl.cuh)
        repacked = device and self.packed and not isinstance(w, packing.PackedWeights)
        self.launch(da, dw, dc, m, n, k, stream=stream, defines=defines, pdl=not repacked)
        if device:
            return out if out is not None else dc
        return dc.to_host()

    def check_launch(self, m: int, n: int, k: int, defines: dict | None = None) -> None:
        """ValueError, before anything launches, where the shape's grid is beyond CUDA's limits
        (a `pack.*` kernel repacks the [N, K] weights of an MxNxK product: M is not used)."""
        if self.op.kind == "pack":
            if n * (k // F.QK) > 2**31 - 1:  # the kernel's block index (row * K/32 + block) is an int
                raise ValueError(f"{self.name}: N={n} x K/32={k // F.QK} blocks is beyond the 2^31 - 1 blocks one "
                                 "repacking handles; repack the weights in parts of fewer rows")
            self.spec.geometry(n, 0, k).check(self.name, f"N={n} K={k}")
            return
        if self.op.kind == "quantize":
            g = self.spec.geometry(m, 0, k)
        else:
            g = self.geometry(m, n, k, defines if defines is not None else self.config_for(m, n, k))
        g.check(self.name, f"M={m}" + ("" if self.op.kind == "quantize" else f" N={n}") + f" K={k}")

    def geometry(self, m: int, n: int, k: int, defines: dict) -> Launch:
        """The launch (grid, block, dynamic shared memory, split-K zeroing) of a shape in the
        configuration `defines`."""
        return self.spec.geometry(m, n, k, defines) if self.spec.config is not None else self.spec.geometry(m, n, k)

    def launch(self, da, dw, dc, m: int, n: int, k: int, stream=None, defines: dict | None = None,
               zeroed: bool = False, pdl: bool = True) -> None:
        """Launch on device arrays already in this kernel's formats (no checks: the hot path).
        zeroed: C is already zeroed for split-K (qgemm.matmul has the prologue kernel do it, so
        that a kernel with `pdl` directly follows the prologue it overlaps). pdl=False: this kernel never
        with programmatic dependent launch -- where a kernel earlier in the op writes the weights this
        one reads above its pdl_wait (qgemm.matmul's per-call repacking); a zero kernel in front of it
        (ZERO_ENTRY) is still PDL-launched: it reads nothing and waits before it stores."""
        if defines is None:
            defines = self.config_for(m, n, k)
        key = (m, n, k, tuple(defines.items()))
        hit = self._launches.get(key)
        if hit is None:  # the module, geometry and int32 shape arguments of a shape and configuration, made once
            hit = runtime.remember(self._launches, key, (self._module(defines), self.geometry(m, n, k, defines),
                                                         (np.int32(m), np.int32(n), np.int32(k))), 1024)
        mod, g, dims = hit
        if g.zero_output and not zeroed:
            if ZERO_ENTRY in self.spec.helpers:  # a kernel: this GEMM still starts early, behind it
                launch_zero_output(mod, dc, m * n, stream)
                zeroed = True
            else:
                dc.fill_bytes(0, stream)
        # pointers as Python ints: cuda.core passes an int as a pointer-sized argument (its fast path;
        # a numpy scalar per pointer cost ~0.25 us each)
        args = (da.ptr, dw.ptr, dc.ptr) + dims
        # programmatic dependent launch unless a memset zeroed C right before it (a memset is no
        # kernel: nothing to overlap)
        mod.launch(self.spec.entry, g.grid, g.block, g.shmem, args, stream=stream,
                   pdl=pdl and self.spec.pdl and g.pdl and (zeroed or not g.zero_output))

    # -- weight repacking (pack.*) ---------------------------------------------------------------
    def _call_pack(self, w, out=None, stream=None):
        fmt = self.op.a
        device = not isinstance(w, np.ndarray)
        if device and not runtime.is_device_array(w):
            raise ValueError(f"{self.name}: W must be a numpy array or a device array of {fmt.name} blocks [N, K/32], "
                             f"got {type(w).__name__}")
        if runtime.gpu_available():
            runtime.prepare_call(stream, self.name, "a repacking called alone reads its checks back, which a CUDA graph "
                                                    "capture cannot; pack once, at load (qgemm.pack_weights), before "
                                                    "capturing")
        if device:
            dw = _check_device(w, fmt, "W", self.op, stream, self.name)
            n, nb = dw.shape
        else:  # finite block scales: _check_host says so here, the kernel's flag for device blocks
            hb = _check_host(w, fmt, "W", self.op, self.name)
            n, nb = hb.shape
        if n <= 0 or nb <= 0:
            raise ValueError(f"{self.name}: W must have N >= 1 rows and K/32 >= 1 blocks, got shape {(n, nb)}")
        k = nb * F.QK
        self.check_launch(0, n, k)
        if not device:
            runtime.require_gpu(f"running {self.name}")
            dw = runtime.DeviceArray.from_host(hb)
        self._module()
        dp = self._out(out, (packing.packed_nbytes(fmt.name, n, k),), np.uint8, stream)
        _, bad = self._repack_checked(dw, dp, n, k, stream=stream)
        if bad is not None:
            raise ValueError(f"{self.name}: W block scales must be finite; row {bad[0]}, block {bad[1]} has d = {bad[2]}")
        if device:
            return out if out is not None else dp
        return dp.to_host()

    def _repack_checked(self, dw, dp, n: int, k: int, stream=None):
        """launch_pack with its checks read back (the call waits for the GPU): (overflow, bad),
        each None or the (row, block, d) of the first block whose d x q overflows float16 /
        whose d is not finite."""
        status = runtime.DeviceArray.from_host(np.full(2, PACK_UNSET, dtype=np.int32))
        self.launch_pack(dw, dp, n, k, status, stream=stream)
        found = []
        for at in (int(v) for v in status.to_host()):
            row, blk = divmod(at, k // F.QK)
            found.append(None if at == PACK_UNSET else (row, blk, packed_scale(dp, self.op.a.name, n, k, row, blk)))
        return tuple(found)

    def launch_pack(self, dw, dp, n: int, k: int, status=None, stream=None) -> None:
        """Launch a `pack.*` kernel on device arrays already checked (the hot path): the [N, K]
        ggml blocks at `dw` (2-byte aligned) -> their skinny layout at `dp`
        (packing.packed_nbytes bytes, every byte written). status: None, or an int32 [2] device
        array set to PACK_UNSET, into which the kernel writes the index row * K/32 + block of the
        first block whose d x q overflows float16 ([0]) and of the first whose d is not finite
        ([1]). Not launched with programmatic dependent launch (KernelSpec.pdl is off): released
        early behind the previous op's GEMM, the Q8_0 repacking made qgemm.matmul's op 30% slower
        on the H100 (docs/perf/NOTES.md, session 36); its kernel waits before its first store all
        the same, for a spec that turns it on."""
        if dw.ptr % 2:
            raise ValueError(f"{self.name}: the weight blocks must start on a 2-byte boundary (their float16 scales), "
                             f"got address {dw.ptr:#x}")
        if dp.ptr % 16:  # the kernel stores 16 bytes at a time: a misaligned store faults and poisons the context
            raise ValueError(f"{self.name}: the packed output must start on a 16-byte boundary (16-byte stores), got "
                             f"address {dp.ptr:#x}")
        mod = self._module()
        g = self.spec.geometry(n, 0, k)
        args = (dw.ptr, dp.ptr, np.int32(n), np.int32(k), status.ptr if status is not None else 0)  # (ints: pointers)
        mod.launch(self.spec.entry, g.grid, g.block, g.shmem, args, stream=stream, pdl=self.spec.pdl)

    # -- quantizers ----------------------------------------------------------------------------
    def _call_quantize(self, x, out=None, stream=None):
        device = not isinstance(x, np.ndarray)
        if device and not runtime.is_device_array(x):  # a list, None, ...: said as the GEMM kernels say it
            raise ValueError(f"{self.name}: X must be a numpy array or a device array, got {type(x).__name__}")
        if runtime.gpu_available():
            runtime.prepare_call(stream, self.name, "a quantizer called alone reads its overflow flag back, which a "
                                                    "CUDA graph capture cannot; qgemm.matmul captures its own quantization")
        fmt = self.op.a
        if device:
            try:
                dx = _check_device(x, fmt, "X", self.op, stream, self.name)
            except ValueError as e:  # another input type: name the form of this quantizer that takes it
                came = runtime.as_device_array(x, stream).dtype if runtime.is_device_array(x) else None
                from . import registry

                sibling = next((s.name for s in registry.list_kernels(family=self.spec.family)
                                if s.op.kind == "quantize" and s.op.out == self.op.out and came is not None
                                and came != fmt.dtype and s.op.a.dtype == came and s.op.k_align == self.op.k_align), None)
                if sibling is None:
                    raise
                raise ValueError(f"{e}; {sibling} takes {runtime.dtype_name(came)}") from None
        else:
            dx = None
            x = _check_host(x, fmt, "X", self.op, self.name)  # (bfloat16 from ml_dtypes: viewed as qgemm holds it)
        m, k = dx.shape if device else x.shape  # 2-D: _check_device / _check_host said so
        if k <= 0 or k % self.op.k_multiple:
            raise ValueError(f"{self.name}: K must be a positive multiple of {self.op.k_multiple}, got K={k}")
        if m <= 0:
            raise ValueError(f"{self.name}: M must be positive, got M={m}")
        self.check_launch(m, 0, k)
        if not device:  # finite: _check_host said so
            if not runtime.gpu_available():  # named, before the upload asks for the runtime
                runtime.require_gpu(f"running {self.name}")
            dx = runtime.DeviceArray.from_host(x)
        self._module()
        dy = self._out(out, (m, k // self.op.out.block), self.op.out.dtype, stream)
        status = runtime.DeviceArray.from_host(np.zeros(1, dtype=np.int32))
        self.launch_quantize(dx, dy, m, k, status, stream=stream)
        flag = int(status.to_host()[0])  # one int: the price of turning bad data into an exception
        if flag & 1:
            raise ValueError(f"{self.name}: input must be finite; found inf or NaN")
        if flag & 2:
            if self.op.out in (F.Q4_0, F.Q8_0):  # d = max / -8 or amax / 127 rounds to half's inf from 65520
                limit = "524160 (d = max / -8)" if self.op.out == F.Q4_0 else "8321040 (d = amax / 127)"
                raise ValueError(f"{self.name}: a block's scale d overflows half (max 65504): some block holds a value of "
                                 f"magnitude >= {limit}; scale the input down")
            raise ValueError(f"{self.name}: a value, a block's scale d or sum s overflows half (max 65504); scale the input down")
        if device:
            return out if out is not None else dy
        return dy.to_host()

    def launch_quantize(self, dx, dy, m: int, k: int, status, stream=None, zero=None) -> None:
        """Launch a quantize / convert kernel on device arrays already checked (the hot path):
        x [M, K] -> y; it ORs into the int32 `status` word 1 for a non-finite input, 2 for a
        value (or a Q8_1 scale d or sum s) beyond half's range. zero: a device array the GEMM
        behind this prologue accumulates into (split-K): zeroed by the prologue kernel itself
        where it can (KernelSpec.zeroes), else by a memset first."""
        mod = self._module()
        g = self.spec.geometry(m, 0, k)
        args = (dx.ptr, dy.ptr, np.int32(m), np.int32(k), status.ptr)  # (Python ints: pointers, as in Kernel.launch)
        if self.spec.zeroes:
            args += (zero.ptr if zero is not None else 0, np.int64(zero.size if zero is not None else 0))
        elif zero is not None:
            zero.fill_bytes(0, stream)
        mod.launch(self.spec.entry, g.grid, g.block, g.shmem, args, stream=stream, pdl=self.spec.pdl)


# ---------------------------------------------------------------------------------------------
# attention on a compressed KV cache (qgemm/kvcache.py, cuda_src/mustafar/): these kernels are
# launched through their KernelSpec.runner, not the GEMM convention above


@dataclass(frozen=True)
class AttentionOp(Op):
    """An attention op: `a` = queries or probabilities (f16), `w` = the compressed cache (its
    dequantized values are f16), `out` = scores (f16) or outputs (f32)."""

    role: str = "key"  # "key": scores = q . K^T; "value": out = p . V

    def __str__(self) -> str:
        if self.role == "key":
            return (f"{self.title}: q f16 [B*groups, Lq, D] x compressed K [B, S, D] -> scores f16 "
                    "[B*groups, Lq, S] (grouped-query attention)")
        return (f"{self.title}: p f16 [B*groups, Lq, S] x compressed V [B, S, D] -> out f32 "
                "[B*groups, Lq, D] (grouped-query attention)")

    @property
    def k_multiple(self) -> int:
        return 1


# exact_tol: vs the numpy reference on the decompressed cache, relative to the products' energy
# (half2 accumulation over <= 32 products, fp16 scores); nmse_tol: unused (the runner compares
# with the reference's own error against the dense computation)
MUSTAFAR_KEY = AttentionOp("mustafar_key", "Mustafar sparse K", "attention", F.F16, F.F16, F.F16, "memory", 5e-3, 0.0, role="key")
MUSTAFAR_VALUE = AttentionOp("mustafar_value", "Mustafar sparse V", "attention", F.F16, F.F16, F.F32, "memory", 5e-3, 0.0, role="value")
OPS[MUSTAFAR_KEY.name] = MUSTAFAR_KEY
OPS[MUSTAFAR_VALUE.name] = MUSTAFAR_VALUE
