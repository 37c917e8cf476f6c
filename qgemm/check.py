"""Validation: run a kernel on fresh random inputs and compare with the numpy references.

Every run draws new Gaussian inputs (never zeros), poisons the output with 0xFF bytes (NaN for
float32) so an element the kernel never writes shows up, and reports:
- max abs error and relative error against the exact-math reference (tight tolerance),
- NMSE against the float64 product of the unquantized inputs (quantization-level tolerance).

Both errors are normalised by the *energy* of the products, E = sum_{m,n} sum_k (a_mk w_nk)^2,
rather than by ||C||^2. For large random inputs the two agree (E[c^2] = sum_k a^2 w^2), but a
small output (1x1x32: one dot product) can cancel to nearly zero by chance, and dividing by it
would fail a correct kernel. Quantization error is also a random sum, so with few blocks it
fluctuates: the NMSE tolerance is widened by (1 + 8 / sqrt(M*N*K/32) + 9 / sqrt(M*N))
(nmse_tolerance), about 1.0x at prefill sizes and 18x for a single block of a single output.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from . import formats as F
from . import packing, reference, runtime
from .ops import Kernel, Op


def parse_shape(text: str, dims: int = 3, form: str | None = None) -> tuple[int, ...]:
    """'512x4096x4096' -> (512, 4096, 4096). ValueError names the expected form (`form`, default
    MxNxK)."""
    parts = str(text).lower().replace("×", "x").replace("*", "x").split("x")
    try:
        vals = tuple(int(p) for p in parts)
    except ValueError:
        vals = ()
    if len(vals) != dims or any(v <= 0 for v in vals):
        raise ValueError(f"shape must be {form or 'x'.join('MNK'[:dims])} with positive integers (e.g. "
                         f"{'32x16384x128' if form == 'BxSxD' else '512x4096x4096'}), got {text!r}")
    if any(v >= 2**31 for v in vals):  # the kernels take their sizes as int32 (plan / explain refuse them too)
        raise ValueError(f"shape {text!r}: every size must be below 2^31")
    return vals


@dataclass
class Inputs:
    """Operands in a kernel's formats plus the float originals they were made from."""

    a_float: np.ndarray
    w_float: np.ndarray | None
    a: np.ndarray
    w: np.ndarray | None


def make_inputs(op: Op, m: int, n: int, k: int, rng: np.random.Generator, weights: np.ndarray | None = None) -> Inputs:
    """Fresh Gaussian operands in the op's formats. `weights` (e.g. a tensor loaded from a GGUF
    file, in the op's W format) replaces the random weights; the float64 truth then uses its
    dequantized values, so the NMSE measures the activation side alone."""
    if k % op.k_multiple:
        raise ValueError(f"{op.name}: K must be a multiple of {op.k_multiple}, got K={k}")
    if op.kind == "pack":  # the weights of the MxNxK product: N x K blocks (a GGUF tensor's, when given)
        w = weights if weights is not None else F.quantize(rng.standard_normal((n, k), dtype=np.float32), op.a)
        return Inputs(np.zeros((0, k), np.float32), F.dequantize(w, op.a), w, w)
    a_f = rng.standard_normal((m, k), dtype=np.float32)
    if op.kind == "gemm" and op.a.quantized:
        a = F.quantize(a_f, op.a)
    elif op.kind == "gemm" and op.a.dtype != np.float32:
        a = F.from_float32(a_f, op.a)  # fp16 / bf16 activations: the truth still uses the float32 originals
    else:
        a = a_f
    if op.kind == "quantize":
        x = F.from_float32(a_f, op.a)
        return Inputs(F.to_float32(x), None, x, None)
    if weights is not None:
        w = weights
        w_f = F.dequantize(w, op.w) if op.w.quantized else np.asarray(w, dtype=np.float32)
        return Inputs(a_f, w_f, a, w)
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    w = F.quantize(w_f, op.w) if op.w.quantized else w_f
    return Inputs(a_f, w_f, a, w)


