"""Side-by-side timing of one kernel with #define overrides on top of its launch configuration.

`qgemm tune --dry-run --only` times the configurations in a kernel's candidate list; this times
anything the source understands, including compile-time switches that are not tunables (an
experiment's toggles, or timing probes that skip part of the work and so give wrong results: each
variant's first launch is checked against the exact reference and the line says `ok` or `WRONG`).
Variants alternate within each repetition, in one process, hot (graph-batched, as `qgemm bench`)
or with --cold weight sets rotated through more than twice the L2 (--cold-weights: only the weights
rotated, x and C the same buffers every launch -- a decode op in a model reads the previous op's
fresh output from the L2 and its weights from DRAM).

    python tools/probe_defines.py w4a16.wgmma_rs 512x4096x4096,2048x4096x4096 base st3=RS_STAGES=3 ws0=RS_WS=0
    python tools/probe_defines.py w4a16.skinny 1x4096x4096 base u2=SK_UNROLL=2 --reps 3
    python tools/probe_defines.py w4a8.skinny 1x4096x4096 base early=SK_PDL_EARLY=1 --cold

A variant is `label` (the configuration as is), `label=KEY=INT[;KEY=INT...]`, or `label=@KERNEL`:
another registered GEMM kernel's launch configuration at each shape (a kernel that has one: the
mma, skinny, wgmma and gemv kernels) -- e.g. a 16-bit-activation variant launched with its float32
kernel's configuration (`f32cfg=@w8a16.skinny` beside `w8a16.skinny_f16`), or a float32 kernel with
its variant's. Each variant has a label of its own:

    python tools/probe_defines.py w8a16.skinny_f16 2x4096x4096 base f32cfg=@w8a16.skinny --reps 3
"""
import argparse
import statistics
import sys

import numpy as np

from qgemm import bench, check, registry, runtime
from qgemm.errors import positive_int


def parse_variant(text: str) -> tuple[str, dict]:
    label, _, rest = text.partition("=")
    if not label.strip():  # the label names the variant's output line
        raise ValueError(f"variant {text!r}: the label before '=' is empty; expected label[=KEY=INT...] or label=@KERNEL")
    defines = {}
    if rest.startswith("@"):  # another kernel's launch configuration at each shape
        if not rest[1:]:
            raise ValueError(f"variant {text!r}: expected label=@KERNEL")
        return label, {"@": rest[1:]}
    for kv in filter(None, rest.split(";")):
        key, _, val = kv.partition("=")
        if not key or not val or not val.strip().lstrip("-").isdigit():
            raise ValueError(f"variant {text!r}: expected label=KEY=INT[;KEY=INT...]")
        defines[key.strip()] = int(val)
    return label, defines


def parse_variants(texts: list[str]) -> list[tuple[str, dict]]:
    """parse_variant of each, each label once: two variants of one label could not be told apart in the
    output."""
    variants = [parse_variant(t) for t in texts]
    labels = [label for label, _ in variants]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(f"variants: each label once, got {', '.join(map(repr, twice))} more than once")
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel")
    ap.add_argument("shapes", help="MxNxK[,MxNxK...]")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--reps", type=positive_int, default=2)
    ap.add_argument("--iters", type=positive_int, default=20)
    cold = ap.add_mutually_exclusive_group()
    cold.add_argument("--cold", action="store_true", help="rotate weight / activation / output sets through > 2x L2")
    cold.add_argument("--cold-weights", action="store_true",
                      help="rotate weight sets only; x and C stay the same buffers (in the L2)")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    k = registry.get(args.kernel)
    if getattr(k.spec, "runner", None) is not None:
        raise ValueError(f"{args.kernel} takes a compressed KV cache, not MxNxK operands: tools/kv_probe.py times it")
    for label, extra in variants:  # another kernel's configuration: named right, before any timing
        if "@" in extra:
            other = registry.spec(extra["@"])
            if other.runner is not None or other.config is None:  # its config_for is {}: the base timed as the variant
                raise ValueError(f"variant {label}=@{other.name}: {other.name} has no launch configuration; expected "
                                 "a GEMM kernel with one (mma, skinny, wgmma, gemv), e.g. f32cfg=@w8a16.skinny beside "
                                 "w8a16.skinny_f16")
    shapes = [check.parse_shape(s) for s in args.shapes.split(",")]
    for m, n, kk in shapes:  # make_inputs would refuse it only after the shapes before it were timed
        if kk % k.op.k_multiple:
            raise ValueError(f"shape {m}x{n}x{kk}: K must be a multiple of {k.op.k_multiple} for {args.kernel}, got K={kk}")
    rng = np.random.default_rng(0)
    for m, n, kk in shapes:
        shape = f"{m}x{n}x{kk}"
        inp = check.make_inputs(k.op, m, n, kk, rng)
        exact = k.op.exact(inp.a, inp.w)
        da, dw = k.upload_activations(inp.a), k.upload_weights(inp.w)
        dc = runtime.DeviceArray.empty((m, n), np.float32)
        if args.cold_weights:
            sets = bench._sets_for(inp.w.nbytes, True)
            das, dcs = [da] * sets, [dc] * sets
        else:
            sets = bench._sets_for(inp.a.nbytes + inp.w.nbytes + m * n * 4, args.cold)
            das = [da] + [k.upload_activations(inp.a) for _ in range(sets - 1)]
            dcs = [dc] + [runtime.DeviceArray.empty((m, n), np.float32) for _ in range(sets - 1)]
        dws = [dw] + [k.upload_weights(inp.w) for _ in range(sets - 1)]
        base = k.config_for(m, n, kk)
        mode = f"cold weights, {sets} sets" if args.cold_weights else f"cold, {sets} sets" if args.cold else "hot"
        print(f"{args.kernel} {shape} {mode}: configuration "
              f"{' '.join(f'{a}={b}' for a, b in base.items())}", flush=True)
        for rep in range(args.reps):
            for label, extra in variants:
                if "@" in extra:
                    extra = registry.get(extra["@"]).config_for(m, n, kk)
                d = {**base, **extra}
                dc.fill_bytes(0xFF)
                k.launch(da, dw, dc, m, n, kk, defines=d)
                out = dc.to_host()
                rel = check.reference.relative_error(out, exact)
                ok = not np.isnan(out).any() and rel <= k.op.exact_tol
                times, _ = bench._time_launches(
                    lambda i, stream=None: k.launch(das[i], dws[i], dcs[i], m, n, kk, stream=stream, defines=d), sets, 3,
                    args.iters)
                print(f"  rep {rep} {label:12s} {statistics.median(times):8.2f} us  {'ok' if ok else 'WRONG'} (rel {rel:.1e})  "
                      f"{' '.join(f'{a}={b}' for a, b in extra.items())}", flush=True)


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "probe_defines"))
