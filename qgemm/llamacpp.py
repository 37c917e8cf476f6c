"""Side by side with llama.cpp: run (or read the saved output of) ggml's
`test-backend-ops perf -o MUL_MAT`, parse its lines, time qgemm on the same shapes and types.

qgemm does not build llama.cpp: point it at a `test-backend-ops` binary you built
(cmake -B build -DGGML_CUDA=ON && cmake --build build --target test-backend-ops).

A perf line (ggml's console printer; the rate is wrapped in ANSI colour codes on a terminal):

    MUL_MAT(type_a=q4_0,type_b=f32,m=4096,n=512,k=14336,bs=[1,1],nr=[1,1],...):  3198 runs -  312.80 us/run -  60.13 GFLOP/run - 192.23 TFLOPS

ggml's src0 (type_a) is the weight matrix, so ggml's m, n, k are qgemm's **N, M, K**:
C[M,N] = A[M,K] . W[N,K]^T with M = n (tokens), N = m (output features). The time is the whole
op: for quantized weights it includes quantizing the float32 activations (to Q8_1) on the GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .errors import QgemmError

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PERF = re.compile(
    r"^\s*(?P<op>MUL_MAT)\((?P<params>.*)\):\s+(?P<runs>\d+)\s+runs\s+-\s+(?P<us>[\d.]+)\s+us/run\s+-\s+"
    r"(?:(?P<flop>[\d.]+)\s+(?P<flop_unit>[kKMGTP]?)FLOP/run\s+-\s+(?P<rate>[\d.]+)\s+(?P<rate_unit>[kKMGTP]?)FLOPS"
    r"|(?P<kb>\d+)\s+kB/run\s+-\s+(?P<gbs>[\d.]+)\s+GB/s)\s*$"
)
_PARAM = re.compile(r"(\w+)=(\[[^\]]*\]|[^,]*)")
_BACKEND = re.compile(r"^Backend \d+/\d+:\s*(?P<name>\S+)")
_DESCRIPTION = re.compile(r"^\s*Device description:\s*(?P<name>.+?)\s*$")
_DEVICE0 = re.compile(r"^\s*Device (?P<i>\d+):\s*(?P<name>[^,]+)")
_SCALE = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def _param_value(v: str):
    v = v.strip()
    if re.fullmatch(r"-?\d+", v):
        return int(v)
    if v.startswith("[") and v.endswith("]"):
        items = [s.strip() for s in v[1:-1].split(",") if s.strip()]
        return [int(s) if re.fullmatch(r"-?\d+", s) else s for s in items]
    return v


def parse_test_backend_ops(text: str) -> list[dict]:
    """Parse `test-backend-ops perf -o MUL_MAT` output into one dict per timed MUL_MAT line:

        type    ggml type of the weights (type_a): "q4_0", "q8_0", "f16", ...
        type_b  ggml type of the activations (src1), "f32" in the standard cases
        M, N, K qgemm's shape (M = ggml n, N = ggml m, K = ggml k)
        us      microseconds per run; runs: how many runs were averaged
        tflops  the line's rate in TFLOPS (None on a line that reports GB/s instead)
        device  the GPU's name ('Device description:' of the current backend, else 'Device 0:')
        backend ggml backend name ("CUDA0"), or None before any 'Backend i/n:' header
        batched True when the line is not one plain GEMM: bs or nr not [1,1] (a batch of matrices),
                o > 1 (o matmuls summed in one graph), per not [0,1,2,3] or k_v > 0 (permuted or
                strided operands)
        params  every key=value of the line; raw: the line itself (ANSI codes removed)

    Lines that are not timed MUL_MAT results (headers, 'not supported', other ops) are skipped; a
    timed MUL_MAT line whose m, n, k, time or rate do not parse is a ValueError naming the line.
    """
    rows: list[dict] = []
    backend = None
    description = None
    device0 = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = _ANSI.sub("", raw).rstrip()
        if m := _BACKEND.match(line):
            backend, description = m["name"], None
            continue
        if m := _DESCRIPTION.match(line):
            description = m["name"]
            continue
        if (m := _DEVICE0.match(line)) and device0 is None and m["i"] == "0":
            device0 = m["name"].strip()
            continue
        m = _PERF.match(line)
        if not m:
            continue
        params = {k: _param_value(v) for k, v in _PARAM.findall(m["params"])}
        missing = [k for k in ("type_a", "m", "n", "k") if k not in params]
        if missing:
            continue  # a MUL_MAT line of another printer layout: nothing to compare with
        try:  # a timed MUL_MAT line whose numbers do not parse is a damaged file, said with its line
            rate = float(m["rate"]) * _SCALE[m["rate_unit"]] / 1e12 if m["rate"] else None
            mnk = {key: int(params[key]) for key in ("m", "n", "k")}
            if min(mnk.values()) <= 0:
                raise ValueError("m, n and k must be positive")
            us, runs = float(m["us"]), int(m["runs"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"line {lineno}: a MUL_MAT result whose numbers do not parse ({e}): {line.strip()}") from None
        rows.append({
            "type": str(params["type_a"]),
            "type_b": str(params.get("type_b", "f32")),
            "M": mnk["n"],
            "N": mnk["m"],
            "K": mnk["k"],
            "us": us,
            "runs": runs,
            "tflops": rate,
            "device": description or device0,
            "backend": backend,
            "batched": (params.get("bs", [1, 1]) != [1, 1] or params.get("nr", [1, 1]) != [1, 1]
                        or params.get("o", 1) != 1 or params.get("per", [0, 1, 2, 3]) != [0, 1, 2, 3]
                        or params.get("k_v", 0) != 0),
            "params": params,
            "raw": line.strip(),
        })
    return rows


def run_test_backend_ops(path: str | os.PathLike, timeout: float = 600.0, extra_args: Iterable[str] = ()) -> str:
    """Run the user's `test-backend-ops perf -o MUL_MAT` and return its stdout.

    FileNotFoundError if the path does not exist, PermissionError if it is not an executable file,
    RuntimeError (with the tail of stderr) if it exits non-zero or runs past `timeout` seconds."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file; expected ggml's test-backend-ops binary "
                                "(llama.cpp: cmake --build build --target test-backend-ops -> build/bin/test-backend-ops)")
    if p.is_dir():
        cand = [c for c in (p / "test-backend-ops", p / "bin" / "test-backend-ops") if c.is_file()]
        hint = f"; did you mean {cand[0]}?" if cand else ""
        raise PermissionError(f"{p}: is a directory, expected the test-backend-ops binary{hint}")
    if not os.access(p, os.X_OK):
        raise PermissionError(f"{p}: not executable (chmod +x {p}?)")
    # the file checked above: a bare relative name ("./test-backend-ops" becomes "test-backend-ops")
    # would be looked up on PATH by subprocess, running another program or none
    cmd = [str(p if p.is_absolute() else p.absolute()), "perf", "-o", "MUL_MAT", *extra_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd)} ran past {timeout:g} s and was stopped") from e
    except OSError as e:  # e.g. not a binary for this machine (Exec format error)
        raise RuntimeError(f"could not run {' '.join(cmd)}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} exited with status {proc.returncode}; last lines of its output:\n{tail}")
    return proc.stdout