@dataclass
class Result:
    kernel: str
    shape: tuple[int, int, int]
    seed: int
    passed: bool
    max_abs_err: float
    rel_err: float  # vs the exact-math reference
    nmse: float  # vs float64 ground truth
    unwritten: int  # outputs still holding the poison
    exact_tol: float
    nmse_tol: float
    note: str = ""
    detail: dict = field(default_factory=dict)
    inputs: Inputs | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("inputs", None)
        return d


def run_poisoned(kernel: Kernel, inp: Inputs, m: int, n: int, k: int, stream=None,
                 defines: dict | None = None) -> np.ndarray:
    """Run with the output pre-filled with 0xFF bytes; return it on the host. defines: a GEMM's
    configuration (default: the one it picks for the shape)."""
    op = kernel.op
    if op.kind == "pack":
        dw = runtime.DeviceArray.from_host(inp.w)
        dp = runtime.DeviceArray.empty((packing.packed_nbytes(op.a.name, n, k),), np.uint8)
        dp.fill_bytes(0xFF, stream)
        kernel.launch_pack(dw, dp, n, k, stream=stream)
        runtime.check_last_error(kernel.name)
        return dp.to_host()
    if op.kind == "quantize":
        dx = runtime.DeviceArray.from_host(inp.a)
        dy = runtime.DeviceArray.empty((m, k // op.out.block), op.out.dtype)
        dy.fill_bytes(0xFF, stream)
        status = runtime.DeviceArray.from_host(np.zeros(1, np.int32))
        kernel.launch_quantize(dx, dy, m, k, status, stream=stream)
        return dy.to_host()
    da = kernel.upload_activations(inp.a)
    dw = kernel.upload_weights(inp.w)
    dc = runtime.DeviceArray.empty((m, n), np.float32)
    dc.fill_bytes(0xFF, stream)
    kernel.launch(da, dw, dc, m, n, k, stream=stream, defines=defines)
    runtime.check_last_error(kernel.name)
    return dc.to_host()


def validate(kernel: Kernel, shape: tuple[int, int, int], seed: int | None = None, weights: np.ndarray | None = None,
             opts: dict | None = None) -> Result:
    if getattr(kernel.spec, "runner", None) is not None:  # kernels outside the GEMM convention (mustafar.*)
        return kernel.spec.runner.validate(kernel, shape, seed, opts or {})
    m, n, k = shape
    kernel._check_m(m)
    kernel.check_launch(m, n, k)  # before the inputs are made: a shape CUDA cannot launch says so
    op = kernel.op
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2**31))
    rng = np.random.default_rng(seed)
    inp = make_inputs(op, m, n, k, rng, weights)
    if op.kind == "pack":
        n = inp.w.shape[0]
    out = run_poisoned(kernel, inp, m, n, k)

    if op.kind == "pack":  # a permutation: every byte must be packing.pack's
        expect = op.cpu(inp.w)
        chunks, exp_c = out.reshape(-1, 16), expect.reshape(-1, 16)
        bad = int(np.any(chunks != exp_c, axis=1).sum())
        unwritten = int((np.all(chunks == 0xFF, axis=1) & np.any(exp_c != 0xFF, axis=1)).sum())
        got = F.dequantize(packing.unpack(out, op.a.name, n, k), op.a).astype(np.float64)
        want = inp.w_float.astype(np.float64)
        max_abs = float(np.nanmax(np.abs(got - want))) if bad else 0.0
        rel = reference.relative_error(np.nan_to_num(got), want) if bad else 0.0
        return Result(kernel.name, shape, seed, bad == 0, max_abs, rel, 0.0, unwritten, 0.0, 0.0,
                      note=f"{bad} of {chunks.shape[0]} 16-byte chunks differ from packing.pack",
                      detail={"mismatched_chunks": bad})

    if op.kind == "quantize":
        expect = op.cpu(inp.a)
        item = op.out.dtype.itemsize
        got_b = out.view(np.uint8).reshape(-1, item)
        exp_b = expect.view(np.uint8).reshape(-1, item)
        bad_blocks = int(np.any(got_b != exp_b, axis=1).sum())
        deq = (lambda v: F.dequantize(v, op.out)) if op.out.quantized else (lambda v: v.astype(np.float32))
        if op.out_natural is not None:  # a layout (kperm16): the error figures compare values in [M, K] order
            deq = (lambda d: lambda v: d(op.out_natural(v)))(deq)
        deq_gpu = deq(out).astype(np.float64)
        deq_cpu = deq(expect).astype(np.float64)
        poisoned = int(np.all(got_b == 0xFF, axis=1).sum())
        max_abs = float(np.nanmax(np.abs(deq_gpu - deq_cpu))) if deq_gpu.size else 0.0
        return Result(kernel.name, shape, seed, bad_blocks == 0, max_abs,
                      reference.relative_error(np.nan_to_num(deq_gpu), deq_cpu), F.nmse(np.nan_to_num(deq_gpu), inp.a_float),
                      poisoned, 0.0, op.nmse_tol, note=f"{bad_blocks} of {got_b.shape[0]} {op.out.name} elements differ from the CPU",
                      detail={"mismatched_blocks": bad_blocks})

    exact = op.exact(inp.a, inp.w)
    truth = reference.truth(inp.a_float, inp.w_float)
    result = compare(kernel.name, op, shape, seed, out, exact, truth, inp.a_float, inp.w_float)
    result.inputs = inp
    return result


