"""Where a kernel's warps wait: the SASS instructions with the most Nsight Compute stall samples.

Reads the CSV that `SOURCE=1 tools/gpu_ncu.sh` writes (`ncu --import R --page source --csv
--print-source sass`) and prints the top instructions by sampled stalls, each with its share of
all samples and its neighbours' opcodes, then the samples summed per opcode.

    python tools/ncu_source_top.py out/ncu/ncu-w4a16.wgmma_rs-512x4096x4096-sass.csv [--top 30]
"""
import argparse
import csv
import io
import re
import sys
from collections import Counter

from qgemm.errors import positive_int


def _opcode(sass: str) -> str:
    """The opcode of a SASS line, its predicate (@P0, @!UP1) dropped."""
    text = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())
    return text.split(" ")[0] if text else "?"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=positive_int, default=30)
    args = ap.parse_args()
    text = open(args.csv, encoding="utf-8", errors="replace").read()
    start = text.find('"Address","Source"')  # skip ncu's lines before the header (kernel name)
    if start < 0:
        raise SystemExit(f"{args.csv}: no source-page header (\"Address\",\"Source\",...); expected the output of "
                         "ncu --import R --page source --csv --print-source sass")
    rows = list(csv.reader(io.StringIO(text[start:])))
    header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = {h: i for i, h in enumerate(header)}
    src = next((i for h, i in col.items() if h.strip() == "Source"), None)
    samp = next((i for h, i in col.items() if "Stall Sampling (All" in h), None)
    if src is None or samp is None:
        raise SystemExit(f"{args.csv}: no 'Source' or 'Warp Stall Sampling (All Samples)' column; profile with "
                         "--section SourceCounters (tools/gpu_ncu.sh with SOURCE=1)")
    nis = next((i for h, i in col.items() if "Stall Sampling (Not" in h), None)
    if not body:  # the header alone: a kernel ncu sampled nothing of, or a cut-off file
        raise ValueError(f"{args.csv}: no instruction rows under the source-page header; expected one row per SASS "
                         "instruction (ncu --import R --page source --csv --print-source sass)")
    reasons = [(h, i) for h, i in col.items() if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_num(r[samp]) for r in body) or 1.0  # no samples at all: 0% everywhere, not a division by zero
    print(f"{len(body)} SASS instructions, {total:.0f} stall samples; columns: {header[samp]!r}")
    order = sorted(range(len(body)), key=lambda i: -_num(body[i][samp]))
    for i in order[:args.top]:
        r = body[i]
        ctx = " | ".join(_opcode(body[j][src]) for j in range(max(i - 2, 0), i))
        extra = f" not-issued {_num(r[nis]) / total:5.1%}" if nis is not None else ""
        why = sorted(((_num(r[j]), h[6:]) for h, j in reasons), reverse=True)[:3]
        why = ", ".join(f"{h} {v / total:.1%}" for v, h in why if v > 0)
        print(f"{_num(r[samp]) / total:6.1%}{extra}  [{i:5d}] {r[src].strip()[:56]:56s}  {why}  (after: {ctx})")
    per_op = Counter()
    for r in body:
        per_op[_opcode(r[src])] += _num(r[samp])
    print("\nby stall reason:")
    for h, j in sorted(reasons, key=lambda hj: -sum(_num(r[hj[1]]) for r in body))[:10]:
        print(f"{sum(_num(r[j]) for r in body) / total:6.1%}  {h[6:]}")
    print("\nby opcode:")
    for op, v in per_op.most_common(15):
        print(f"{v / total:6.1%}  {op}")


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "ncu_source_top"))
