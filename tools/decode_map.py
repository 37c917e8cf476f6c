#!/usr/bin/env python3
"""How close decode comes to the memory on real models' shapes: `qgemm.matmul` on packed weights
at a few token counts over the (N, K) weight matrices of common models, cold by default (every
buffer rotated through more than twice the L2, as a model's weights come from DRAM). Each row
gives its weight bytes per second as a share of the device copy bandwidth measured in the same run,
and the table is sorted weakest first: where the decode rules still leave time on the table.
Session 60's map (docs/perf/NOTES.md) found Q4_0 at 16 tokens of a long K at 46-60% this way.

    python tools/decode_map.py                                  # every model, 1-16 tokens, both formats
    python tools/decode_map.py --models llama3-70b --m 9,16 --fmts q4_0 --markdown map.md
    python tools/decode_map.py --shapes 5120x14336,4608x3584 --hot --x-dtype f16
    python tools/decode_map.py --dry-run                        # no GPU: the plan of every row

The weights are random blocks with small scales: their values do not change the time, and making
them this way takes no float32 copy of a 57344 x 8192 matrix. "% of copy" can pass 100: a decode op
only reads its weights, the copy reads and writes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (N, K) of each model's weight matrices: attention q / k / v fused, one of k / v alone, o, the
# feed-forward gate and up (each, and fused), down, and the output matrix over the vocabulary
MODELS = {
    "llama3-8b": [(6144, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (28672, 4096), (4096, 14336),
                  (128256, 4096)],
    "llama3-70b": [(10240, 8192), (1024, 8192), (8192, 8192), (28672, 8192), (57344, 8192), (8192, 28672)],
    "qwen2.5-7b": [(4608, 3584), (512, 3584), (3584, 3584), (18944, 3584), (3584, 18944)],
    "mistral-nemo-12b": [(6144, 5120), (1024, 5120), (5120, 4096), (14336, 5120), (28672, 5120), (5120, 14336)],
}
DEFAULT_M = "1,2,4,8,16"


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """'5120x14336,4608x3584' -> [(N, K), ...]: the weights' rows and K, K a multiple of 32."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            n, k = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes takes NxK pairs separated by commas (the weights' N and K), got {part!r}") from None
        if n < 1 or k < 32 or k % 32:
            raise ValueError(f"--shapes: N must be positive and K a positive multiple of 32 (the block size), got {part!r}")
        out.append((n, k))
    if not out:
        raise ValueError(f"--shapes names no NxK pair: {text!r}")
    return out


def select(models: str | None, shapes: str | None) -> list[tuple[str, int, int]]:
    """(model, N, K) rows: the named models' matrices (all by default) and any --shapes pairs, once each."""
    rows = []
    names = list(MODELS) if models is None and shapes is None else [m.strip() for m in (models or "").split(",") if m.strip()]
    for name in names:
        if name not in MODELS:
            raise ValueError(f"--models: unknown model {name!r}; known: {', '.join(MODELS)}")
        rows += [(name, n, k) for n, k in MODELS[name]]
    if shapes:
        rows += [("", n, k) for n, k in parse_pairs(shapes)]
    seen, out = set(), []
    for model, n, k in rows:
        if (n, k) not in seen:
            seen.add((n, k))
            out.append((model, n, k))
    return out


