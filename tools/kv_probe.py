"""Side-by-side timing of Mustafar kernels (mustafar.*) under launch-plan variants, cold as in
`qgemm bench --suite kvcache` (or hot: `--hot`), each variant's first launch checked against the
numpy reference on the decompressed cache (the line says `ok` or `WRONG`). Variants alternate
within each repetition, in one process.

    python tools/kv_probe.py mustafar.value_q2,mustafar.value_q2c 32x16384x128 base unsorted=MF_SORT=0
    python tools/kv_probe.py mustafar.key_q2 32x16384x128 base one_lop3=MF_CREG=0 --lq 8

A variant is `label` (plan_for's plan as is) or `label=KEY=INT[;KEY=INT...]`: #defines put on top
of the plan (a define that changes the kernel's shared memory or grid needs a plan of its own:
change qgemm.kvcache.plan_for instead), except MF_MMA=0 / 1, which asks plan_for for version 3 / 4
of the 4/2-bit value kernels, MF_V3=0 / 1 (version 2 / 3 of the walk), MF_MIN_CTAS=N (resident
CTAs per SM), for key kernels MF_STEPS_PER_CTA=N (warp steps of 32 tokens per CTA) and for
value kernels MF_WHOLE=0 / 1 (16-warp CTAs over whole chunks), each with a shared memory and grid
of its own; QGEMM_PDL=0 times the variant with plain launches (no programmatic dependent
launch). MF_OSC is not a variant: the launcher sets it from the upload (1 where a value channel
was scaled: qgemm.kvcache.channel_exponents). To compare source trees, run it once per tree
(QGEMM_CUDA_SRC=DIR).
"""
import argparse
import dataclasses
import statistics
import sys

from probe_defines import parse_variant  # the same `label=KEY=INT[;KEY=INT...]` variants (tools/ is on sys.path)

from qgemm import kvcache as kv
from qgemm.errors import positive_int
from qgemm import registry, runtime
from qgemm.check import parse_shape


def plan(runner, ck, rows: int, overrides: dict) -> tuple:
    """(the variant's LaunchPlan, its QGEMM_PDL setting or None)"""
    overrides = dict(overrides)
    mma = overrides.pop("MF_MMA", None)  # a version of its own (plan_for's mma=): its own grid
    mc = overrides.pop("MF_MIN_CTAS", None)  # resident CTAs per SM: the grid is sized by it too
    spc = overrides.pop("MF_STEPS_PER_CTA", None)  # keys: warp steps per CTA (plan_for's steps_per_cta): its own grid
    v3 = overrides.pop("MF_V3", None)  # version 3 / 2 of the walk (plan_for's v3): its own shared memory and grid
    whole = overrides.pop("MF_WHOLE", None)  # values: 16-warp CTAs over whole chunks or not (plan_for's whole)
    pdl = overrides.pop("QGEMM_PDL", None)  # 0: plain launches (runtime.pdl_enabled), read while this variant is timed
    info = runtime.device_info()
    p = kv.plan_for(runner.kind, runner.bits, ck.shape, rows, info.sm_count, kv.step_bytes_max(ck),
                    mma=None if mma is None else bool(mma),
                    cc=info.cc, ctas_per_sm=mc, steps_per_cta=spc, v3=None if v3 is None else bool(v3),
                    density=kv.density(ck), whole=None if whole is None else bool(whole))
    p = dataclasses.replace(p, defines={**p.defines, **overrides}) if overrides else p
    return p, pdl


def check(kernel, runner, ck, x, cache, p) -> str:
    dkv = kv.DeviceKV.upload(ck)  # a copy of its own, freed below (not ck.to_device()'s memoized one)
    dx = runtime.DeviceArray.from_host(x)
    oshape, odt = runner.out_shape(dkv, x.shape[0], x.shape[1])
    dout = runtime.DeviceArray.empty(oshape, odt)
    dout.fill_bytes(0xFF)
    runner.launch(kernel, dkv, dx, dout, x.shape[0] // ck.shape[0] * x.shape[1], plan_=p)
    runtime.check_last_error(kernel.name)
    r = kv.score(kernel.name, runner.kind, ck.shape, 0, dout.to_host(), x, ck, cache, kernel.op.exact_tol)
    for a in (dkv, dx, dout):
        a.free()
    return "ok" if r.passed else f"WRONG ({r.note or r.rel_err})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", help="NAME[,NAME...]")
    ap.add_argument("shape", help="BxSxD")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--lq", type=int, default=1)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--sparsity", type=float, default=0.7)
    ap.add_argument("--reps", type=positive_int, default=2)
    ap.add_argument("--iters", type=positive_int, default=30)
    ap.add_argument("--hot", action="store_true",
                    help="time on one buffer set (the cache stays in L2 where it fits) instead of rotating "
                         "buffer sets through > 2x L2")
    args = ap.parse_args()
    shape = parse_shape(args.shape, form="BxSxD")
    variants = [parse_variant(v) for v in args.variants]
    for label, d in variants:
        if "@" in d:  # probe_defines' other-kernel configuration: a Mustafar kernel's plan is plan_for's
            raise ValueError(f"variant {label}=@{d['@']}: expected label or label=KEY=INT[;KEY=INT...] (no @KERNEL here)")
    labels = [label for label, _ in variants]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:  # the plans are keyed by label: a second one would replace the first
        raise ValueError(f"variants: each label once, got {', '.join(map(repr, twice))} more than once")
    for name in args.kernels.split(","):  # every name, before the GPU
        runner = getattr(registry.spec(name), "runner", None)
        if runner is None:
            raise ValueError(f"{name} is not a mustafar.* kernel (tools/probe_defines.py times the GEMM kernels)")
        why = runner.shape_problem(shape)
        if why:
            raise ValueError(f"{name}: {why}")
    opts = {"lq": args.lq, "groups": args.groups, "sparsity": args.sparsity}
    print(f"{runtime.device_info().name}; shape {args.shape}, lq {args.lq}, groups {args.groups}, "
          f"sparsity {args.sparsity}; {'hot' if args.hot else 'cold'}, median of {args.iters} (us)")
    for name in args.kernels.split(","):
        kernel = registry.get(name)
        runner = kernel.spec.runner
        cache, ck, x = runner.make_case(shape, 0, opts)
        rows = x.shape[0] // shape[0] * x.shape[1]
        plans = {label: plan(runner, ck, rows, d) for label, d in variants}
        status = {}
        for label, (p, pdl) in plans.items():
            with runtime.pdl_setting(pdl):
                status[label] = check(kernel, runner, ck, x, cache, p)
        times = {label: [] for label in plans}
        for _ in range(args.reps):
            for label, (p, pdl) in plans.items():
                with runtime.pdl_setting(pdl):
                    t = kv.time_kernel(kernel, runner, ck, x, iters=args.iters, cold=not args.hot, plan_=p)
                times[label].append(t["median_us"])
        for label, (p, pdl) in plans.items():
            ts = times[label]
            print(f"{name:22s} {label:10s} {statistics.median(ts):8.2f}  [{' '.join(f'{t:.2f}' for t in ts)}]  "
                  f"{status[label]}  grid {p.grid} per_cta {p.per_cta} {p.defines}{'' if pdl is None else f' QGEMM_PDL={pdl}'}")


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "kv_probe"))