def product_energy(a: np.ndarray, w: np.ndarray) -> float:
    """sum_{m,n} sum_k (a_mk * w_nk)^2 = colsum(a^2) . colsum(w^2), in float64."""
    a2 = np.square(np.asarray(a, dtype=np.float64)).sum(axis=0)
    w2 = np.square(np.asarray(w, dtype=np.float64)).sum(axis=0)
    return float(a2 @ w2)


def nmse_tolerance(op: Op, shape: tuple[int, int, int]) -> float:
    """op.nmse_tol (2e-2 for Q4_0 weights, ~2.7x their mean quantization NMSE of ~7.4e-3 on
    Gaussian data; 1e-3 for Q8_0, 17-35x theirs) widened for small problems. Each output's
    quantization error is one draw of a sum of many block errors, so its square relative to the
    products' energy is chi-square with one degree of freedom: the NMSE of M*N outputs fluctuates
    by sqrt(2 / (M N)) of its mean whatever K is, and a single output exceeds 5x its mean 3% of the
    time (it made `1x1x4096` Q4_0 tests fail about once per GPU run). The 9 / sqrt(M N) term puts
    a single Q4_0 output's bound at ~30x the mean (a chi-square(1) tail of ~1e-8); the K term
    covers problems of a few blocks. Wrong kernels are caught by the exact-math reference
    (rel <= op.exact_tol: 1e-5 for the int8 / DP4A ops, 2e-5 for the FFMA ones, 5e-5 for the fp16
    tensor-core ones), this check only bounds the quantization level."""
    m, n, k = shape
    return op.nmse_tol * (1.0 + 8.0 / np.sqrt(max(m * n * k / F.QK, 1.0)) + 9.0 / np.sqrt(max(m * n, 1)))


