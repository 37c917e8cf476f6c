r"""Whole-op A/B of qgemm.matmul paths and activation types in one process (packed weights,
graph-batched as `qgemm bench`): each (path, activation type) measured `--repeats` times in
alternation, so that drift between the passes shows as the range of a cell.

    python tools/compare_paths.py --shapes 512x4096x4096,2048x4096x4096 \
        --paths default,w4a16.wgmma,w8a16.wgmma --json out.json
    python tools/compare_paths.py --shapes 1x4096x4096,1x4096x4096@cold,8x4096x4096 \
        --x-dtypes f32,f16,bf16 --paths default,blocks@f16 --markdown table.md

A path is `default` (the plan `matmul` makes), `blocks` (the same call on raw ggml blocks instead
of packed weights: what `qgemm bench` reports as "ggml blocks") or a registered kernel name, used
only for weights of its own format (w4a16.*, w4a8.* -> q4_0; w8a16.*, w8a8.* -> q8_0). `PATH@f16`
(or `@f32+bf16` ...) times that path with those activation types only; other paths take every type
of --x-dtypes. A shape `MxNxK@cold` is timed with weights and activations rotated through more
than twice the L2, as `qgemm bench`'s cold rows; plain shapes are hot. The kernel-alone time is
reported beside the whole op (they are equal for a path without prologue). --markdown writes one
table of whole-op times (min-max over the repeats) and one of the kernels each cell ran.

With float32 and a 16-bit type in one run, the markdown also lists the cells where the 16-bit
activations took longer than float32 on the same path and weights by more than --gap (default 4%,
by the minima over the repeats). Half the activation bytes should never be slower, so such a
cell points at a configuration (session 57 found four decode rules that way):

    python tools/compare_paths.py --shapes 1x14336x4096,16x6144x4096 --x-dtypes f32,f16 --markdown t.md
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

X_DTYPES = ("f32", "f16", "bf16")
X_NAMES = {"f32": "float32 x", "f16": "float16 x", "bf16": "bfloat16 x"}


def parse_shape(text: str) -> tuple[int, int, int, bool]:
    """`MxNxK` or `MxNxK@cold` -> (m, n, k, cold)."""
    body, _, tag = text.strip().lower().partition("@")
    if tag not in ("", "cold"):
        raise SystemExit(f"--shapes {text!r}: the only suffix is @cold")
    parts = body.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"--shapes {text!r}: expected MxNxK (positive integers), optionally @cold")
    m, n, k = (int(p) for p in parts)
    if k % 32:  # q4_0 and q8_0 blocks are 32 wide: caught here, not after the shapes before it were timed
        raise SystemExit(f"--shapes {text!r}: K must be a multiple of 32 (the q4_0 / q8_0 blocks), got K={k}")
    return m, n, k, tag == "cold"


def parse_paths(text: str, x_dtypes: list[str]) -> list[tuple[str, list[str]]]:
    """`default,blocks@f16,w4a16.wgmma` -> [(path, [x dtypes it is timed with]), ...]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        path, _, tags = item.partition("@")
        xds = [t for t in tags.split("+") if t] if tags else list(x_dtypes)
        bad = [t for t in xds if t not in X_DTYPES]
        if bad or not path:
            raise SystemExit(f"path {item!r}: expected PATH or PATH@TYPE[+TYPE...], TYPE one of {', '.join(X_DTYPES)}")
        out.append((path, xds))
    if not out:
        raise SystemExit("--paths: nothing to time")
    return out


def cell(values: list[float]) -> str:
    """Times of one cell over the repeats: `3.38` or `3.38-3.47`."""
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


def column(path: str, xd: str) -> str:
    what = "ggml blocks" if path == "blocks" else ("matmul" if path == "default" else f"`{path}`")
    return f"{what}, {X_NAMES[xd]}"


def type_gaps(rows: list[dict], gap: float = 0.04) -> list[str]:
    """Markdown lines for the cells where a 16-bit activation type took longer than float32 x on
    the same shape, format and path by more than `gap` (the minima over the repeats); [] where
    none did, or where no float32 cell was timed beside a 16-bit one."""
    best: dict[tuple, float] = {}
    for r in rows:
        key = (r["shape"], r["fmt"], r["path"], r["x_dtype_asked"])
        best[key] = min(best.get(key, float("inf")), r["matmul_us"])
    found = []
    for (shape, fmt, path, xd), t in best.items():
        t32 = best.get((shape, fmt, path, "f32"))
        if xd != "f32" and t32 is not None and t > t32 * (1 + gap):
            found.append(f"| {shape.replace('@cold', ' cold')} | {fmt} | {path} | {X_NAMES[xd]} | {t:.2f} | {t32:.2f} | "
                         f"{t / t32:.3f} |")
    if not found:
        return []
    return ["", f"16-bit activations slower than float32 x on the same weights by more than {gap:.0%} (minima):", "",
            "| MxNxK | type | path | x | µs | float32 x µs | ratio |", "|---|---|---|---|---:|---:|---:|", *found]


