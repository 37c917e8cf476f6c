"""Quantizing float weights at load: `qgemm.pack_weights(w_float, fmt)` (ggml's quantizer on the
GPU, `quantize.q4_0` / `quantize.q8_0`, then the repacking) against numpy's quantizer
(`qgemm.quantize`, the CPU reference) followed by `pack_weights` of its blocks, for one weight
matrix, float32 on the host and float32 / bfloat16 already on the GPU. Wall-clock seconds, the
median of a few runs (numpy's of two: it takes seconds); every GPU result is checked byte for
byte against numpy's blocks first.

    python tools/quant_speed.py --shape 14336x4096 --json out/quant_speed.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import qgemm
from qgemm import formats as F, runtime


def _seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        runtime.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="14336x4096", help="NxK of the weight matrix")
    ap.add_argument("--reps", type=int, default=5, help="runs per GPU timing (numpy: 2)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    try:
        n, k = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        ap.error(f"--shape must be NxK (two integers), got {args.shape!r}")
    if n < 1 or k < 32 or k % 32 or args.reps < 1:
        ap.error(f"--shape needs N >= 1 and K a positive multiple of 32 (got {args.shape}), --reps >= 1")
    if args.json is not None:
        from qgemm.errors import check_output_path

        check_output_path(args.json, "--json")  # before the measurements, not after
    w = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32) * 0.02
    dw = qgemm.DeviceArray.from_host(w)
    dw16 = qgemm.DeviceArray.from_host(F.f32_to_bf16(w))
    rows = []
    print(f"{runtime.device_info().name}: float weights {n}x{k} ({w.nbytes / 1e6:.0f} MB float32) -> packed blocks, seconds")
    for fmt in ("q4_0", "q8_0"):
        blocks = qgemm.quantize(w, fmt)
        for src, name in ((w, "host float32"), (dw, "device float32"), (dw16, "device bfloat16")):
            want = blocks if name != "device bfloat16" else qgemm.quantize(F.bf16_to_f32(F.f32_to_bf16(w)), fmt)
            got = qgemm.pack_weights(src, fmt).blocks.to_host()
            if got.tobytes() != want.tobytes():
                sys.exit(f"quant_speed: {fmt} from {name}: the GPU's blocks differ from numpy's")
        t_numpy = _seconds(lambda: qgemm.pack_weights(qgemm.quantize(w, fmt)), 2)
        t_blocks = _seconds(lambda: qgemm.pack_weights(blocks), args.reps)
        row = {"fmt": fmt, "n": n, "k": k, "numpy_quantize_then_pack_s": t_numpy, "pack_blocks_s": t_blocks}
        for src, key in ((w, "host_f32"), (dw, "device_f32"), (dw16, "device_bf16")):
            row[f"pack_float_{key}_s"] = _seconds(lambda: qgemm.pack_weights(src, fmt), args.reps)
        rows.append(row)
        print(f"  {fmt}: numpy quantize + pack_weights {t_numpy:.3f}; pack_weights of the blocks {t_blocks:.4f}; "
              f"pack_weights of float weights: host float32 {row['pack_float_host_f32_s']:.4f}, "
              f"device float32 {row['pack_float_device_f32_s']:.4f}, device bfloat16 {row['pack_float_device_bf16_s']:.4f} "
              f"({t_numpy / row['pack_float_host_f32_s']:.0f}x numpy from the host)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": runtime.device_info().name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "command": " ".join(["python"] + sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "quant_speed"))