def compare(name: str, op: Op, shape, seed, out: np.ndarray, exact: np.ndarray, truth: np.ndarray,
            a_float: np.ndarray, w_float: np.ndarray) -> Result:
    """Score a kernel output against both references (see the module docstring)."""
    unwritten = int(np.isnan(out).sum())
    finite = np.nan_to_num(out.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    energy = max(product_energy(a_float, w_float), np.finfo(np.float64).tiny)
    max_abs = float(np.max(np.abs(finite - exact)))
    rel = float(np.sqrt(np.sum((finite - exact) ** 2) / energy))
    nm = float(np.sum((finite - truth) ** 2) / energy)
    nm_tol = nmse_tolerance(op, shape)
    passed = unwritten == 0 and bool(np.isfinite(out).all()) and rel <= op.exact_tol and nm <= nm_tol
    note = []
    if unwritten:
        note.append(f"{unwritten} outputs never written")
    if rel > op.exact_tol:
        note.append(f"rel err {rel:.2e} > {op.exact_tol:.0e}")
    if nm > nm_tol:
        note.append(f"NMSE {nm:.2e} > {nm_tol:.1e}")
    return Result(name, tuple(shape), seed, bool(passed), max_abs, rel, nm, unwritten, op.exact_tol, nm_tol, "; ".join(note),
                  detail={"classic_nmse": F.nmse(finite, truth), "classic_rel_err": reference.relative_error(finite, exact)})


def block_breakdown(kernel: Kernel, a: np.ndarray, w: np.ndarray, m: int = 0, n: int = 0, max_blocks: int = 16) -> list[dict]:
    """Per-block view of output C[m, n], kernel beside reference: the debugging method of the
    seeds (start at 1x1x32, compute by hand, compare one block at a time).

    The kernel's share of block b is measured by running it on that block alone (a 1x1x32
    problem); for the integer ops the sumi the kernel must have used is recovered from it:
        W4A8: sumi = (value / d_w + 8 s_a) / d_a        W8A8: sumi = value / (d_w d_a)
    """
    op = kernel.op
    rows = []
    nb = w.shape[1] if op.w.quantized else w.shape[1] // F.QK
    for b in range(min(nb, max_blocks)):
        a_b = np.ascontiguousarray(a[m:m + 1, b:b + 1] if op.a.quantized else a[m:m + 1, b * F.QK:(b + 1) * F.QK])
        w_b = np.ascontiguousarray(w[n:n + 1, b:b + 1] if op.w.quantized else w[n:n + 1, b * F.QK:(b + 1) * F.QK])
        got = float(kernel(a_b, w_b)[0, 0])
        ref = float(op.exact(a_b, w_b)[0, 0])
        row = {"block": b, "kernel": got, "reference": ref}
        if op.a.name == "q8_1":
            ab = F.as_blocks(a_b, F.Q8_1)[0, 0]
            w_blocks = F.as_blocks(w_b, op.w)  # [1, 1]
            wb = w_blocks[0, 0]
            d_a, s_a, d_w = float(ab["d"]), float(ab["s"]), float(wb["d"])
            q_w = F.unpack_q4_0(w_blocks)[0] if op.w.name == "q4_0" else wb["qs"]  # stored values, element order
            sumi = int(np.dot(ab["qs"].astype(np.int64), q_w.astype(np.int64)))
            if op.w.name == "q4_0":
                k_sumi = (got / d_w + 8 * s_a) / d_a if d_w and d_a else float("nan")
            else:
                k_sumi = got / (d_w * d_a) if d_w and d_a else float("nan")
            row.update(d_a=d_a, s_a=s_a, d_w=d_w, sumi=sumi, kernel_sumi=k_sumi)
        rows.append(row)
    return rows


def format_breakdown(name: str, rows: list[dict], m: int = 0, n: int = 0) -> str:
    lines = [f"{name}: C[{m},{n}] block by block (kernel run on each block alone vs the exact-math reference)"]
    if rows and "sumi" in rows[0]:
        lines.append(f"{'blk':>4} {'d_a':>11} {'s_a':>11} {'d_w':>11} {'sumi ref':>9} {'sumi kern':>10} "
                     f"{'value ref':>13} {'value kern':>13}  ok")
        for r in rows:
            ok = abs(r["kernel"] - r["reference"]) <= 1e-5 * max(1.0, abs(r["reference"]))
            lines.append(f"{r['block']:>4} {r['d_a']:>11.5g} {r['s_a']:>11.5g} {r['d_w']:>11.5g} {r['sumi']:>9d} "
                         f"{r['kernel_sumi']:>10.2f} {r['reference']:>13.6g} {r['kernel']:>13.6g}  {'yes' if ok else 'NO'}")
    else:
        lines.append(f"{'blk':>4} {'value ref':>13} {'value kern':>13}  ok")
        for r in rows:
            ok = abs(r["kernel"] - r["reference"]) <= 1e-5 * max(1.0, abs(r["reference"]))
            lines.append(f"{r['block']:>4} {r['reference']:>13.6g} {r['kernel']:>13.6g}  {'yes' if ok else 'NO'}")
    return "\n".join(lines)
