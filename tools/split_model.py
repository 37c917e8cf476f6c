#!/usr/bin/env python3
"""How well wgmma_rs's cost model (`qgemm.registry.rs_grid_cost`: waves x the K a CTA walks, plus
a fixed cost per K split, scaled by the tile's measured rate) orders the configurations that
`qgemm tune --json` timed. No GPU needed: it reads the JSON files.

    qgemm tune w4a16.wgmma_rs --shape 300x3072x7168 --dry-run --json t1.json     # on the GPU
    python3 tools/split_model.py t1.json t2.json [--overhead 768] [--rate 64x2=0.72] [--markdown out.md]

For every file: the fastest correct time of each (tokens per tile, MMA warpgroups, K split), beside
the model's cost, both relative to their best among the tiles the model has a rate for; the
model's pick against the measured one; and over all files the rms error of the model's ratios (in
%). Sessions 53-54 fitted the fixed cost (768 K) and read the rates (64-token tiles 0.72, 64-row
tiles 0.78) this way by hand; `--overhead` and `--rate` try others against the same timings.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _load(path: str) -> dict:
    """A `qgemm tune --json` file of a wgmma_rs kernel, or ValueError saying what it is instead."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(d, dict) or not isinstance(d.get("candidates"), list) or "shape" not in d:
        raise ValueError(f"{path}: not the output of `qgemm tune --json` (no shape and candidates)")
    if not all(isinstance(c, dict) and isinstance(c.get("config", {}), dict) for c in d["candidates"]):
        raise ValueError(f"{path}: not the output of `qgemm tune --json` (expected candidates: a list of objects, "
                         "each with its config an object)")
    shape = d["shape"]
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)):
        raise ValueError(f"{path}: not the output of `qgemm tune --json` (expected shape [M, N, K], got {shape!r})")
    if not str(d.get("kernel", "")).endswith(".wgmma_rs"):
        raise ValueError(f"{path}: a tune of {d.get('kernel')!r}; the model is wgmma_rs's (w4a16.wgmma_rs, w8a16.wgmma_rs)")
    return d


def rows_of(tune: dict, sm_count: int, overhead: float, rates: dict) -> list[dict]:
    """The fastest correct time per (tokens, warpgroups, split), with the model's cost (None
    for a tile without a rate), sorted by time."""
    from qgemm import registry

    m, n, k = tune["shape"]
    best: dict = {}
    for c in tune["candidates"]:
        cfg = c.get("config", {})
        if c.get("check") != "ok" or c.get("us") is None or not {"RS_BN", "RS_WGS", "RS_SPLITK"} <= set(cfg):
            continue
        key = (cfg["RS_BN"], cfg["RS_WGS"], cfg["RS_SPLITK"])
        if key not in best or c["us"] < best[key]:
            best[key] = c["us"]
    rows = []
    for (bn, wgs, split), us in best.items():
        ctas = math.ceil(n / (64 * wgs)) * math.ceil(m / bn) * split
        rows.append({"bn": bn, "wgs": wgs, "split": split, "ctas": ctas, "us": us,
                     "model": registry.rs_grid_cost(m, n, k, bn, wgs, split, sm_count, overhead, rates)})
    return sorted(rows, key=lambda r: r["us"])


def compare(rows: list[dict]) -> tuple[list[dict], dict | None, dict | None, list[float]]:
    """Each modelled row's measured and modelled time relative to the best of the modelled rows;
    the model's pick, the measured best of those rows, and the log errors of the ratios."""
    modelled = [r for r in rows if r["model"] is not None]
    if not modelled:
        return rows, None, None, []
    us0 = min(r["us"] for r in modelled)
    cost0 = min(r["model"] for r in modelled)
    errors = []
    for r in rows:
        r["us_ratio"] = r["us"] / us0 if r["model"] is not None else None
        r["model_ratio"] = r["model"] / cost0 if r["model"] is not None else None
        if r["model"] is not None:
            errors.append(math.log(r["model_ratio"] / r["us_ratio"]))
    pick = min(modelled, key=lambda r: (r["model"], r["split"]))
    return rows, pick, min(modelled, key=lambda r: r["us"]), errors


