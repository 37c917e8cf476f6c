"""Host (Python) time of one eager `qgemm.matmul` call, the cost a serving loop pays per op when
it does not capture a CUDA graph (docs/pytorch.md). Each form is called back to back `--calls`
times without synchronizing; the GPU work of one decode op (~4 us) is shorter than its launch,
so wall time / calls is the host's time per call. torch's own eager `F.linear` (fp16 weights,
cuBLAS) is timed the same way in the same process as the peer; the GPU time of each op (CUDA
graph replay, as `qgemm bench`) is reported beside it, so a reader sees which one bounds.

    python tools/host_overhead.py --json out.json --profile 25

--profile N: also run the first form under cProfile and print its N most expensive functions
(own time), to see where the host time goes. --table JSON: print the markdown table of a saved
run (docs/pytorch.md embeds the one of docs/perf/host-overhead-h100.json; a test keeps them equal).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time

import numpy as np


def per_call_us(fn, calls: int, sync) -> float:
    """Median over 5 rounds of (wall time of `calls` back-to-back calls, then a sync) / calls,
    after at least 0.3 s of calls (compile, load, allocate scratch, settle the caches and the CPU's
    clock; with 100 calls of warm-up the first form measured varied most between runs, 53-77 us on
    one H100 host)."""
    t0 = time.perf_counter()
    n = 0
    while n < 100 or time.perf_counter() - t0 < 0.3:
        fn()
        n += 1
    sync()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return float(np.median(rounds))


def gpu_us(fn, stream) -> float:
    """The GPU time of one call: a CUDA graph of 50 calls replayed 20 times (torch's graph)."""
    import torch

    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(50):
                fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(20):
        start.record(stream)
        g.replay()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / 50)
    return float(np.median(samples))


