"""Whole-op A/B of qgemm.matmul paths in one process (hot, packed weights, graph-batched as
`qgemm bench`): the default plan against `path=` overrides, each measured twice in alternation
so that drift between the first and the second pass shows.

    python tools/compare_paths.py --shapes 512x4096x4096,2048x4096x4096 \
        --paths default,w4a16.wgmma,w8a16.wgmma --json out.json

A path is used only for weights of its own format (w4a16.*, w4a8.* -> q4_0; w8a16.*, w8a8.* -> q8_0); the
kernel-alone time is reported beside the whole op (they are equal for a path without prologue).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", required=True, help="comma-separated MxNxK")
    ap.add_argument("--paths", default="default", help="comma-separated: default and/or registered kernel names")
    ap.add_argument("--fmts", default="q4_0,q8_0")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from qgemm import bench, formats as F, registry, runtime

    rng = np.random.default_rng(0)
    rows = []
    info = runtime.device_info()
    print(f"device: {info.name}; hot, whole op (us), median of {a.iters} graph-batched samples")
    for shape in a.shapes.split(","):
        m, n, k = (int(v) for v in shape.lower().split("x"))
        for fmt in a.fmts.split(","):
            weights = {(fmt, n, k): F.quantize(rng.standard_normal((n, k), dtype=np.float32), fmt)}
            paths = [p for p in a.paths.split(",") if p == "default" or registry.spec(p).op.w.name == fmt]
            for rep in range(a.repeats):
                for p in paths:
                    r = bench.time_matmul(fmt, m, n, k, False, rng, weights, iters=a.iters,
                                          path=None if p == "default" else p)
                    r.update(path=p, repeat=rep)
                    rows.append(r)
                    cfg = " ".join(f"{key}={v}" for key, v in (r["config"] or {}).items())
                    print(f"{shape:>16} {fmt} {p:>26} -> {r['kernel']:<24} whole {r['matmul_us']:8.2f}  "
                          f"kernel {r['kernel_us']:8.2f}  [{cfg}]", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": info.name, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
