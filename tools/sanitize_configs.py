#!/usr/bin/env python3
"""Every configuration of some GEMM kernels, each launched once under one compute-sanitizer tool in
its own process, several side by side: which configurations does the tool flag?

    python3 tools/sanitize_configs.py racecheck w4a16.wgmma_rs w8a16.wgmma_rs --shapes 300x257x1024,7x33x32 -D RS_SAN_ARRIVALS=1
    python3 tools/sanitize_configs.py memcheck w4a8.skinny --shapes 1x33x160,8x4097x4128

The GPU tests sweep the same configurations in one process (tests/test_gpu_kernels.py) and get
one verdict for all of them; under racecheck the wgmma_rs sweep did not finish within a 10-minute
device call. Here each (kernel, shape, configuration) -- the untuned default plus every candidate `qgemm
tune` may try -- is one launch on fresh inputs with a poisoned output, checked against the exact
reference, and gets its own line: the tool's summary and the result. `-D KEY=INT` adds a
#define to every configuration; the warp-specialized `wgmma_rs` needs `RS_SAN_ARRIVALS=1` under
racecheck (cuda_src/common/wgmma_rs_f16.cuh says why). Exit status 1 when any configuration is
flagged, wrong or timed out.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
FLAGGED = 86  # the sanitizer's exit status when it reports an error (--error-exitcode)
WRONG = 3     # the launch's own exit status when its result misses the exact reference


def run_one(name: str, shape: str, defines_json: str, seed_text: str) -> int:
    """The child: one launch of one configuration, poisoned output, against the exact reference."""
    import numpy as np

    import qgemm
    from qgemm import check

    m, n, k = check.parse_shape(shape)
    defines = json.loads(defines_json)
    kern = qgemm.get(name)
    seed = int(seed_text) if seed_text != "-" else np.random.SeedSequence().entropy % 2**32  # printed: --seed repeats it
    inp = check.make_inputs(kern.op, m, n, k, np.random.default_rng(seed))
    exact = kern.op.exact(inp.a, inp.w)
    out = check.run_poisoned(kern, inp, m, n, k, defines=defines)  # NaN everywhere first: an output never written stays NaN
    rel = qgemm.reference.relative_error(out, exact)
    ok = not np.isnan(out).any() and rel <= kern.op.exact_tol  # as qgemm tune and tools/probe_defines.py judge
    print(f"RESULT {'ok' if ok else 'WRONG'} rel {rel:.2e} seed {seed}")
    return 0 if ok else WRONG


def sanitizer_path(given: str | None) -> str:
    path = given or shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"no compute-sanitizer at {path} (CUDA's toolkit has it; pass --sanitizer PATH)")
    return path


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--one":  # the child process, under the sanitizer
        return run_one(*sys.argv[2:])
    import qgemm
    from qgemm import check, runtime
    from qgemm.errors import NoGPUError, check_output_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tool", choices=TOOLS)
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--shapes", required=True, help="comma-separated MxNxK")
    ap.add_argument("-D", "--define", action="append", default=[], metavar="KEY=INT",
                    help="a #define added to every configuration (repeatable)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 4) - 2))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    ap.add_argument("--sanitizer", default=None, help="default: compute-sanitizer on PATH, else CUDA's")
    ap.add_argument("--log-dir", default=None, help="keep each configuration's full output here")
    ap.add_argument("--seed", type=int, default=None, help="the inputs' random seed (default: fresh per launch, printed)")
    ap.add_argument("--defaults-only", action="store_true", help="only the configuration each shape uses untuned")
    a = ap.parse_args()
    if a.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {a.jobs}")
    if not 0 < a.timeout < float("inf"):  # every configuration would be TIMED OUT, or never be
        raise ValueError(f"--timeout must be a positive number of seconds, got {a.timeout:g}")
    extra = {}
    for text in a.define:
        key, _, val = text.partition("=")
        if not re.fullmatch(r"[A-Za-z_]\w*", key) or not re.fullmatch(r"-?\d+", val.strip()):
            raise ValueError(f"-D {text!r}: expected KEY=INT")
        extra[key] = int(val)
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
        check_output_path(os.path.join(a.log_dir, "x"), "--log-dir")
    san = sanitizer_path(a.sanitizer)
    shapes = [check.parse_shape(t) for t in a.shapes.split(",")]
    specs = [qgemm.spec(name) for name in a.kernels]
    for spec in specs:
        if spec.runner is not None or spec.op.kind != "gemm":
            raise ValueError(f"{spec.name} is not a GEMM kernel (MxNxK shapes); the KV-cache and helper kernels "
                             "run under a sanitizer through their tests (tools/gpu_check.sh's sanitize step)")
        for m, n, k in shapes:  # refused in the child, it read as every configuration FAILED, the reason hidden
            if k % spec.op.k_multiple:
                raise ValueError(f"--shapes {m}x{n}x{k}: K must be a multiple of {spec.op.k_multiple} for {spec.name}, "
                                 f"got K={k}")
    if not runtime.gpu_available():
        raise NoGPUError(f"no GPU: {runtime.gpu_unavailable_reason()}")
    sms = runtime.device_info().sm_count
    jobs, skipped = [], []
    for spec in specs:
        for m, n, k in shapes:
            if spec.max_m is not None and m > spec.max_m:  # e.g. the decode kernels at a prefill shape
                skipped.append(f"{spec.name} {m}x{n}x{k} (at most M={spec.max_m})")
                continue
            seen = []
            for d in spec.configurations(m, n, k, sms, a.defaults_only):
                d = dict(d, **extra)
                if d not in seen:  # -D may make two configurations one
                    seen.append(d)
                    jobs.append((spec.name, f"{m}x{n}x{k}", d))

    def one(job):
        name, shape, d = job
        cmd = [san, "--tool", a.tool, "--error-exitcode", str(FLAGGED), "--print-limit", "20",
               sys.executable, os.path.abspath(__file__), "--one", name, shape, json.dumps(d, sort_keys=True),
               "-" if a.seed is None else str(a.seed)]
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=a.timeout)
            rc, text = p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:  # its captured output is bytes whatever text= says
            rc, text = None, e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return job, cmd, rc, text

    if not jobs:
        raise ValueError("nothing to run: " + "; ".join(skipped))
    print(f"{len(jobs)} configurations under {a.tool}, {a.jobs} at a time"
          + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    bad = 0
    with ThreadPoolExecutor(a.jobs) as ex:
        for i, ((name, shape, d), cmd, rc, text) in enumerate(ex.map(one, jobs)):
            summary = next((ln.strip("= ") for ln in text.splitlines() if "SUMMARY" in ln), "no summary")
            result = next((ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("RESULT ")), "no result")
            if rc == 0 and (summary == "no summary" or result == "no result"):
                rc = -1  # exit 0 without the tool's summary or the launch's result: nothing was checked
            verdict = {0: "clean", FLAGGED: "FLAGGED", WRONG: "WRONG", None: "TIMED OUT",
                       -1: "UNCHECKED"}.get(rc, f"FAILED (exit {rc})")
            cfg = " ".join(f"{k}={v}" for k, v in sorted(d.items()))
            print(f"{verdict:9s} {name} {shape} {cfg} | {summary} | {result}")
            if rc != 0:
                bad += 1
                report = [ln for ln in text.splitlines() if ln.startswith("=========") and ln.strip("= ")][:8]
                for ln in report or text.strip().splitlines()[-5:]:
                    print("    " + ln)
            if a.log_dir:
                with open(os.path.join(a.log_dir, f"{i:04d}-{name}-{shape}.log"), "w") as f:
                    f.write(shlex.join(cmd) + "\n" + text)
    print(f"{len(jobs) - bad} of {len(jobs)} clean and correct under {a.tool}")
    return 1 if bad else 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "sanitize_configs"))
