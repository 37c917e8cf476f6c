"""A/B probe: whole-op and kernel-alone medians (hot, graph-batched as `qgemm bench`) for a few
shapes, PDL on and off alternating in one process (QGEMM_PDL). Run once per source variant
(QGEMM_CUDA_SRC) to compare kernel-side changes. Prints one line per (shape, pdl, rep).

    python tools/pdl_probe.py [MxNxK:FMT[,MxNxK:FMT...]]     # e.g. 8x4096x4096:q8_0; REPS=3 repetitions
"""
import os
import sys

import numpy as np

from qgemm import bench, formats as F
from qgemm.check import parse_shape

DEFAULT = "1x4096x4096:q4_0,1x4096x4096:q8_0,8x4096x4096:q4_0,8x4096x14336:q8_0,64x4096x4096:q4_0,64x4096x14336:q4_0,512x4096x4096:q4_0"


def main() -> int:
    if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and (sys.argv[1].startswith("-") or ":" not in sys.argv[1])):
        print(__doc__.strip() + "\n\n(the argument is a comma-separated list of MxNxK:FMT, FMT q4_0 or q8_0)", file=sys.stderr)
        return 2
    shapes = []
    for item in (sys.argv[1] if len(sys.argv) > 1 else DEFAULT).split(","):
        shape, _, fmt = item.partition(":")
        if fmt not in ("q4_0", "q8_0"):
            raise ValueError(f"{item!r}: the format after ':' must be q4_0 or q8_0, got {fmt!r}")
        m, n, k = parse_shape(shape)
        if k % 32:  # the q4_0 / q8_0 blocks: refused before the shapes ahead of it are timed
            raise ValueError(f"{item!r}: K must be a multiple of 32 (the q4_0 / q8_0 blocks), got K={k}")
        shapes.append((m, n, k, fmt))
    reps = os.environ.get("REPS", "3")
    if not reps.strip().isdigit() or int(reps) < 1:  # REPS=0 would time nothing and exit 0
        raise ValueError(f"REPS must be a positive integer (repetitions per shape), got {reps!r}")
    reps = int(reps)
    rng = np.random.default_rng(0)
    weights = {}
    tag = os.environ.get("TAG", "")
    for m, n, k, fmt in shapes:
        if (fmt, n, k) not in weights:
            weights[(fmt, n, k)] = F.quantize(rng.standard_normal((n, k), dtype=np.float32), fmt)
        for rep in range(reps):
            for pdl in ("1", "0"):
                os.environ["QGEMM_PDL"] = pdl
                r = bench.time_matmul(fmt, m, n, k, False, rng, weights, iters=20)
                print(f"{tag:8s} {fmt} {m}x{n}x{k} pdl={pdl} rep={rep} op={r['matmul_us']:.2f} kernel={r['kernel_us']:.2f} "
                      f"{r['kernel']} [{r['method'][:60]}]", flush=True)
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "pdl_probe"))
