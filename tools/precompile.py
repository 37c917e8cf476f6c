#!/usr/bin/env python3
"""Compile kernels' default and candidate configurations for some shapes in parallel (NVRTC
only, no GPU needed with --arch), so that `qgemm tune` and the tests find them in the cache.

    python3 tools/precompile.py w4a16.skinny w8a16.skinny --shapes 1x4096x4096,8x4096x14336 [--arch sm_90]
    python3 tools/precompile.py all --defaults-only --shapes ...   # every GEMM kernel's untuned configuration
"""

import argparse
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _compile(job):
    import qgemm

    name, arch, defines = job
    try:
        qgemm.get(name).compile(arch, defines)
        return None
    except Exception as e:  # reported, not fatal: tune skips what does not compile
        return f"{name} {defines}: {str(e).splitlines()[0]}"


def main() -> int:
    import qgemm
    from qgemm import check, jit, runtime

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--shapes", required=True, help="comma-separated MxNxK")
    ap.add_argument("--arch", default=None, help="default: the GPU's")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--defaults-only", action="store_true", help="only the configuration each shape uses untuned")
    a = ap.parse_args()
    if a.jobs < 1:
        raise SystemExit(f"precompile: --jobs must be at least 1, got {a.jobs}")
    if a.arch is None and not runtime.gpu_available():
        raise SystemExit("precompile: no GPU to take the architecture from; pass --arch, e.g. --arch sm_90")
    arch = jit.normalize_arch(a.arch or runtime.device_arch())
    jit.check_arch_supported(arch)  # once, not as the same failure in every job
    jobs = set()
    names = [s.name for s in qgemm.registry.list_kernels() if s.runner is None] if a.kernels == ["all"] else a.kernels
    try:  # a bad name or shape: its message, not a traceback
        specs = [qgemm.spec(name) for name in names]
        shapes = [check.parse_shape(text) for text in a.shapes.split(",")]
    except ValueError as e:
        raise SystemExit(f"precompile: {e}") from None
    for name, spec in zip(names, specs):
        if spec.runner is not None:  # their plans follow the compressed cache's data, not MxNxK
            raise SystemExit(f"precompile: {name} is a mustafar.* kernel, whose configurations depend on the cache: "
                             "tools/gpu_check_kvcache.sh's compile step compiles them")
        for m, n, k in shapes:
            if spec.op.kind == "gemm" and k % spec.op.k_multiple:  # (as `qgemm compile --shape` refuses it)
                raise SystemExit(f"precompile: --shapes: K must be a multiple of {spec.op.k_multiple} for {name}, "
                                 f"got {m}x{n}x{k}")
            jobs.update((name, arch, tuple(sorted(d.items()))) for d in spec.configurations(m, n, k, 132, a.defaults_only))
    jobs = [(n, ar, dict(d)) for n, ar, d in sorted(jobs)]
    # spawned, not forked: without --arch this process has initialised CUDA by now, and a fork of a
    # multi-threaded process may deadlock in the child (Python 3.12 warns)
    with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        errors = [e for e in ex.map(_compile, jobs) if e]
    print(f"{len(jobs) - len(errors)} of {len(jobs)} configurations compiled for {arch}")
    for e in errors:
        print("  failed:", e)
    return 1 if jobs and len(errors) == len(jobs) else 0  # some may fail (tune skips them); none compiled is an error


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "precompile"))
