"""`qgemm tutorial 1..5`: the seeds' five steps, measured live on this machine.

Each step prints what the tutorial shows, computed now: no number here is written in. Steps (or
parts of steps) that need a GPU say so when there is none, and the rest still runs.
"""

from __future__ import annotations

import re
import time
from importlib import resources
from typing import Callable

import numpy as np

from . import formats as F
from . import reference, registry, runtime

Echo = Callable[[str], None]


def _gpu(echo: Echo) -> bool:
    if runtime.gpu_available():
        return True
    echo(f"  [needs a GPU: {runtime.gpu_unavailable_reason()}; skipped]")
    return False


def _time_kernel(name: str, shape, iters: int = 20) -> float:
    from .bench import profile

    return profile(registry.get(name), shape, warmup=3, iters=iters).median_us


def _ladder(echo: Echo, names: list[str], shape) -> None:
    m, n, k = shape
    flops = 2.0 * m * n * k
    base = None
    echo(f"  {'kernel':<18} {'median us':>11} {'TFLOPS':>8} {'speedup':>9}")
    for name in names:
        us = _time_kernel(name, shape)
        base = base or us
        echo(f"  {name:<18} {us:>11.1f} {flops / us / 1e6:>8.2f} {base / us:>8.1f}x")


def step1(echo: Echo, shape) -> None:
    m, n, k = shape
    echo(f"Step 1 - FP32 GEMM baseline, C[M,N] = A[M,K] . W[N,K]^T, M={m} N={n} K={k}")
    rng = np.random.default_rng()
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    t0 = time.perf_counter()
    c_cpu = a @ w.T
    cpu_s = time.perf_counter() - t0
    echo(f"  CPU (numpy float32 BLAS): {cpu_s * 1e3:.2f} ms, {2 * m * n * k / cpu_s / 1e12:.3f} TFLOPS")
    if not _gpu(echo):
        return
    for name in ("fp32.naive", "fp32.tiled"):
        c = registry.get(name)(a, w)
        err = float(np.max(np.abs(c - c_cpu)))
        echo(f"  {name}: max |GPU - CPU| = {err:.2e}")
    _ladder(echo, ["fp32.naive", "fp32.tiled"], shape)


def step2(echo: Echo, shape) -> None:
    m, n, k = shape
    echo("Step 2 - block quantization: Q4_0, Q8_0 (weights), Q8_1 (activations), 32 values per block")
    rng = np.random.default_rng()
    x = rng.standard_normal((min(m, 256), k), dtype=np.float32)
    for name, fmt in (("Q4_0", F.Q4_0), ("Q8_0", F.Q8_0), ("Q8_1", F.Q8_1)):
        deq = F.dequantize(F.quantize(x, fmt), fmt)
        echo(f"  {name}: NMSE {F.nmse(deq, x):.2e} on N(0,1) data; {fmt.dtype.itemsize} bytes / 32 values = "
             f"{fmt.bits_per_value():.2f} bits; {32 / fmt.bits_per_value():.2f}x smaller than float32, "
             f"{16 / fmt.bits_per_value():.2f}x than float16")
    q = F.quantize_q8_1(x[:1, :32])[0, 0]
    echo(f"  one Q8_1 block: d = {float(q['d']):.5f}, s = {float(q['s']):.4f} (sum of the floats: {float(x[0, :32].sum()):.4f}), "
         f"sum(q)*d = {float(q['qs'].astype(np.int64).sum() * q['d']):.4f}  <- Step 4 needs d*sum(q); s stands in for it")
    if runtime.gpu_available():
        got = registry.get("quantize.q8_1")(x)
        same = got.tobytes() == F.quantize_q8_1(x).tobytes()
        echo(f"  GPU quantize.q8_1 vs qgemm.quantize_q8_1: {'byte-identical' if same else 'DIFFERENT'} ({got.size} blocks)")