Timer = Callable[[str, int, int, int], float]


def row_note(r: dict) -> str:
    """Why a parsed row is not one qgemm.matmul compares with ("" for a plain GEMM of float32
    activations): batched or strided ops, other activation types."""
    if r["batched"]:
        return "batched or not a single plain GEMM (bs/nr != [1,1], o > 1, permuted or strided operands)"
    if r["type_b"] != "f32":
        return f"activations {r['type_b']}: qgemm compares f32 activations only"
    return ""


def compare(rows: list[dict], matmul_timer: Timer, types: Iterable[str] | None = None) -> list[dict]:
    """Time qgemm on every parsed row: returns copies of `rows` (those of `types`, when given) with
    `qgemm_us` (timer(type, M, N, K) in microseconds) and `ratio` = llama.cpp us / qgemm us
    (> 1: qgemm is faster). Batched rows, and rows whose timer raises, get qgemm_us = None and a
    `note` saying why; the other rows are still timed."""
    wanted = None if types is None else {t.lower() for t in types}
    out = []
    for r in rows:
        if wanted is not None and r["type"].lower() not in wanted:
            continue
        r = dict(r, qgemm_us=None, ratio=None, note=row_note(r))
        if not r["note"]:
            try:
                us = float(matmul_timer(r["type"], r["M"], r["N"], r["K"]))
            except (ValueError, NotImplementedError, RuntimeError, QgemmError) as e:
                r["note"] = f"qgemm: {e}"
            else:
                r["qgemm_us"] = us
                r["ratio"] = r["us"] / us if us > 0 else None
        out.append(r)
    return out


# ---------------------------------------------------------------------------------------------
# the qgemm side: time qgemm.matmul the way test-backend-ops times MUL_MAT


def _weights(fmt: str, n: int, k: int, rng) -> np.ndarray:
    from . import formats as F

    w = rng.standard_normal((n, k), dtype=np.float32)
    f = F.get_format(fmt)  # ValueError for types qgemm has no format for (q4_k, bf16, ...)
    if f.name == "f32":
        return w
    if f.name == "f16":
        return w.astype(np.float16)
    if f.name in ("q4_0", "q8_0"):
        return F.quantize(w, f)
    raise ValueError(f"{fmt} is not a weight format (expected q4_0, q8_0, f16 or f32)")


def matmul_timer(warmup: int = 5, iters: int = 20, seed: int = 0, sustain_s: float = 0.0) -> Timer:
    """A timer for compare() backed by `qgemm.matmul(A, W, out=C)` on device arrays: float32
    activations [M, K] x weights [N, K] of the row's type -> float32 [M, N], the whole op
    (activation quantization included) as test-backend-ops times MUL_MAT.

    Timed as `qgemm bench` times its rows (`qgemm.bench._time_launches`): B back-to-back matmul
    calls (B ~ 1 ms of GPU work) captured once as a CUDA graph and replayed between two CUDA
    events, so Python's per-call overhead is not in the figure (ggml's perf mode also times GPU
    work, not host launches); `iters` replays -- or, with sustain_s, replays back to back for at
    least that long, as test-backend-ops runs each op for >= 1 s -- and the median of replay
    time / B is returned, in microseconds."""
    import statistics

    import qgemm
    from . import bench, runtime

    matmul = getattr(qgemm, "matmul", None)
    if matmul is None:
        raise RuntimeError("qgemm.matmul is not available in this version")
    runtime.require_gpu("timing qgemm.matmul")
    rng = np.random.default_rng(seed)
    weights: dict[tuple[str, int, int], runtime.DeviceArray] = {}  # the figures reuse few (N, K)

    def timer(type_: str, m: int, n: int, k: int) -> float:
        w = weights.get((type_, n, k))
        if w is None:
            w = weights[(type_, n, k)] = runtime.DeviceArray.from_host(_weights(type_, n, k, rng))
        a = runtime.DeviceArray.from_host(rng.standard_normal((m, k), dtype=np.float32))
        c = runtime.DeviceArray.empty((m, n), np.float32)
        # warm-up calls compile and load before the capture (which takes scratch of its own)
        samples, _ = bench._time_launches(lambda i, stream=None: matmul(a, w, out=c, stream=stream), 1, warmup, iters,
                                          sustain_s)
        return statistics.median(samples)

    return timer
