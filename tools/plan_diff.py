#!/usr/bin/env python3
"""Which shapes a change to the dispatch or the default configurations moves: `qgemm.plan` (the
kernel and its #defines, untuned, for `--arch` with 132 SMs, as `qgemm.plan(arch=...)` plans) over a
grid of shapes for two source trees, and the shapes whose plans differ, grouped into runs of M. No
GPU needed.

    git archive HEAD | (mkdir -p /tmp/old && tar -x -C /tmp/old)     # the tree before the change
    python3 tools/plan_diff.py --old /tmp/old                        # N, K: the issue's and a model's
    python3 tools/plan_diff.py --old /tmp/old --m 1-64 --n 4096,6144 --k 14336 --fmts q4_0 --x-dtypes f32

Each line of the result is one (N, K, format, weights, activation type) and a run of M (neighbours
in the grid) whose plans changed alike, with the kernel and the #defines that differ, before ->
after. A rule meant to fire only off the bench's grid can be checked here before any GPU time: an
empty diff at the bench's rows means its published figures stand. Sessions 51 and 52 ran this
comparison by hand over 300,000 shapes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

if sys.argv[1:2] != ["--dump-worker"]:  # a worker plans with the qgemm of the tree on its PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DEFAULT_N = "512,1024,2048,3072,4096,5120,6144,8192,11008,14336,28672"
DEFAULT_K = "4096,8192,11008,14336"


def _ints(text: str, what: str) -> list[int]:
    """'1,2,8' or '65-128' (inclusive) or a mix -> sorted distinct positive integers."""
    out = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"{what} takes positive integers and ranges A-B separated by commas, got {text!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"{what} takes positive integers and ranges A-B separated by commas, got {text!r}")
    return sorted(out)


def dump(grid: dict) -> dict:
    """Every plan of the grid in this process's qgemm: "MxNxK fmt packed|blocks x_dtype" -> [kernel, defines].
    A shape this tree refuses (a K it does not take) maps to the refusal, so refusing is a change too."""
    import qgemm

    out = {}
    for n in grid["n"]:
        for k in grid["k"]:
            for fmt in grid["fmts"]:
                for m in grid["m"]:
                    for packed in (True, False):
                        for xd in grid["x_dtypes"]:
                            key = f"{m}x{n}x{k} {fmt} {'packed' if packed else 'blocks'} {xd}"
                            try:
                                p = qgemm.plan(m, n, k, fmt, packed=packed, x_dtype=xd, arch=grid["arch"])
                                out[key] = [p.kernel, dict(p.defines)]
                            except ValueError as e:
                                out[key] = [f"refused: {str(e).splitlines()[0]}", {}]
    return out


def _dump_trees(trees: list[str], grid: dict) -> list[dict]:
    """`dump` for each tree, side by side, each in a fresh Python whose qgemm is the tree's own."""
    for tree in trees:
        if not os.path.isfile(os.path.join(tree, "qgemm", "__init__.py")):
            raise ValueError(f"{tree} holds no qgemm package (expected {os.path.join(tree, 'qgemm', '__init__.py')})")
    with tempfile.TemporaryDirectory() as d:
        spec = os.path.join(d, "grid.json")
        with open(spec, "w") as f:
            json.dump(grid, f)
        jobs = []
        for i, tree in enumerate(trees):
            res = os.path.join(d, f"plans{i}.json")
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            jobs.append((tree, res, subprocess.Popen([sys.executable, os.path.abspath(__file__), "--dump-worker", spec, res],
                                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
        out = []
        for tree, res, proc in jobs:
            _, err = proc.communicate()
            if proc.returncode:
                raise ValueError(f"planning with the tree {tree} failed:\n{err.strip()[-2000:]}")
            with open(res) as f:
                out.append(json.load(f))
        return out


def runs(changed: list[tuple[int, str]], ms: list[int]) -> list[tuple[int, int, int, str]]:
    """M that follow each other in the grid `ms` and change alike -> (first M, last M, how many, change)."""
    pos = {m: i for i, m in enumerate(ms)}
    out: list[tuple[int, int, int, str]] = []
    for m, what in sorted(changed, key=lambda t: pos[t[0]]):
        if out and out[-1][3] == what and pos[out[-1][1]] + 1 == pos[m]:
            out[-1] = (out[-1][0], m, out[-1][2] + 1, what)
        else:
            out.append((m, m, 1, what))
    return out


def change(before: list, after: list | None) -> str:
    """One plan's change in words: the kernel and the #defines that differ (all of them where the
    kernel differs), e.g. 'w4a16.wgmma_rs: RS_SPLITK 4 -> 2, RS_WGS 2 -> 1'."""
    if after is None:
        return f"{before[0]} -> (not planned)"
    (k0, d0), (k1, d1) = before, after
    if k0 != k1:
        full = lambda k, d: f"{k} {' '.join(f'{a}={b}' for a, b in sorted(d.items()))}".strip()  # noqa: E731
        return f"{full(k0, d0)} -> {full(k1, d1)}"
    keys = sorted(set(d0) | set(d1))
    return f"{k0}: " + ", ".join(f"{a} {d0.get(a, '-')} -> {d1.get(a, '-')}" for a in keys if d0.get(a) != d1.get(a))


def diff(old: dict, new: dict, ms: list[int]) -> list[str]:
    """The changed plans as lines: '(N, K, fmt, weights, x) M a-b: the change' per run of M."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for key in old:
        if old[key] == new.get(key):
            continue
        shape, fmt, weights, xd = key.split()
        m, n, k = (int(v) for v in shape.split("x"))
        groups.setdefault((n, k, fmt, weights, xd), []).append((m, change(old[key], new.get(key))))
    lines = []
    for g in sorted(groups):
        for a, b, count, what in runs(groups[g], ms):
            span = f"{a}" if a == b else f"{a}-{b}" if count == b - a + 1 else f"{a}-{b} ({count} of the grid's M)"
            lines.append(f"N={g[0]} K={g[1]} {g[2]} {g[3]} {g[4]}  M {span}: {what}")
    return lines


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--dump-worker":
        with open(sys.argv[2]) as f:
            grid = json.load(f)
        with open(sys.argv[3], "w") as f:  # (plan(arch=...): untuned defaults for 132 SMs, no GPU asked)
            json.dump(dump(grid), f)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the source tree before the change (holds qgemm/)")
    ap.add_argument("--new", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                    help="the tree after it (default: this one)")
    ap.add_argument("--m", default="1-128,129-4200:7",
                    help="token counts: A,B,C-D and C-D:STEP (default: 1-128 and every 7th to 4200)")
    ap.add_argument("--n", default=DEFAULT_N, help="weight widths (output features): A,B,C-D")
    ap.add_argument("--k", default=DEFAULT_K, help="reductions, multiples of 32: A,B,C-D")
    ap.add_argument("--fmts", default="q4_0,q8_0", help="weight formats: q4_0 and / or q8_0")
    ap.add_argument("--x-dtypes", default="f32,f16,bf16", help="activation types: f32, f16 and / or bf16")
    ap.add_argument("--arch", default="sm_90", help="the architecture planned for (sm_75 .. sm_90)")
    ap.add_argument("--json", default=None, help="also write {'changed': [...lines], 'plans': count} here")
    a = ap.parse_args()
    for opt, tree in (("--old", a.old), ("--new", a.new)):
        if not tree.strip():  # (os.path.join("", ...) is the current directory: a tree against itself, "no change")
            raise ValueError(f"{opt} is empty: give the source tree (a directory holding qgemm/)")
    if a.json is not None:
        from qgemm.errors import check_output_path

        check_output_path(a.json, "--json")
    ms: list[int] = []
    for part in a.m.split(","):
        if ":" in part:
            rng, step = part.split(":", 1)
            vals = _ints(rng, "--m")
            try:
                st = int(step)
            except ValueError:
                raise ValueError(f"--m: the step after ':' must be a positive integer, got {step!r}") from None
            if st < 1:
                raise ValueError(f"--m: the step after ':' must be a positive integer, got {step!r}")
            ms.extend(vals[::st])
        else:
            ms.extend(_ints(part, "--m"))
    ms = sorted(set(ms))
    fmts = [f.strip() for f in a.fmts.split(",")]
    if not fmts or any(f not in ("q4_0", "q8_0") for f in fmts):
        raise ValueError(f"--fmts takes q4_0 and / or q8_0, got {a.fmts!r}")
    xds = [x.strip() for x in a.x_dtypes.split(",")]
    if not xds or any(x not in ("f32", "f16", "bf16") for x in xds):
        raise ValueError(f"--x-dtypes takes f32, f16 and / or bf16, got {a.x_dtypes!r}")
    from qgemm import jit

    jit.check_arch_supported(jit.normalize_arch(a.arch))
    ks = _ints(a.k, "--k")
    if any(k % 32 for k in ks):
        raise ValueError(f"--k: K must be a multiple of 32 (the block size), got {a.k!r}")
    grid = {"m": ms, "n": _ints(a.n, "--n"), "k": ks, "fmts": fmts, "x_dtypes": xds, "arch": a.arch}
    old, new = _dump_trees([a.old, a.new], grid)
    lines = diff(old, new, ms)
    print(f"{sum(old[k] != new.get(k) for k in old)} of {len(old)} plans changed ({a.arch}, 132 SMs)")
    for line in lines:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"plans": len(old), "changed": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "plan_diff"))