def step3(echo: Echo, shape) -> None:
    m, n, k = shape
    echo(f"Step 3 - W4A16: Q4_0 weights x float32 activations, unpacked on the fly, M={m} N={n} K={k}")
    rng = np.random.default_rng()
    a = rng.standard_normal((m, k), dtype=np.float32)
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    w = F.quantize_q4_0(w_f)
    truth = reference.truth(a, w_f)
    echo(f"  weights: {w_f.nbytes / 1e6:.1f} MB float32 -> {w.nbytes / 1e6:.1f} MB Q4_0 ({w_f.nbytes / w.nbytes:.2f}x smaller)")
    echo(f"  NMSE of the exact W4A16 result vs float64 truth: {F.nmse(reference.exact_w4a16(a, w), truth):.2e} (the Q4_0 error)")
    if not _gpu(echo):
        return
    for name in ("w4a16.naive", "w4a16.tiled"):
        echo(f"  {name}: NMSE vs truth {F.nmse(registry.get(name)(a, w), truth):.2e}")
    _ladder(echo, ["fp32.naive", "fp32.tiled", "w4a16.naive", "w4a16.tiled"], shape)


def ladder(op: str) -> list[str]:
    """The tutorial's kernels of an op: the Step 4 rungs (naive .. vec_dp4a), not the production
    kernels registered under the same op (mma, skinny_q8_1, gemv: Step 6, some for decode only)."""
    return [s.name for s in registry.list_kernels(op=op) if s.step <= 5]


def step4(echo: Echo, shape) -> None:
    m, n, k = shape
    echo(f"Step 4 - W4A8: Q8_1 activations x Q4_0 weights, integer dot products, M={m} N={n} K={k}")
    echo("  per block: sumi = sum q_a * q_w on the STORED nibbles (0..15); result = d_w * (d_a * sumi - 8 * s_a)")
    rng = np.random.default_rng()
    a_f = rng.standard_normal((m, k), dtype=np.float32)
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    a, w = F.quantize_q8_1(a_f), F.quantize_q4_0(w_f)
    truth = reference.truth(a_f, w_f)
    wrong = reference.exact_w4a8_uncompensated(a, w)
    right = reference.exact_w4a8(a, w)
    echo(f"  float64 truth:            C[0,0] = {truth[0, 0]:+.4f}")
    echo(f"  without compensation:     C[0,0] = {wrong[0, 0]:+.4f}   NMSE {F.nmse(wrong, truth):.2e}  (wrong: the -8 is missing)")
    echo(f"  with d_w(d_a sumi - 8 s_a): C[0,0] = {right[0, 0]:+.4f}   NMSE {F.nmse(right, truth):.2e}  (quantization error only)")
    if not _gpu(echo):
        return
    for name in ladder("w4a8"):
        c = registry.get(name)(a, w)
        echo(f"  {name:<16} rel err vs exact-math {reference.relative_error(c, right):.1e}, NMSE vs truth {F.nmse(c, truth):.2e}")
    echo("  the ladder (CUDA events, median, hot):")
    _ladder(echo, ladder("w4a8"), shape)
    echo("  W8A8 (Q8_1 x Q8_0, no offset: d_w * d_a * sumi):")
    _ladder(echo, ladder("w8a8"), shape)


_GGML_LINE = re.compile(r"MUL_MAT\(type_a=(\w+),type_b=f32,m=(\d+),n=(\d+),k=(\d+).*?([\d.]+) us/run")


def llamacpp_figures(device: str = "h100") -> list[dict]:
    """llama.cpp's MUL_MAT perf figures shipped in qgemm/data (ggml m,n,k = qgemm N,M,K)."""
    text = resources.files("qgemm").joinpath(f"data/ggml-test-backend-ops-perf-mul_mat-{device}.txt").read_text()
    out = []
    for t, gm, gn, gk, us in _GGML_LINE.findall(text):
        out.append({"type": t, "M": int(gn), "N": int(gm), "K": int(gk), "us": float(us)})
    return out


