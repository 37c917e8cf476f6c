#!/usr/bin/env python3
"""Measure quantization error (NMSE) of the block formats on random data, and compare ggml's Q4_0
quantizer with the simplified one in the tutorial seeds (d = amax / 7, q = round(x/d) + 8).
The numbers in docs/formats.md come from this script:

    python tools/quant_error.py --rows 1024 --k 4096 --seed 0
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import qgemm.formats as F


def seed_style_q4_0(x: np.ndarray) -> np.ndarray:
    """The seeds' simplified Q4_0 (NOT ggml's): d = amax/7, q = clamp(roundf(x/d) + 8, 0, 15).
    Returns the dequantized values. Kept here only to measure the difference."""
    b = x.reshape(-1, F.QK).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = (amax / np.float32(7)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(7) / amax, 0).astype(np.float32)
    q = np.clip(np.sign(b * inv) * np.floor(np.abs(b * inv) + 0.5) + 8, 0, 15)
    return ((q - 8) * d).reshape(x.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # before the tables: --k 100 failed in the first quantizer, under a header already printed
    if args.rows < 1:
        ap.error(f"--rows must be at least 1, got {args.rows}")
    if args.k < 1 or args.k % F.QK:
        ap.error(f"--k must be a positive multiple of {F.QK} (one block), got {args.k}")
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    rng = np.random.default_rng(args.seed)
    data = {
        "gaussian N(0,1)": rng.standard_normal((args.rows, args.k), dtype=np.float32),
        "uniform U(-1,1)": rng.uniform(-1, 1, (args.rows, args.k)).astype(np.float32),
    }
    print(f"NMSE of one quantize/dequantize round trip, {args.rows}x{args.k} values, seed {args.seed}\n")
    print("| data | Q4_0 (ggml, d = max/-8) | Q4_0 (seeds, d = amax/7) | Q8_0 | Q8_1 |")
    print("|---|---:|---:|---:|---:|")
    for name, x in data.items():
        r = [F.nmse(F.dequantize_q4_0(F.quantize_q4_0(x)), x), F.nmse(seed_style_q4_0(x), x),
             F.nmse(F.dequantize_q8_0(F.quantize_q8_0(x)), x), F.nmse(F.dequantize_q8_1(F.quantize_q8_1(x)), x)]
        print(f"| {name} | " + " | ".join(f"{v:.2e}" for v in r) + " |")
    print("\n| format | bytes / 32 values | bits / value | vs float32 | vs float16 |")
    print("|---|---:|---:|---:|---:|")
    for f in (F.Q4_0, F.Q8_0, F.Q8_1):
        print(f"| {f.name} | {f.dtype.itemsize} | {f.bits_per_value():.2f} | {128 / f.dtype.itemsize:.2f}x | {64 / f.dtype.itemsize:.2f}x |")


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "quant_error"))