def _name(r: dict) -> str:
    return f"{r['bn']} tokens x {64 * r['wgs']} rows, split {r['split']}"


def report(paths: list[str], overhead: float | None, rates: dict, sm: int | None) -> tuple[str, float | None]:
    from qgemm import registry

    overhead = registry.RS_SPLIT_OVERHEAD_K if overhead is None else overhead
    rates = {**registry.RS_TILE_RATES, **rates}
    out, errors, picked = [], [], 0
    tunes = [(p, _load(p)) for p in paths]
    for path, t in tunes:
        sm_count = sm or int(t.get("environment", {}).get("sm_count") or 132)
        rows, pick, best, errs = compare(rows_of(t, sm_count, overhead, rates))
        m, n, k = t["shape"]
        env = t.get("environment", {})
        out.append(f"### {t['kernel']} {m}x{n}x{k} ({env.get('device', 'device not recorded')}, {sm_count} SMs; {path})\n")
        out.append("| tile | CTAs | µs | / best | model / best |")
        out.append("|---|---:|---:|---:|---:|")
        for r in rows:
            fmt = (lambda x: "-" if x is None else f"{x:.3f}")  # noqa: E731
            out.append(f"| {_name(r)} | {r['ctas']} | {r['us']:.1f} | {fmt(r.get('us_ratio'))} | {fmt(r.get('model_ratio'))} |")
        if pick is None:
            out.append("\nno timed tile has a rate in the model\n")
            continue
        same = (pick["bn"], pick["wgs"], pick["split"]) == (best["bn"], best["wgs"], best["split"])
        picked += same
        out.append(f"\nthe model picks {_name(pick)} ({pick['us']:.1f} µs); measured best {_name(best)} ({best['us']:.1f})"
                   + ("" if same else f": {100 * (pick['us'] / best['us'] - 1):.1f}% slower") + "\n")
        errors += errs
    rms = 100 * math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else None
    out.append(f"overhead {overhead:g} K, rates " + ", ".join(f"{bn}x{w}={r:g}" for (bn, w), r in sorted(rates.items()))
               + (f": the model's ratios within {rms:.1f}% rms over {len(errors)} timings; its pick the measured best at "
                  f"{picked} of {len(tunes)} shapes" if rms is not None else ": nothing to compare"))
    return "\n".join(out) + "\n", rms


def _rate(text: str) -> tuple[tuple[int, int], float]:
    try:
        tile, value = text.split("=")
        bn, wgs = (int(x) for x in tile.split("x"))
        r = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate takes TOKENSxWARPGROUPS=RATE, e.g. 64x2=0.72; got {text!r}") from None
    if not 0 < r < math.inf or bn not in (64, 128, 256) or wgs not in (1, 2):  # nan or inf: no cost to order by
        raise argparse.ArgumentTypeError(f"--rate: tokens 64/128/256, warpgroups 1/2, a positive finite rate; got {text!r}")
    return (bn, wgs), r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="`qgemm tune NAME --json FILE` outputs of w4a16.wgmma_rs / w8a16.wgmma_rs")
    ap.add_argument("--overhead", type=float, help="the fixed cost of a K split, in K (default: the registry's)")
    ap.add_argument("--rate", type=_rate, action="append", default=[], help="a tile's rate, e.g. 64x2=0.72 (repeatable)")
    ap.add_argument("--sm", type=int, help="SM count (default: the one each file recorded)")
    ap.add_argument("--markdown", help="also write the report here")
    a = ap.parse_args(argv)
    if a.overhead is not None and not 0 <= a.overhead < math.inf:  # nan slips past `< 0`
        ap.error(f"--overhead must be finite and >= 0, got {a.overhead:g}")
    if a.sm is not None and a.sm < 1:
        ap.error(f"--sm must be positive, got {a.sm}")
    if a.markdown:
        from qgemm.errors import check_output_path

        check_output_path(a.markdown, "--markdown")
    text, _ = report(a.files, a.overhead, dict(a.rate), a.sm)
    print(text, end="")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "split_model"))