def step5(echo: Echo, shape) -> None:
    echo("Step 5 - llama.cpp compatibility")
    for f in (F.Q4_0, F.Q8_0, F.Q8_1):
        echo(f"  sizeof(block_{f.name}) = {f.dtype.itemsize} bytes (ggml: {dict(q4_0=18, q8_0=34, q8_1=36)[f.name]}), "
             f"fields {', '.join(f'{k}@{v[1]}' for k, v in f.dtype.fields.items())}")
    try:
        import gguf
        from gguf import GGMLQuantizationType as T

        rng = np.random.default_rng()
        x = rng.standard_normal((64, 4096), dtype=np.float32)
        for name, t in (("q4_0", T.Q4_0), ("q8_0", T.Q8_0)):
            same = np.array_equal(F.quantize(x, name).view(np.uint8).reshape(64, -1), gguf.quants.quantize(x, t))
            echo(f"  quantize_{name} vs gguf.quants.quantize: {'byte-identical' if same else 'DIFFERENT'}")
    except ImportError:
        echo("  (install gguf to compare the quantizers byte for byte with ggml's own Python package)")
    echo("  vec_dot: llama.cpp's vec_dot_q4_0_q8_1 computes d_w * (d_a * sumi - 8 * s_a) per block, split over lanes;")
    echo("  qgemm's kernels compute the same formula. Differences are float rounding only:")
    if _gpu(echo):
        from .dispatch import plan
        from .llamacpp import matmul_timer

        rng = np.random.default_rng()
        a = F.quantize_q8_1(rng.standard_normal((64, 4096), dtype=np.float32))
        w = F.quantize_q4_0(rng.standard_normal((256, 4096), dtype=np.float32))
        ref = reference.exact_w4a8(a, w)
        for name in ladder("w4a8"):
            c = registry.get(name)(a, w)
            echo(f"    {name:<16} max |kernel - exact| = {np.max(np.abs(c - ref)):.2e} (|C| ~ {np.sqrt(np.mean(ref ** 2)):.0f})")
        info = runtime.device_info()
        dev = "h200" if "H200" in info.name else "h100"
        figs = [f for f in llamacpp_figures(dev) if f["type"] in ("q4_0", "q8_0")]
        echo(f"  llama.cpp MMQ (whole op incl. activation quantization) on {dev.upper()} "
             f"(qgemm/data/ggml-test-backend-ops-perf-mul_mat-{dev}.txt) against this GPU ({info.name}): the fastest")
        echo("  Step 4 rung (DP4A) + quantize.q8_1, and qgemm.matmul -- the production kernels (tensor cores), on the same")
        echo("  ggml blocks, as the same kind of measurement (whole op, hot, back to back) but in ~1 ms samples where")
        echo("  llama.cpp runs >= 1 s (qgemm compare-llamacpp --sustain 1 times it that way)")
        best = {"q4_0": ["w4a8.vec_dp4a", "w4a8.tiled_dp4a"], "q8_0": ["w8a8.tiled_dp4a"]}
        timer = matmul_timer(warmup=3, iters=10)
        echo(f"  {'type':<5} {'MxNxK':<15} {'llama.cpp us':>12} {'Step 4 us':>10} {'(rung + quantize)':>18} "
             f"{'matmul us':>10} {'llama.cpp / matmul':>19}  matmul's GEMM kernel")
        for f in figs:
            if f["M"] < 64:
                continue
            shp = (f["M"], f["N"], f["K"])
            kern = min(_time_kernel(nm, shp, iters=10) for nm in best[f["type"]])
            quant = _time_kernel("quantize.q8_1", shp, iters=10)
            op = timer(f["type"], *shp)
            echo(f"  {f['type']:<5} {'x'.join(map(str, shp)):<15} {f['us']:>12.1f} {kern + quant:>10.1f} "
                 f"{'(' + f'{kern:.1f} + {quant:.1f}' + ')':>18} {op:>10.1f} {f['us'] / op:>18.2f}x  "
                 f"{plan(*shp, f['type']).kernel}")
        echo("  (matmul repacks ggml blocks on every call where that pays; weights packed once by qgemm.pack_weights")
        echo("  are faster still: qgemm bench, docs/performance.md)")


STEPS = {1: step1, 2: step2, 3: step3, 4: step4, 5: step5}
DEFAULT_SHAPE = (512, 4096, 4096)


def run(step: int, echo: Echo = print, shape=DEFAULT_SHAPE) -> None:
    if step not in STEPS:
        raise ValueError(f"tutorial step must be one of {sorted(STEPS)}, got {step}")
    STEPS[step](echo, shape)