def markdown(rows: list[dict], env: dict, command: str, gap: float = 0.04) -> str:
    """The whole-op table (µs, min-max over the repeats), the cells where 16-bit x was slower than
    float32 x (`type_gaps`), and the kernels each cell ran."""
    cols = list(dict.fromkeys((r["path"], r["x_dtype_asked"]) for r in rows))
    keys = list(dict.fromkeys((r["shape"], r["fmt"]) for r in rows))
    by = {}
    for r in rows:
        by.setdefault((r["shape"], r["fmt"], r["path"], r["x_dtype_asked"]), []).append(r)
    head = "| MxNxK | type | " + " | ".join(column(p, x) + " µs" for p, x in cols) + " |"
    rule = "|---|---|" + "---:|" * len(cols)
    lines = [f"{env.get('device', '?')}, {env.get('date', '?')}, `{command}`", "", head, rule]
    kern = ["| MxNxK | type | " + " | ".join(column(p, x) for p, x in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for shape, fmt in keys:
        times, names = [], []
        for p, x in cols:
            rs = by.get((shape, fmt, p, x))
            times.append(cell([r["matmul_us"] for r in rs]) if rs else "-")
            names.append(" / ".join(f"`{k}`" for k in dict.fromkeys(r["kernels"] for r in rs)) if rs else "-")
        label = shape.replace("@cold", " cold")
        lines.append(f"| {label} | {fmt} | " + " | ".join(times) + " |")
        kern.append(f"| {label} | {fmt} | " + " | ".join(names) + " |")
    return "\n".join(lines + type_gaps(rows, gap) + ["", "Kernels run:", ""] + kern) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", required=True, help="comma-separated MxNxK, each optionally @cold")
    ap.add_argument("--paths", default="default", help="comma-separated: default, blocks and/or registered kernel "
                                                       "names, each optionally @TYPE[+TYPE...]")
    ap.add_argument("--x-dtypes", default="f32", help="comma-separated activation types: f32, f16, bf16")
    ap.add_argument("--fmts", default="q4_0,q8_0")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None, help="write the tables here")
    ap.add_argument("--gap", type=float, default=0.04,
                    help="list the cells where 16-bit x is slower than float32 x by more than this fraction")
    a = ap.parse_args(argv)
    x_dtypes = [x.strip() for x in a.x_dtypes.split(",") if x.strip()]
    if not x_dtypes or any(x not in X_DTYPES for x in x_dtypes):
        raise SystemExit(f"--x-dtypes {a.x_dtypes!r}: expected a comma-separated list of {', '.join(X_DTYPES)}")
    paths = parse_paths(a.paths, x_dtypes)
    shapes = [(s.strip(), parse_shape(s)) for s in a.shapes.split(",") if s.strip()]
    if not shapes:
        raise SystemExit(f"--shapes {a.shapes!r}: expected a comma-separated list of MxNxK; nothing to time")
    command = "python tools/compare_paths.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.repeats < 1 or a.iters < 1:
        raise SystemExit(f"--repeats and --iters must be at least 1, got {a.repeats} and {a.iters}")
    if not 0 <= a.gap < 10:
        raise SystemExit(f"--gap must be a fraction in [0, 10), e.g. 0.04 for 4%, got {a.gap}")
    from qgemm import bench, formats as F, registry
    from qgemm.errors import check_output_path

    for what, out in (("--json", a.json), ("--markdown", a.markdown)):  # before the timings, not after them
        if out:
            check_output_path(out, what)

    fmts = [f.strip() for f in a.fmts.split(",") if f.strip()]
    if not fmts or any(f not in ("q4_0", "q8_0") for f in fmts):
        raise SystemExit(f"--fmts {a.fmts!r}: expected a comma-separated list of q4_0, q8_0")
    for p, _ in paths:  # a kernel path must be a GEMM of one of the formats, or nothing is timed for it
        if p not in ("default", "blocks"):
            spec = registry.spec(p)
            if spec.op.kind != "gemm" or spec.op.w is None or spec.op.w.name not in fmts:
                raise SystemExit(f"--paths {p}: not a GEMM on {' or '.join(fmts)} weights (its op: {spec.op}); "
                                 "it would time nothing")

    rng = np.random.default_rng(0)
    rows = []
    env = bench.environment()
    print(f"device: {env['device']}; whole op (us), median of {a.iters} graph-batched samples; {env['date']}")
    weights = {}
    for shape, (m, n, k, cold) in shapes:
        for fmt in fmts:
            if (fmt, n, k) not in weights:
                weights[(fmt, n, k)] = F.quantize(rng.standard_normal((n, k), dtype=np.float32), fmt)
            mine = [(p, xds) for p, xds in paths if p in ("default", "blocks") or registry.spec(p).op.w.name == fmt]
            for rep in range(a.repeats):
                for p, xds in mine:
                    for xd in xds:
                        r = bench.time_matmul(fmt, m, n, k, cold, rng, weights, iters=a.iters, x_dtype=xd,
                                              path=None if p in ("default", "blocks") else p, packed=p != "blocks")
                        kernels = " + ".join(filter(None, (r.get("repack"), r.get("quantizer"), r["kernel"])))
                        r.update(path=p, repeat=rep, shape=shape, x_dtype_asked=xd, kernels=kernels)
                        rows.append(r)
                        cfg = " ".join(f"{key}={v}" for key, v in (r["config"] or {}).items())
                        print(f"{shape:>18} {fmt} {p:>22} {xd:>4} -> {kernels:<34} whole {r['matmul_us']:8.2f}  "
                              f"kernel {r['kernel_us']:8.2f}  [{cfg}]", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": env, "command": command, "rows": rows}, f, indent=1, default=str)
    if a.markdown:
        text = markdown(rows, env, command, a.gap)
        with open(a.markdown, "w") as f:
            f.write(text)
        print(text)
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "compare_paths"))
