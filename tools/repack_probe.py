"""The weights' repacking on the GPU (`pack.q4_0` / `pack.q8_0`, session 36): how fast the kernels
are alone (hot and cold, `bench.profile`), what `pack_weights` costs against the old host repack
+ upload, and whether `qgemm.matmul` on ggml blocks should repack them per call: for each shape,
hot and cold, graph-batched as `qgemm bench` times (`bench.time_matmul`), side by side in one
process:
  blocks_old  the kernels that read ggml blocks (the plan with the per-call repacking turned off),
  repack      pack.* into a scratch copy, then the packed path's kernel (path= that kernel),
  packed      pack_weights once (not timed), then the packed path.
The rule in qgemm.dispatch (REPACK_MIN_M) comes from these figures.

    python tools/repack_probe.py --ms 1,8,17,512 --json out/repack.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import qgemm
from qgemm import bench, dispatch as mm, formats as F, packing, runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,2,4,8,16,17,32,64,128,512,2048", help="token counts M (comma-separated)")
    ap.add_argument("--ks", default="4096,14336", help="K values (N = 4096)")
    ap.add_argument("--no-cold", action="store_true", help="hot timings only")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    try:
        ms = [int(v) for v in a.ms.split(",")]
        ks = [int(v) for v in a.ks.split(",")]
    except ValueError:
        raise ValueError(f"--ms / --ks must be comma-separated integers, got {a.ms!r} / {a.ks!r}") from None
    if min(ms) < 1 or min(ks) < 32 or any(k % 32 for k in ks):
        raise ValueError(f"--ms must be positive and --ks positive multiples of 32, got {a.ms!r} / {a.ks!r}")
    if a.json:  # before the timings, not after them
        from qgemm.errors import check_output_path

        check_output_path(a.json, "--json")
    rng = np.random.default_rng(0)
    info = runtime.device_info()
    res = {"device": info.name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "pack": [], "rows": []}
    weights = {}
    for fmt in ("q4_0", "q8_0"):
        for k in ks:
            weights[(fmt, 4096, k)] = F.quantize(rng.standard_normal((4096, k), dtype=np.float32), fmt)
    for (fmt, n, k), w in weights.items():
        kern = qgemm.get(f"pack.{fmt}")
        hot, cold = bench.profile(kern, (1, n, k), cold=False), bench.profile(kern, (1, n, k), cold=True)
        t0 = time.perf_counter()
        host = runtime.DeviceArray.from_host(packing.pack(w, fmt))  # the repacking before session 36
        runtime.synchronize()
        t_host = time.perf_counter() - t0
        host.free()
        dw = runtime.DeviceArray.from_host(w)
        from_host = min(qgemm.pack_weights(w).pack_seconds for _ in range(3))
        from_dev = min(qgemm.pack_weights(dw).pack_seconds for _ in range(3))
        row = {"fmt": fmt, "N": n, "K": k, "kernel_hot_us": hot.median_us, "kernel_cold_us": cold.median_us,
               "kernel_cold_gbps": cold.gbps, "kernel_cold_roofline_pct": cold.roofline_pct,
               "host_repack_upload_ms": t_host * 1e3, "pack_weights_host_ms": from_host * 1e3,
               "pack_weights_device_ms": from_dev * 1e3}
        print(json.dumps(row), flush=True)
        res["pack"].append(row)
    for (fmt, n, k) in weights:
        for m in ms:
            for cold in (False,) if a.no_cold else (False, True):
                keep = mm.REPACK_MIN_M
                mm.REPACK_MIN_M = {f: 2**31 for f in keep}  # the plan without the per-call repacking
                try:
                    old = bench.time_matmul(fmt, m, n, k, cold, rng, weights, packed=False)
                finally:
                    mm.REPACK_MIN_M = keep
                kp = mm.plan(m, n, k, fmt, packed=True).kernel
                rep = bench.time_matmul(fmt, m, n, k, cold, rng, weights, packed=False, path=kp)
                pk = bench.time_matmul(fmt, m, n, k, cold, rng, weights, packed=True)
                row = {"fmt": fmt, "M": m, "N": n, "K": k, "cold": cold, "blocks_old_us": old["matmul_us"],
                       "blocks_old_kernel": old["kernel"], "repack_us": rep["matmul_us"],
                       "repack_kernel_alone_us": rep["kernel_us"], "packed_us": pk["matmul_us"], "packed_kernel": pk["kernel"]}
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "repack_probe"))