def markdown(data: dict, suite: str = "gemm") -> str:
    """A saved run as a table: one row per call form, one column per shape, host us per call
    (the op's GPU time beside it where it was measured). suite: "gemm" (qgemm.matmul) or
    "kvcache" (qgemm.kvcache.scores / attend)."""
    rows = [r for r in data["rows"] if r.get("suite", "gemm") == suite]
    if not rows:
        return ""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    forms = list(dict.fromkeys(r["form"] for r in rows))
    cell = {(r["form"], r["shape"]): r for r in rows}
    what = (f"{rows[0]['fmt'].upper()} weights" if suite == "gemm" else
            "B x S x D, 70% sparsity, 4 query heads per kv head, Lq = 1")
    lines = [f"| call ({what}; host µs per call, GPU µs in brackets) | " + " | ".join(shapes) + " |",
             "|---|" + "---|" * len(shapes)]
    for f in forms:
        row = []
        for sh in shapes:
            r = cell.get((f, sh))
            row.append("" if r is None else f"{r['host_us']:.1f}" + (f" ({r['gpu_us']:.1f})" if r["gpu_us"] is not None else ""))
        lines.append(f"| `{f}` | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def kv_rows(shape: str, calls: int, stream, rng) -> list:
    """qgemm.kvcache.scores / attend on an uploaded 2-bit and fp16 cache (70% sparsity, four query
    heads per kv head, one query), device operands with out= and stream=, against torch's dense
    batched matmul of the same product (fp16, cuBLAS; as `qgemm bench --suite kvcache` times it)
    as the peer."""
    import torch

    from qgemm import kvcache as kv

    b, s_len, d = (int(v) for v in shape.lower().split("x"))
    groups = 4
    cache = torch.randn(b, s_len, d, device="cuda", dtype=torch.float16)
    host = cache.cpu().numpy()
    q = torch.randn(b * groups, 1, d, device="cuda", dtype=torch.float16)
    p = torch.softmax(torch.randn(b * groups, 1, s_len, device="cuda"), -1).half()
    sc = torch.empty(b * groups, 1, s_len, device="cuda", dtype=torch.float16)
    o = torch.empty(b * groups, 1, d, device="cuda", dtype=torch.float32)
    pruned = kv.prune(host, 0.7)
    forms = {}
    for bits in (2, 16):
        ck = kv.compress_keys(pruned, bits).to_device()
        cv = kv.compress_values(pruned, bits).to_device()
        forms[f"scores(torch q, {bits}-bit keys on the GPU, out=, stream=)"] = (
            lambda ck=ck: kv.scores(q, ck, out=sc, stream=stream))
        forms[f"attend(torch p, {bits}-bit values on the GPU, out=, stream=)"] = (
            lambda cv=cv: kv.attend(p, cv, out=o, stream=stream))
    # the dense baseline of `qgemm bench --suite kvcache`: a kv head's query rows [groups x Lq] as one
    # bmm operand, so each dense head is read once
    qh, ph = q.view(b, groups, d), p.view(b, groups, s_len)
    forms["torch bmm(q, K^T) dense fp16 (peer)"] = lambda: torch.bmm(qh, cache.transpose(1, 2))
    forms["torch bmm(p, V) dense fp16 (peer)"] = lambda: torch.bmm(ph, cache)
    rows = []
    for name, fn in forms.items():
        with torch.cuda.stream(stream):
            host_us = per_call_us(fn, calls, stream.synchronize)
            dev = gpu_us(fn, stream)
        rows.append({"suite": "kvcache", "shape": shape, "fmt": "f16", "form": name, "host_us": host_us, "gpu_us": dev})
        print(f"{shape:>14} {name:<66} host {host_us:7.1f}   gpu {dev:7.2f}", flush=True)
    return rows


def _shapes(option: str, texts: list[str], form: str | None = None) -> list[tuple[int, ...]]:
    """parse_shape of each, the error naming the option."""
    from qgemm.check import parse_shape

    try:
        return [parse_shape(s, form=form) for s in texts]
    except ValueError as e:
        raise ValueError(f"{option}: {e}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x4096x4096,8x4096x4096,512x4096x4096", help="comma-separated MxNxK")
    ap.add_argument("--fmt", default="q4_0")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=0, help="cProfile the first form; print the top N functions")
    ap.add_argument("--json", default=None)
    ap.add_argument("--kv-shapes", default="32x4096x128,32x16384x128",
                    help="comma-separated BxSxD of the KV-cache calls (empty: none)")
    ap.add_argument("--table", default=None, metavar="JSON", help="print the markdown table of a saved run and exit")
    ap.add_argument("--suite", default="gemm", choices=["gemm", "kvcache"], help="which table --table prints")
    a = ap.parse_args(argv)
    if a.table is not None:
        if not a.table.strip():  # not "no --table": a timing run where a table was asked for
            raise ValueError("--table: expected the path of a host_overhead.py --json file, got an empty path")
        with open(a.table) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"--table {a.table}: not a host_overhead.py --json file (no 'rows')")
        if not all(isinstance(r, dict) for r in data["rows"]):
            raise ValueError(f"--table {a.table}: not a host_overhead.py --json file (expected 'rows': a list of "
                             "objects, one per call form and shape)")
        try:
            print(markdown(data, a.suite), end="")
        except (KeyError, TypeError) as e:
            raise ValueError(f"--table {a.table}: not a host_overhead.py --json file of the {a.suite} suite "
                             f"(missing {e})") from None
        return 0
    if a.calls < 4:  # the 512-token rows take a quarter of the calls
        raise ValueError(f"--calls must be at least 4, got {a.calls}")
    from qgemm import formats as F, registry

    # every shape checked before the first is timed: the loops below take them as given
    if a.fmt not in ("q4_0", "q8_0"):
        raise ValueError(f"--fmt must be q4_0 or q8_0, got {a.fmt!r}")
    shapes = _shapes("--shapes", a.shapes.split(","))
    for (m, n, k), text in zip(shapes, a.shapes.split(",")):
        if k % F.QK:
            raise ValueError(f"--shapes {text}: K must be a multiple of {F.QK} (the {a.fmt} blocks), got K={k}")
    kv_texts = list(filter(None, a.kv_shapes.split(",")))
    kv_runner = registry.spec("mustafar.key_q2").runner  # scores / attend: every Mustafar kernel takes the same BxSxD
    for shape, text in zip(_shapes("--kv-shapes", kv_texts, "BxSxD"), kv_texts):
        why = kv_runner.shape_problem(shape)
        if why:
            raise ValueError(f"--kv-shapes {text}: {why}")
    if a.json:  # before the timings, not after them
        from qgemm.errors import check_output_path

        check_output_path(a.json, "--json")
    try:
        import torch
    except ImportError:
        raise SystemExit("host_overhead: needs torch (its rows time qgemm with torch operands against torch's own "
                         "F.linear): pip install torch") from None

    import qgemm
    from qgemm import runtime

    info = runtime.device_info()
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    rows = []
    print(f"device: {info.name}; host time per eager call (us), {a.calls} calls back to back, median of 5 rounds")
    for (m, n, k), shape in zip(shapes, a.shapes.split(",")):
        w = F.quantize(rng.standard_normal((n, k), dtype=np.float32), a.fmt)
        pw = qgemm.pack_weights(w)
        w_dev = torch.from_numpy(w.view(np.uint8).reshape(n, -1).copy()).cuda()
        w16 = torch.from_numpy(F.dequantize(w, a.fmt).astype(np.float16)).cuda()
        x = torch.randn(m, k, device="cuda")
        x16 = x.half()
        y = torch.empty(m, n, device="cuda")
        dx, dy = runtime.as_device_array(x), runtime.as_device_array(y)
        qs = runtime.as_stream(stream)  # a cuda.core Stream: as_stream passes it through unchecked
        forms = {
            "matmul(torch x, packed, out=, stream=torch stream)":
                lambda: qgemm.matmul(x, pw, out=y, stream=stream),
            "matmul(DeviceArray x, packed, out=, stream=cuda.core Stream)":
                lambda: qgemm.matmul(dx, pw, out=dy, stream=qs),
            "matmul(torch x, packed) -> new DeviceArray, stream=torch stream":
                lambda: qgemm.matmul(x, pw, stream=stream),
            "matmul(torch x, ggml blocks on the GPU, fmt=, out=, stream=)":
                lambda: qgemm.matmul(x, w_dev, fmt=a.fmt, out=y, stream=stream),
            "torch F.linear(x fp16, W fp16) (peer)":
                lambda: torch.nn.functional.linear(x16, w16),
        }
        plan = qgemm.explain(m, n, k, a.fmt, packed=True).splitlines()
        for name, fn in forms.items():
            with torch.cuda.stream(stream):
                host = per_call_us(fn, a.calls if m < 512 else a.calls // 4, stream.synchronize)
                dev = gpu_us(fn, stream) if "out=, stream=torch" in name or "fmt=, out=" in name or "peer" in name else None
            rows.append({"shape": shape, "fmt": a.fmt, "form": name, "host_us": host, "gpu_us": dev})
            print(f"{shape:>14} {name:<66} host {host:7.1f}" + (f"   gpu {dev:7.2f}" if dev is not None else ""),
                  flush=True)
        print("               plan:", " | ".join(s.strip() for s in plan[1:3]))
        if a.profile and shape == a.shapes.split(",")[0]:
            fn = forms[next(iter(forms))]
            pr = cProfile.Profile()
            with torch.cuda.stream(stream):
                pr.enable()
                for _ in range(a.calls):
                    fn()
                pr.disable()
                stream.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.profile)
            print(s.getvalue())
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(a.profile)
            print(s.getvalue())
    for shape in kv_texts:
        rows += kv_rows(shape, a.calls, stream, rng)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": info.name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "command": "python tools/host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    from qgemm.errors import run_tool

    sys.exit(run_tool(main, "host_overhead"))
