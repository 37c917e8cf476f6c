#!/usr/bin/env python3
"""What an int8 tensor-core prefill path that folds its int32 sums into float only every G values
of K would cost in accuracy, against llama.cpp's own op (issue #4's rule: within its accuracy).

An int8 MMA needs one scale per operand row across the K it sums: llama.cpp's Q8_1 activations
and Q4_0 / Q8_0 weights carry one per 32, so every 32-wide block's int32 result must be folded
into float (convert, scale, add per output: ~3.4x the MMA time, docs/perf/NOTES.md session 34).
Folding every G = 64 or 128 instead needs scales shared over G: the activations quantized to int8
per G (not per 32), and the weights requantized to int8 per G -- their exact Q4_0 / Q8_0 values
do not fit one int8 grid per 128. This measures the relative Frobenius error of both against
the float64 product of the float activations and the *dequantized* weights (the weights as the
user holds them), next to llama.cpp's (Q8_1 activations x the exact weights), on Gaussian data
and on activations with a few outlier channels (x30, as LLM activations have).

    python tools/fold_error.py --m 64 --n 512 --k 4096
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import qgemm.formats as F


def int8_per_group(a: np.ndarray, g: int) -> np.ndarray:
    """a [R, K] quantized to int8 with one max/127 scale per g values along K, dequantized (float64)."""
    r, k = a.shape
    b = a.astype(np.float64).reshape(r, k // g, g)
    d = np.abs(b).max(axis=-1, keepdims=True) / 127
    q = np.round(b / np.where(d == 0, 1, d))
    return (q * d).reshape(r, k)


def rel(c: np.ndarray, truth: np.ndarray) -> float:
    return float(np.linalg.norm(c - truth) / np.linalg.norm(truth))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--groups", default="32,64,128", help="fold widths G (multiples of 32, dividing K)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        groups = [int(g) for g in args.groups.split(",")]
    except ValueError:
        ap.error(f"--groups must be comma-separated integers, got {args.groups!r}")
    if min(args.m, args.n, args.k) < 1 or args.k % 32 or any(g < 32 or g % 32 or args.k % g for g in groups):
        ap.error("--m, --n >= 1; --k a positive multiple of 32; every G a multiple of 32 dividing K")
    if args.seed < 0:  # numpy's generator refuses it, but only as a traceback
        ap.error(f"--seed must be >= 0, got {args.seed}")
    rng = np.random.default_rng(args.seed)
    print(f"M={args.m} N={args.n} K={args.k}: relative error against x . dequant(W)^T in float64")
    print("activations  weights  G    llama.cpp (Q8_1 x W)  int8 per G (x and W)  ratio")
    for outliers in (False, True):
        x = rng.standard_normal((args.m, args.k), dtype=np.float32)
        if outliers:
            x[:, rng.choice(args.k, 8, replace=False)] *= 30
        for fmt in ("q4_0", "q8_0"):
            wd = F.dequantize(F.quantize(rng.standard_normal((args.n, args.k), dtype=np.float32), fmt), fmt).astype(np.float64)
            truth = x.astype(np.float64) @ wd.T
            llama = rel(F.dequantize_q8_1(F.quantize_q8_1(x)).astype(np.float64) @ wd.T, truth)
            for g in groups:
                e = rel(int8_per_group(x, g) @ int8_per_group(wd, g).T, truth)
                print(f"{'outliers' if outliers else 'Gaussian':11}  {fmt:7}  {g:<4} {llama:20.3e}  {e:20.3e}  {e / llama:5.2f}")
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "fold_error"))
