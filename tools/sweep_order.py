"""Replay `qgemm bench`'s per-shape sequence (packed op, the same op on ggml blocks, torch peers)
for a few shapes, several rounds, printing every timing: does a row's time depend on what the
sweep ran before it? (session 10: Q8_0 1x4096x4096 measured 5.6 us inside the sweep, 4.95-4.99
in compare_paths.py calls.)

    python tools/sweep_order.py --shapes 1x4096x4096 --rounds 3 [--no-peers] [--no-blocks] [--clocks] [--idle-ms 50]

--clocks samples the SM clock and the power draw every 20 ms with `nvidia-smi` while it runs and
prints their median over each measurement's window (is a slower row a lower clock?). --idle-ms
leaves the GPU idle that long (a host sleep after a synchronize) before every qgemm measurement:
is a slower row the work before it, or the idle gap while the host prepares it? --after-peers
reset-l2 / flush: is it the L2 lines the torch peers leave behind?
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from qgemm.errors import positive_int


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x4096x4096")
    ap.add_argument("--fmts", default="q4_0,q8_0")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--iters", type=positive_int, default=20)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-blocks", action="store_true")
    ap.add_argument("--clocks", action="store_true", help="sample SM clock and power with nvidia-smi")
    ap.add_argument("--idle-ms", type=float, default=0.0, help="GPU idle gap before every qgemm measurement")
    ap.add_argument("--after-peers", choices=["none", "reset-l2", "flush"], default="none",
                    help="after the torch peers: demote persisting (evict-last) L2 lines, or stream 2x L2 of memset")
    a = ap.parse_args(argv)

    from qgemm import bench, formats as F, runtime
    from qgemm.check import parse_shape

    shapes = [parse_shape(s) for s in a.shapes.split(",")]  # before the sampler starts
    sampler = bench.ClockSampler() if a.clocks else None
    try:
        def clocks(t0: float, t1: float) -> str:
            """Median SM clock (MHz) and power (W) sampled in [t0, t1]."""
            if sampler is None:
                return ""
            w = sampler.window(t0, t1)
            return f" [SM {w['sm_mhz']:.0f} MHz, {w['power_w']:.0f} W, {w['samples']} samples]" if w else " [no clock samples]"

        def idle():
            if a.idle_ms > 0:
                runtime.synchronize()
                time.sleep(a.idle_ms / 1e3)

        rng = np.random.default_rng(0)
        print(f"device: {runtime.device_info().name}; hot, us (median of {a.iters} graph-batched samples)")
        fmts = a.fmts.split(",")
        weights = {(f, n, k): F.quantize(rng.standard_normal((n, k), dtype=np.float32), f) for (_, n, k) in shapes for f in fmts}
        for rnd in range(a.rounds):
            for (m, n, k) in shapes:
                for f in fmts:
                    idle()
                    t0 = time.time()
                    r = bench.time_matmul(f, m, n, k, False, rng, weights, iters=a.iters)
                    line = (f"round {rnd} {m}x{n}x{k} {f}: packed op {r['matmul_us']:.2f} kernel {r['kernel_us']:.2f} ({r['kernel']})"
                            + clocks(t0, time.time()))
                    if not a.no_blocks:
                        idle()
                        rb = bench.time_matmul(f, m, n, k, False, rng, weights, iters=a.iters, packed=False)
                        line += f"; blocks op {rb['matmul_us']:.2f} ({rb['kernel']})"
                    print(line, flush=True)
                if not a.no_peers:
                    t0 = time.time()
                    p = bench.torch_peer_times(m, n, k, False, iters=a.iters)
                    print(f"round {rnd} {m}x{n}x{k} peers: " + ", ".join(f"{key} {v:.1f}" for key, v in p.items())
                          + clocks(t0, time.time()), flush=True)
                    if a.after_peers == "reset-l2":
                        runtime.reset_persisting_l2()
                    elif a.after_peers == "flush":
                        junk = runtime.DeviceArray.empty((2 * runtime.device_info().l2_bytes,), np.uint8)
                        junk.fill_bytes(0)
                        runtime.synchronize()
                        junk.free()
    finally:  # an nvidia-smi left sampling would run on after this process
        if sampler is not None:
            sampler.close()
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "sweep_order"))
