#!/usr/bin/env python3
"""The whole-op A/B of two source trees, from `tools/compare_paths.py` JSON files: for each shape
(hot or @cold), weight format, activation type and path, the old tree's and the new tree's
`qgemm.matmul` time (min-max over the files of each side), the ratio of the minima, and the
#defines of the plan that differ between the two. No GPU needed.

`tools/gpu_check.sh`'s step `ab` writes the files (each tree timed twice, alternating, in one
device call, so that drift between the passes shows as a cell's range) and runs this:

    python3 tools/ab_report.py --old out/ab-old-1.json,out/ab-old-2.json \\
        --new out/ab-new-1.json,out/ab-new-2.json --markdown out/ab.md

A row present on one side only (a shape or path one tree did not time) is listed with "-" on the
other side and no ratio; the ratio of the whole table's changed rows is not averaged -- read the
rows.
"""
import argparse
import json
import sys

from qgemm.errors import check_output_path

_KEY_FIELDS = ("shape", "fmt", "x_dtype_asked", "path")


def load(paths: list[str], side: str) -> list[dict]:
    """The rows of every file of one side, each checked to be a compare_paths row."""
    rows = []
    for p in paths:
        try:
            with open(p) as f:
                doc = json.load(f)
        except OSError as e:
            raise ValueError(f"--{side}: cannot read {p}: {e.strerror}")
        except json.JSONDecodeError as e:
            raise ValueError(f"--{side}: {p} is not JSON ({e.msg}, line {e.lineno})")
        file_rows = doc.get("rows") if isinstance(doc, dict) else None
        if not isinstance(file_rows, list) or not file_rows:
            raise ValueError(f"--{side}: {p} holds no rows: expected the JSON of tools/compare_paths.py --json")
        for r in file_rows:
            if not isinstance(r, dict):  # `in` below would search a string, or fail on a number
                raise ValueError(f"--{side}: a row of {p} is not an object (a {type(r).__name__}): expected "
                                 "tools/compare_paths.py rows")
            missing = [k for k in (*_KEY_FIELDS, "cold", "matmul_us", "config", "kernel") if k not in r]
            if missing:
                raise ValueError(f"--{side}: a row of {p} lacks {', '.join(missing)}: expected tools/compare_paths.py rows")
        rows += file_rows
    return rows


def _key(r: dict) -> tuple:
    shape = r["shape"] if r["shape"].endswith("@cold") or not r["cold"] else r["shape"] + "@cold"
    return (shape, r["fmt"], r["x_dtype_asked"], r["path"])


def _plan(r: dict) -> dict:
    return {"kernel": r["kernel"], **r["config"]}


def config_change(old: list[dict], new: list[dict]) -> str:
    """The plan's kernel and #defines that differ, `KEY a -> b`; "same" where both sides ran one
    plan; each side's plans listed where a side ran more than one (the default moved between its
    own passes: a tuned cache, or another GPU)."""
    po = list({json.dumps(_plan(r), sort_keys=True): _plan(r) for r in old}.values())
    pn = list({json.dumps(_plan(r), sort_keys=True): _plan(r) for r in new}.values())
    if len(po) > 1 or len(pn) > 1:
        return f"plans vary within a side: old {po}, new {pn}"
    a, b = po[0], pn[0]
    moved = [f"{k} {a.get(k, '-')} -> {b.get(k, '-')}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    return ", ".join(moved) if moved else "same"


def table(old_rows: list[dict], new_rows: list[dict]) -> list[tuple]:
    """(shape, fmt, x dtype, path, old times, new times, new/old of the minima or None, change)."""
    old, new = {}, {}
    for r in old_rows:
        old.setdefault(_key(r), []).append(r)
    for r in new_rows:
        new.setdefault(_key(r), []).append(r)
    out = []
    for k in dict.fromkeys([*old, *new]):
        o, n = old.get(k, []), new.get(k, [])
        to, tn = [r["matmul_us"] for r in o], [r["matmul_us"] for r in n]
        ratio = min(tn) / min(to) if to and tn else None
        out.append((*k, to, tn, ratio, config_change(o, n) if o and n else "-"))
    return out


def _cell(times: list[float]) -> str:
    if not times:
        return "-"
    lo, hi = min(times), max(times)
    return f"{lo:.2f}" if hi - lo < 0.005 else f"{lo:.2f}-{hi:.2f}"


def markdown(rows: list[tuple], old_files: list[str], new_files: list[str]) -> str:
    lines = [f"old: {', '.join(old_files)}; new: {', '.join(new_files)} (µs, min-max over the files; "
             "new / old of the minima)", "",
             "| shape | type | x | path | old µs | new µs | new / old | what changed |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for shape, fmt, x, path, to, tn, ratio, change in rows:
        r = f"{ratio:.3f}" if ratio is not None else "-"
        lines.append(f"| {shape.replace('@cold', ' cold')} | {fmt} | {x} | {path} | {_cell(to)} | {_cell(tn)} | {r} | {change} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="comma-separated compare_paths JSON files of the tree before")
    ap.add_argument("--new", required=True, help="comma-separated compare_paths JSON files of the tree after")
    ap.add_argument("--markdown", default=None, help="also write the table here")
    a = ap.parse_args(argv)
    old_files = [p.strip() for p in a.old.split(",") if p.strip()]
    new_files = [p.strip() for p in a.new.split(",") if p.strip()]
    if not old_files or not new_files:
        raise ValueError("--old and --new each name at least one JSON file of tools/compare_paths.py")
    if a.markdown:
        check_output_path(a.markdown, "--markdown")
    text = markdown(table(load(old_files, "old"), load(new_files, "new")), old_files, new_files)
    sys.stdout.write(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "ab_report"))