def random_blocks(fmt: str, n: int, k: int, rng):
    """Valid ggml blocks of random quants and scales in [0.001, 0.01), without a float32 matrix."""
    import numpy as np

    from qgemm import formats as F

    dt = F.get_format(fmt).dtype
    raw = rng.integers(0, 256, n * (k // 32) * dt.itemsize, dtype=np.uint8)
    b = raw.view(dt).reshape(n, k // 32)
    b["d"] = rng.uniform(0.001, 0.01, b.shape).astype(np.float16)
    return b


def markdown(rows: list[dict], header: str, copy_gbps: float) -> str:
    """The rows, weakest share of the copy bandwidth first."""
    lines = [header, "", f"copy bandwidth {copy_gbps:.0f} GB/s (read + write); weights packed", "",
             "| model | type | MxNxK | kernel | µs | weight GB/s | % of copy | configuration |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: r["share"]):
        cfg = " ".join(f"{k}={v}" for k, v in (r["config"] or {}).items())
        lines.append(f"| {r['model']} | {r['fmt']} | {r['M']}x{r['N']}x{r['K']} | `{r['kernel']}` | {r['us']:.2f} | "
                     f"{r['gbps']:.0f} | {100 * r['share']:.1f}% | {cfg} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma-separated, of: {', '.join(MODELS)} (default: all)")
    ap.add_argument("--shapes", default=None, help="comma-separated NxK weight matrices, besides or instead of --models")
    ap.add_argument("--m", default=DEFAULT_M, help=f"token counts (default {DEFAULT_M})")
    ap.add_argument("--fmts", default="q4_0,q8_0")
    ap.add_argument("--x-dtype", default="f32", help="the activations' type: f32, f16 or bf16")
    ap.add_argument("--hot", action="store_true", help="the same buffers every launch (default: cold, rotated)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--dry-run", action="store_true", help="print each row's plan for sm_90 (132 SMs); no GPU")
    ap.add_argument("--markdown", default=None, help="write the table here")
    args = ap.parse_args(argv)
    try:
        for opt, v in (("--models", args.models), ("--shapes", args.shapes)):
            if v is not None and not v.replace(",", "").strip():
                raise ValueError(f"{opt} is empty: name at least one (or leave the option out)")
        rows = select(args.models, args.shapes)
        if args.iters < 1:
            raise ValueError(f"--iters must be at least 1 (timed samples per row), got {args.iters}")
        if args.markdown is not None:
            from qgemm.errors import check_output_path

            check_output_path(args.markdown, "--markdown")  # before the measurements, not after
        ms = sorted({int(v) for v in args.m.split(",") if v.strip()})
        if not ms or ms[0] < 1:
            raise ValueError(f"--m takes positive token counts separated by commas, got {args.m!r}")
        fmts = [f.strip() for f in args.fmts.split(",") if f.strip()]
        if not fmts or set(fmts) - {"q4_0", "q8_0"}:
            raise ValueError(f"--fmts takes q4_0 and / or q8_0, got {args.fmts!r}")
        if args.x_dtype not in ("f32", "f16", "bf16"):
            raise ValueError(f"--x-dtype takes f32, f16 or bf16, got {args.x_dtype!r}")
    except ValueError as e:
        ap.error(str(e))
    import qgemm

    if args.dry_run:
        for model, n, k in rows:
            for fmt in fmts:
                for m in ms:
                    p = qgemm.plan(m, n, k, fmt, x_dtype=args.x_dtype, packed=True, arch="sm_90")
                    cfg = " ".join(f"{key}={v}" for key, v in (p.defines or {}).items())
                    print(f"{model or '-'} {fmt} {m}x{n}x{k} {p.kernel} {cfg}")
        return 0
    import numpy as np

    from qgemm import bench, runtime

    @bench.on_qgemm_device
    def run():
        rng = np.random.default_rng(0)
        copy = bench.measure_copy_bandwidth() / 1e9
        out = []
        for model, n, k in rows:
            for fmt in fmts:
                w = {(fmt, n, k): random_blocks(fmt, n, k, rng)}
                for m in ms:
                    r = bench.time_matmul(fmt, m, n, k, not args.hot, rng, w, iters=args.iters, x_dtype=args.x_dtype)
                    row = {"model": model, "fmt": fmt, "M": m, "N": n, "K": k, "kernel": r["kernel"], "config": r["config"],
                           "us": r["matmul_us"], "gbps": r["weight_gbps"], "share": r["weight_gbps"] / copy}
                    print(f"{model or '-'} {fmt} {m}x{n}x{k} {row['kernel']} {row['us']:.2f} us "
                          f"{row['gbps']:.0f} GB/s {100 * row['share']:.1f}%", flush=True)
                    out.append(row)
        return copy, out
    copy, out = run()
    info = runtime.device_info()
    header = (f"{info.name}, {'hot' if args.hot else 'cold'}, {args.x_dtype} x, "
              f"`python tools/decode_map.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    text = markdown(out, header, copy)
    if args.markdown:
        Path(args.markdown).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "decode_map"))
