"""The developer tools under tools/ that parse their own input (no GPU needed)."""
import json
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sweep_without_a_gpu(monkeypatch, copy_bandwidth=lambda *a: 2.0e12):
    """`qgemm.bench.sweep` with its GPU parts stood in for: the copy bandwidth, the environment and
    the weights' repacking (the timings are each test's own `time_matmul`)."""
    import types

    from qgemm import bench, packing

    monkeypatch.setattr(bench, "measure_copy_bandwidth", copy_bandwidth)
    monkeypatch.setattr(bench, "environment", lambda: {"device": "X", "arch": "sm_90", "driver": "1", "nvrtc": "13.0", "date": "today"})
    nothing = types.SimpleNamespace(free=lambda: None)
    monkeypatch.setattr(packing, "pack_weights", lambda w: types.SimpleNamespace(pack_seconds=0.001, packed=nothing, blocks=nothing))
    return bench


def _row(fmt, m, n, k, cold, packed=False, matmul_us=1.0):
    """A `time_matmul` result as the sweep reads it."""
    return {"fmt": fmt, "M": m, "N": n, "K": k, "cold": cold, "packed": packed, "matmul_us": matmul_us, "kernel_us": 1.0,
            "kernel": "w4a8.skinny", "tflops": 0.1, "weight_gbps": 1.0}


def test_probe_defines_parses_variants():
    pd = _load("probe_defines")
    assert pd.parse_variant("base") == ("base", {})
    assert pd.parse_variant("g4=RS_GROUPS=4") == ("g4", {"RS_GROUPS": 4})
    assert pd.parse_variant("both=RS_A=1;RS_B=0") == ("both", {"RS_A": 1, "RS_B": 0})
    assert pd.parse_variant("f32cfg=@w8a16.skinny") == ("f32cfg", {"@": "w8a16.skinny"})
    for bad in ("x=RS_A", "x=RS_A=one", "x==1", "x=@", "=@w8a16.skinny"):
        with pytest.raises((SystemExit, ValueError)):
            pd.parse_variant(bad)


# the shape of `ncu --import R --page source --csv --print-source sass` (Nsight Compute 2025)
_CSV = '''"Kernel Name","w4a16_wgmma_rs",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x10","LDS.128 R4, [R8+0x8000]","10","2","10","8","2","1"
"0x20","PRMT R5, R4, 0x5140, R6","30","20","30","0","30","0"
"0x30","@!P0 BRA 0x10","60","40","60","60","0","40"
'''


def test_ncu_source_top_ranks_instructions(tmp_path):
    f = tmp_path / "sass.csv"
    f.write_text(_CSV)
    out = subprocess.run([sys.executable, str(TOOLS / "ncu_source_top.py"), str(f), "--top", "2"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert "3 SASS instructions, 100 stall samples" in lines[0]
    assert "60.0%" in lines[1] and "BRA" in lines[1] and "long_sb 60.0%" in lines[1]
    assert "30.0%" in lines[2] and "PRMT" in lines[2] and "wait 30.0%" in lines[2]
    assert not lines[3].strip()  # --top 2: the 10% LDS is left out
    reasons = out[out.index("by stall reason:"):out.index("by opcode:")]
    assert "68.0%  long_sb" in reasons and "32.0%  wait" in reasons
    assert "60.0%  BRA" in out[out.index("by opcode:"):]


def test_ncu_source_top_rejects_other_files(tmp_path):
    f = tmp_path / "not.csv"
    f.write_text("Duration,1\n")
    r = subprocess.run([sys.executable, str(TOOLS / "ncu_source_top.py"), str(f)], capture_output=True, text=True)
    assert r.returncode != 0 and "no source-page header" in r.stderr


_FAKE_SMI = '''#!/usr/bin/env python3
# stands in for `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits -lms N`
import datetime, sys, time
assert "--query-gpu=timestamp,clocks.sm,power.draw" in sys.argv and "-lms" in sys.argv, sys.argv
for i in range(400):
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{now}, {1980 - 10 * (i % 3)}, {100 + i % 2}.00", flush=True)
    if i == 1:
        print("[N/A], [N/A], [N/A]", flush=True)  # a line the parser must skip
    time.sleep(0.005)
'''


def test_clock_sampler_reads_nvidia_smi(tmp_path, monkeypatch):
    """qgemm.bench.ClockSampler (`qgemm bench --clocks`, tools/sweep_order.py --clocks) against a fake
    nvidia-smi on PATH: medians of the samples inside a window, None outside any sample, and no
    sampler at all (None, no error) where nvidia-smi is missing."""
    import time

    from qgemm import bench

    smi = tmp_path / "nvidia-smi"
    smi.write_text(_FAKE_SMI.replace("/usr/bin/env python3", sys.executable))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    t_start = time.time()
    with bench.ClockSampler(period_ms=5) as clk:
        # the constructor waits for nvidia-smi's first sample (a loaded host once took > 0.3 s to
        # start the fake): the first timing of a sweep gets a clock too
        assert clk.window(t_start, time.time()) is not None
        t0 = time.time()
        time.sleep(0.3)
        w = clk.window(t0, time.time())
        assert w is not None and w["samples"] >= 5, w
        assert 1960 <= w["sm_mhz"] <= 1980 and 100 <= w["power_w"] <= 101
        assert clk.window(0.0, 1.0) is None  # 1970: no samples there
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with bench.ClockSampler() as clk:
        assert clk.window(0.0, time.time()) is None
    # an nvidia-smi that exits without a sample (no GPU): no wait for the start timeout, no clock
    dead = tmp_path / "dead"
    dead.mkdir()
    (dead / "nvidia-smi").write_text(f"#!{sys.executable}\nimport sys\nprint('No devices were found')\nsys.exit(6)\n")
    (dead / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{dead}:/usr/bin:/bin")
    t_start = time.monotonic()
    with bench.ClockSampler(start_timeout_s=30) as clk:
        assert time.monotonic() - t_start < 20
        assert clk.window(0.0, time.time()) is None


def test_sweep_markdown_reports_clock_range():
    from qgemm import bench

    row = {"fmt": "q4_0", "M": 1, "N": 64, "K": 32, "cold": False, "matmul_us": 3.0, "kernel_us": 3.0, "kernel": "w4a8.skinny",
           "tflops": 0.1, "weight_gbps": 1.0, "clock": {"sm_mhz": 1755.0, "power_w": 300.0, "samples": 9}}
    data = {"environment": {"device": "X", "arch": "sm_90", "driver": "1", "nvrtc": "13.0", "date": "today"},
            "copy_bandwidth_gbps": 1.0, "rows": [row, {**row, "M": 2, "clock": {"sm_mhz": 1980.0, "power_w": 120.0, "samples": 9}}]}
    md = bench.sweep_markdown(data, "qgemm bench --clocks")
    assert "1755-1980 MHz" in md and "120-300 W" in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| q4_0 |")]  # each row's own clock, last column
    assert lines[0].endswith("| 1755 (300) |") and lines[1].endswith("| 1980 (120) |")
    header = next(ln for ln in md.splitlines() if ln.startswith("| type |"))
    assert header.count("|") == lines[0].count("|") and header.endswith("SM MHz (W) |")
    del row["clock"]
    data["rows"] = [row]
    assert "MHz" not in bench.sweep_markdown(data, "qgemm bench")
    assert "QGEMM_BENCH_L2" not in bench.sweep_markdown(data, "qgemm bench")  # JSON from before the switch
    assert "previous row left (`QGEMM_BENCH_L2=off`" in bench.sweep_markdown({**data, "l2_reset": "off"}, "qgemm bench")
    assert "reset L2 (a kernel reads twice its size" in bench.sweep_markdown({**data, "l2_reset": "read"}, "qgemm bench")


class _FakeGraph:
    """runtime.Graph for the timing tests: a replay runs the recorded launches."""

    def __init__(self, record, stream):
        self.record = record

    def launch(self):
        self.record()


def test_every_timing_starts_from_a_cleared_l2(monkeypatch):
    """_time_launches calls clear_l2 on its stream before any launch (what it does is
    QGEMM_BENCH_L2's choice: test_clear_l2_modes)."""
    from types import SimpleNamespace

    from qgemm import bench

    log = []
    fake = SimpleNamespace(create_stream=lambda: "s", synchronize=lambda s=None: None, record_event=lambda s=None: len(log),
                           elapsed_ms=lambda a, b: 1.0, Graph=_FakeGraph)
    monkeypatch.setattr(bench, "runtime", fake)
    monkeypatch.setattr(bench, "clear_l2", lambda stream=None: log.append(("clear", stream)))
    times, _ = bench._time_launches(lambda i, stream=None: log.append(("launch", stream)), 1, 3, 4)
    assert log[0] == ("clear", "s") and len(times) == 4
    assert [e for e in log[1:] if e[0] != "launch"] == []


def test_sustained_timing_runs_for_the_time_asked(monkeypatch):
    """--sustain: samples are taken back to back until they add up to the time asked (llama.cpp's
    perf loop runs each op for >= 1 s), never fewer than --iters; without it, exactly --iters."""
    from types import SimpleNamespace

    from qgemm import bench

    fake = SimpleNamespace(create_stream=lambda: "s", synchronize=lambda s=None: None, record_event=lambda s=None: 0,
                           elapsed_ms=lambda a, b: 2.0, Graph=_FakeGraph)  # every replay: 2 ms of GPU time
    monkeypatch.setattr(bench, "runtime", fake)
    launch = lambda i, stream=None: None  # noqa: E731
    times, how = bench._time_launches(launch, 1, 3, 4)
    assert len(times) == 4 and "over" not in how["method"]
    times, how = bench._time_launches(launch, 1, 3, 4, sustain_s=0.25)  # 125 replays of 2 ms: three chunks of 50
    assert len(times) == 3 * bench._SUSTAIN_CHUNK and how["method"].endswith("150 samples back to back over >= 0.25 s")
    times, _ = bench._time_launches(launch, 1, 3, 120, sustain_s=1e-6)  # --iters still the floor
    assert len(times) == 3 * bench._SUSTAIN_CHUNK

    # the sweep hands it to every timing, qgemm's and the peers', and says so
    _sweep_without_a_gpu(monkeypatch)
    asked = []

    def time_matmul(fmt, m, n, k, cold, rng, weights, iters=30, packed=True, sustain_s=0.0, x_dtype="f32"):
        asked.append(("qgemm", sustain_s, x_dtype))
        return _row(fmt, m, n, k, cold, packed=packed)

    def peers(m, n, k, cold, iters=30, sustain_s=0.0):
        asked.append(("torch", sustain_s))
        return {"torch_fp16_us": 2.0}

    monkeypatch.setattr(bench, "time_matmul", time_matmul)
    monkeypatch.setattr(bench, "torch_peer_times", peers)
    monkeypatch.setattr(bench, "read_ceiling", lambda nbytes, cold, iters=20, sustain_s=0.0: asked.append(("ceiling", sustain_s))
                        or {"bytes": nbytes, "cold": cold, "independent_us": 0.5, "dependent_us": 0.8, "pdl": True})
    data = bench.sweep(ms=(1,), ks=(64,), n=32, fmts=("q4_0",), modes=(False,), sustain_s=1.5)
    assert asked == [("qgemm", 1.5, "f32"), ("qgemm", 1.5, "f32"), ("torch", 1.5), ("ceiling", 1.5)] and data["sustain_s"] == 1.5
    assert "back to back for at least 1.5 s (`--sustain`)" in bench.sweep_markdown(data, "qgemm bench --sustain 1.5")
    assert "--sustain" not in bench.sweep_markdown({**data, "sustain_s": 0.0}, "qgemm bench")
    assert "activations" not in bench.sweep_markdown(data, "qgemm bench")
    # --x-dtype: qgemm's timings (packed and ggml blocks) take that activation type, and the report says so
    asked.clear()
    data = bench.sweep(ms=(1,), ks=(64,), n=32, fmts=("q4_0",), modes=(False,), peers=False, x_dtype="bf16")
    assert [a for a in asked if a[0] == "qgemm"] == [("qgemm", 0.0, "bf16")] * 2 and data["x_dtype"] == "bf16"
    assert "- qgemm's activations: bfloat16 (--x-dtype" in bench.sweep_markdown(data, "qgemm bench --x-dtype bf16")


def _fake_l2_runtime(made, fills, launches):
    from types import SimpleNamespace

    class FakeArray:
        def __init__(self, shape):
            made.append(shape)
            self.nbytes, self.ptr = shape[0], 1000 + len(made)

        def fill_bytes(self, value, stream=None):
            fills.append((value, stream))

    class FakeKernel:
        def __init__(self, cubin, entries, label):
            assert cubin and entries == ["l2_read"]

        def launch(self, entry, grid, block, shmem, args, stream=None):
            launches.append((entry, grid, int(args[1]), stream))

    return SimpleNamespace(device_info=lambda: SimpleNamespace(l2_bytes=50 << 20, sm_count=132), device_arch=lambda: "sm_90",
                           DeviceArray=SimpleNamespace(empty=lambda shape, dtype: FakeArray(shape)), LoadedKernel=FakeKernel)


@pytest.mark.parametrize("mode", ["read", "memset", "off", "bogus"])
def test_clear_l2_modes(monkeypatch, mode):
    """bench.clear_l2: one zeroed buffer of 2x L2 for the process; `read` launches
    cuda_src/bench/l2_read.cu over all of it on the timing's stream, `memset` rewrites it, `off`
    does nothing (the default); anything else is an error that names the choices."""
    from qgemm import bench

    made, fills, launches = [], [], []
    monkeypatch.setattr(bench, "runtime", _fake_l2_runtime(made, fills, launches))
    monkeypatch.setattr(bench, "_L2_JUNK", None)
    monkeypatch.setattr(bench, "_L2_READ", None)
    monkeypatch.delenv("QGEMM_BENCH_L2", raising=False)
    assert bench.l2_mode() == "off"
    monkeypatch.setenv("QGEMM_BENCH_L2", mode)
    if mode == "bogus":
        with pytest.raises(ValueError, match="read, memset, off"):
            bench.clear_l2("s1")
        return
    bench.clear_l2("s1")
    bench.clear_l2("s2")
    if mode == "off":
        assert made == [] and fills == [] and launches == []
    elif mode == "memset":
        assert made == [(100 << 20,)] and fills == [(0, None), (0, "s1"), (0, "s2")] and launches == []
    else:
        assert made == [(100 << 20,), (1,)] and fills == [(0, None)]  # the buffer zeroed once, then only read
        assert launches == [("l2_read", (4 * 132, 1, 1), (100 << 20) // 16, "s1"), ("l2_read", (4 * 132, 1, 1), (100 << 20) // 16, "s2")]


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
@pytest.mark.parametrize("dependent", [0, 1])
def test_stream_read_kernel_compiles(arch, dependent):
    from qgemm import jit

    ck = jit.compile_kernel("bench.stream_read", "bench/stream_read.cu", ["stream_read"], arch,
                            {"RD_DEPENDENT": dependent}, use_cache=False)
    assert ck.cubin and ck.resources["stream_read"].spill_stores == 0


def test_read_ceiling_keeps_the_fastest_grid_of_each_ceiling(monkeypatch):
    """bench.read_ceiling times every grid shape of both stream_read variants over the same
    buffers (rotated for cold: more than 2x L2), keeps the fastest of each, says which, and frees
    what it allocated."""
    from types import SimpleNamespace

    from qgemm import bench

    made, freed, launched = [], [], []

    class FakeArray:
        def __init__(self, shape):
            made.append(self)
            self.nbytes, self.ptr = shape[0], 1000 + len(made)

        def fill_bytes(self, value, stream=None):
            assert value == 0x5A

        def free(self):
            freed.append(self)

    class FakeKernel:
        def __init__(self, dependent):
            self.dependent = dependent

        def launch(self, entry, grid, block, shmem, args, stream=None, pdl=False):
            launched.append((self.dependent, grid[0], block[0], int(args[1]), pdl))

    fake_rt = SimpleNamespace(device_info=lambda: SimpleNamespace(l2_bytes=50 << 20, sm_count=132, cc=90),
                              DeviceArray=SimpleNamespace(empty=lambda shape, dtype: FakeArray(shape)),
                              pdl_enabled=lambda: True, check_last_error=lambda what: None)
    monkeypatch.setattr(bench, "runtime", fake_rt)
    monkeypatch.setattr(bench, "_stream_read", FakeKernel)

    retimed = []

    def time_launches(launch, sets, warmup, iters, sustain_s=0.0):
        for i in range(sets):
            launch(i)
        dep, grid, threads = launched[-1][:3]
        if sustain_s:
            retimed.append((dep, grid, threads, sustain_s))
            return [7.0], {}
        # the dependent variant is slower; each has its own best grid
        us = (4.0 if dep else 3.0) + abs(grid - (264 if dep else 132)) / 1000 + (0.1 if threads == 512 else 0.0)
        return [us, us + 1, us - 0.5 + 0.5], {}

    monkeypatch.setattr(bench, "_time_launches", time_launches)
    r = bench.read_ceiling(9437184, cold=True)
    assert r["bytes"] == 9437184 and r["cold"] and r["pdl"] and r["buffer_sets"] == 13
    assert r["independent_us"] == 3.0 and r["independent_config"] == "1 CTA(s) per SM x 256 threads"
    assert r["dependent_us"] == 4.0 and r["dependent_config"] == "2 CTA(s) per SM x 256 threads"
    assert {(d, g, t) for d, g, t, _, _ in launched} == {(d, g * 132, t) for d in (False, True) for g in (1, 2, 4)
                                                          for t in (256, 512)}
    assert all(n16 == 9437184 // 16 and pdl for _, _, _, n16, pdl in launched)
    assert len(made) == 14 and set(map(id, freed)) == set(map(id, made))  # 13 sets and the output
    made.clear(), freed.clear()
    assert retimed == []
    r = bench.read_ceiling(1000, cold=False)  # not a multiple of 16: rounded up; hot is one buffer
    assert r["bytes"] == 1008 and r["buffer_sets"] == 1 and len(made) == 2 and len(freed) == 2
    r = bench.read_ceiling(1000, cold=False, sustain_s=0.5)  # the two winners timed again, back to back
    assert retimed == [(False, 132, 256, 0.5), (True, 264, 256, 0.5)] and r["independent_us"] == r["dependent_us"] == 7.0


def test_sweep_measures_read_ceilings_at_the_decode_weights(monkeypatch):
    """The bench measures the read ceilings at each M = 1 row's weight bytes, hot and cold as its
    rows are, in the same run, and its markdown puts them beside the decode rows; without an
    M = 1 row it measures none."""
    bench = _sweep_without_a_gpu(monkeypatch, lambda *a: 2800e9)
    monkeypatch.setattr(bench, "time_matmul", lambda fmt, m, n, k, cold, rng, weights, iters=30, packed=True, sustain_s=0.0,
                        x_dtype="f32": _row(fmt, m, n, k, cold, matmul_us=4.07 if cold else 3.5))
    asked = []

    def read_ceiling(nbytes, cold, iters=20, sustain_s=0.0):
        asked.append((nbytes, cold))
        return {"bytes": nbytes, "cold": cold, "buffer_sets": 1, "pdl": True, "independent_us": 3.0 if cold else 1.3,
                "dependent_us": 4.8 if cold else 2.0, "independent_config": "a", "dependent_config": "b"}

    monkeypatch.setattr(bench, "read_ceiling", read_ceiling)
    seen = []
    data = bench.sweep(ms=(1, 8), ks=(64, 128), n=32, fmts=("q4_0", "q8_0"), peers=False, progress=seen.append, settle_s=0.0)
    assert len(seen) == 16 + 8  # every row, then every ceiling
    sizes = {("q4_0", 64): 36, ("q4_0", 128): 72, ("q8_0", 64): 68, ("q8_0", 128): 136}  # 32 rows x blocks x bytes/block
    assert sorted(asked) == sorted((32 * b, cold) for b in sizes.values() for cold in (False, True))
    assert len(data["read_ceilings"]) == 8
    md = bench.sweep_markdown(data, "qgemm bench")
    assert "### Read ceilings at the decode rows' weight bytes" in md and "plain" not in md
    assert "| q4_0 | 32x64 | 0.00 | cold | 4.07 | 3.00 (0) | 4.80 (0) |" in md
    assert "| q8_0 | 32x128 | 0.00 | hot | 3.50 | 1.30 (3) | 2.00 (2) |" in md  # 4352 B in 1.3 and 2.0 us
    asked.clear()
    data = bench.sweep(ms=(8,), ks=(64,), n=32, fmts=("q4_0",), peers=False, settle_s=0.0)
    assert asked == [] and data["read_ceilings"] == [] and "Read ceilings" not in bench.sweep_markdown(data, "qgemm bench")
    data["read_ceilings"] = [{**read_ceiling(36 * 32, True), "fmt": "q4_0", "N": 32, "K": 64, "pdl": False}]
    assert "Here launches were plain" in bench.sweep_markdown(data, "qgemm bench")


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_l2_read_kernel_compiles(arch):
    from qgemm import jit

    ck = jit.compile_kernel("bench.l2_read", "bench/l2_read.cu", ["l2_read"], arch, use_cache=False)
    assert ck.cubin and ck.resources["l2_read"].spill_stores == 0


def test_kv_probe_overlays_defines_on_the_plan(monkeypatch):
    from types import SimpleNamespace

    import numpy as np

    from qgemm import kvcache as kv

    monkeypatch.syspath_prepend(str(TOOLS))  # as when run as `python tools/kv_probe.py`
    kp = _load("kv_probe")
    assert kp.parse_variant("u=MF_SORT=0") == ("u", {"MF_SORT": 0})
    monkeypatch.setattr(kp.runtime, "device_info", lambda: SimpleNamespace(sm_count=132, cc=90))
    rng = np.random.default_rng(1)
    ck = kv.compress_keys(kv.prune(rng.standard_normal((2, 300, 128)).astype(np.float16), 0.7), 2)
    runner = kp.registry.get("mustafar.key_q2").spec.runner

    def plan(*a):
        p, pdl = kp.plan(*a)
        assert pdl is None
        return p

    base = plan(runner, ck, 4, {})
    over = plan(runner, ck, 4, {"MF_SORT": 0})
    assert base == kv.plan_for("key", 2, ck.shape, 4, 132, kv.step_bytes_max(ck))
    assert over.defines == {**base.defines, "MF_SORT": 0} and (over.grid, over.shmem) == (base.grid, base.shmem)
    # MF_MMA is not a define on top of the plan but the choice of version (its own grid)
    cv = kv.compress_values(kv.prune(rng.standard_normal((2, 300, 128)).astype(np.float16), 0.7), 2)
    vr = kp.registry.get("mustafar.value_q2").spec.runner
    v4 = plan(vr, cv, 4, {"MF_MMA": 1})
    assert v4 == kv.plan_for("value", 2, cv.shape, 4, 132, mma=True) and v4.defines["MF_MMA"] == 1
    assert "MF_MMA" not in plan(vr, cv, 32, {"MF_MMA": 0}).defines and "MF_MMA" in plan(vr, cv, 32, {}).defines
    # so is MF_MIN_CTAS: the resident CTAs per SM, which size the grid too (plan_for's ctas_per_sm)
    c2 = plan(runner, ck, 4, {"MF_MIN_CTAS": 2})
    assert c2 == kv.plan_for("key", 2, ck.shape, 4, 132, kv.step_bytes_max(ck), ctas_per_sm=2) and c2.defines["MF_MIN_CTAS"] == 2
    assert plan(vr, cv, 32, {"MF_MIN_CTAS": 1}) == kv.plan_for("value", 2, cv.shape, 32, 132, mma=True, ctas_per_sm=1)
    # and MF_STEPS_PER_CTA (keys): warp steps per CTA, a grid of their own (plan_for's steps_per_cta)
    s1 = plan(runner, ck, 4, {"MF_STEPS_PER_CTA": 1})
    assert s1 == kv.plan_for("key", 2, ck.shape, 4, 132, kv.step_bytes_max(ck), steps_per_cta=1)
    assert s1.defines == base.defines and s1.per_cta == 1 and s1.grid[0] == 10  # 300 tokens: 10 steps
    # and MF_V3: the version of the walk, with its own shared memory (plan_for's v3)
    v2 = plan(runner, ck, 4, {"MF_V3": 0})
    assert v2 == kv.plan_for("key", 2, ck.shape, 4, 132, kv.step_bytes_max(ck), v3=False) and v2.defines["MF_V3"] == 0
    assert v2.shmem < base.shmem and plan(runner, ck, 4, {"MF_V3": 1}) == base
    # and MF_WHOLE (values): 16-warp CTAs over whole chunks or not (plan_for's whole)
    cv16 = kv.compress_values(kv.prune(rng.standard_normal((2, 300, 128)).astype(np.float16), 0.7), 16)
    vr16 = kp.registry.get("mustafar.value_fp16").spec.runner
    w1 = plan(vr16, cv16, 4, {"MF_WHOLE": 1})
    assert w1.defines["MF_WARPS"] == 16 and w1.per_cta == 128 and plan(vr16, cv16, 4, {"MF_WHOLE": 0}).defines["MF_WARPS"] == 8
    # QGEMM_PDL is no define: the variant is timed with that environment (plain launches for 0)
    p0, pdl = kp.plan(vr16, cv16, 4, {"QGEMM_PDL": 0})
    assert pdl == 0 and "QGEMM_PDL" not in p0.defines and p0 == plan(vr16, cv16, 4, {})
    monkeypatch.setenv("QGEMM_PDL", "1")
    with kp.runtime.pdl_setting(0):
        assert not kp.runtime.pdl_enabled()
    assert kp.runtime.pdl_enabled()
    monkeypatch.delenv("QGEMM_PDL")
    with kp.runtime.pdl_setting(None):
        assert "QGEMM_PDL" not in os.environ
    with kp.runtime.pdl_setting(0):
        assert os.environ["QGEMM_PDL"] == "0"
    assert "QGEMM_PDL" not in os.environ


def test_perf_report_says_by_how_much_a_target_is_missed():
    """The bench section of performance.md: a met target says yes, a missed one its excess in
    percent (0.3% and 24% must not both read "1.0x over")."""
    import json

    pr = _load("perf_report")
    data = json.loads((pathlib.Path(__file__).parent.parent / "docs/perf/bench-h100.json").read_text())
    rows = [r for r in data["rows"] if not r["cold"] and (r["fmt"], r["M"], r["N"], r["K"]) in pr.TARGETS]
    assert rows
    for r, us in zip(rows[:2], (pr.TARGETS[(rows[0]["fmt"], rows[0]["M"], rows[0]["N"], rows[0]["K"])] * 1.003,
                                pr.TARGETS[(rows[1]["fmt"], rows[1]["M"], rows[1]["N"], rows[1]["K"])] * 0.9)):
        r["matmul_us"] = us
    text = pr.bench_section({**data, "rows": rows})
    line = {ln.split(" | ")[0][2:] + " " + ln.split(" | ")[1]: ln for ln in text.splitlines() if ln.startswith("| q")}
    over, under = (line[f"{r['fmt']} {r['M']}x{r['N']}x{r['K']}"] for r in rows[:2])
    assert over.endswith("| no (0.3% over) |") and under.endswith("| yes |"), (over, under)


def test_sweep_plots_draw_each_series_in_one_colour_on_both_panels(tmp_path):
    """`qgemm bench`'s plots, from the published run's JSON: a (format, K) series has the same colour
    in the TFLOPS and the GB/s panel and no other series shares it (the panels once coloured by
    their own drawing order: q4_0 K=14336 was green on the left, orange on the right), the torch
    fp16 peer is drawn once per K, and one PNG per mode is written."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from qgemm import bench

    data = json.loads((pathlib.Path(__file__).parent.parent / "docs/perf/bench-h100.json").read_text())
    for cold in (False, True):
        fig = bench._sweep_figure(data, cold)
        left, right = ({ln.get_label(): ln.get_color() for ln in ax.get_lines()} for ax in fig.axes)
        plt.close(fig)
        ours = sorted(lb for lb in left if lb.startswith("qgemm "))
        assert ours == sorted(lb for lb in right if lb.startswith("qgemm ")) and len(ours) == 4, (left, right)
        assert all(left[lb] == right[lb] for lb in ours), (left, right)
        assert len({left[lb] for lb in left}) == len(left), left  # no two lines of a panel alike
        assert sorted(lb for lb in left if lb.startswith("torch")) == ["torch fp16 K=14336", "torch fp16 K=4096"]
    files = bench.sweep_plots(data, tmp_path)
    assert [pathlib.Path(f).name for f in files] == ["bench-hot.png", "bench-cold.png"]
    assert all(pathlib.Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)
    hot_only = {**data, "rows": [r for r in data["rows"] if not r["cold"]]}
    assert [pathlib.Path(f).name for f in bench.sweep_plots(hot_only, tmp_path / "h")] == ["bench-hot.png"]
    # perf_report.py --plots redraws the published pair from the JSON (how docs/perf's PNGs are made)
    pr = _load("perf_report")
    page = tmp_path / "performance.md"
    assert pr.main([str(ROOT / "docs/perf/profile-h100-512x4096x4096-hot.json"), "--bench", str(ROOT / "docs/perf/bench-h100.json"),
                    "--plots", str(tmp_path / "p"), "-o", str(page)]) == 0
    assert sorted(f.name for f in (tmp_path / "p").iterdir()) == ["bench-cold.png", "bench-hot.png"]
    assert "![bench hot](perf/bench-hot.png)" in page.read_text() and page.read_text().startswith("# Performance\n")
    # another device's page beside the published one (docs/performance-h200.md): its plots named
    # apart (the H100's are not overwritten), its title, and llama.cpp's figures of that device
    assert pr.main([str(ROOT / "docs/perf/profile-h200-512x4096x4096-hot.json"), "--bench", str(ROOT / "docs/perf/bench-h200.json"),
                    "--plots", str(tmp_path / "p"), "--plot-stem", "bench-h200", "--title", "Performance on the NVIDIA H200",
                    "-o", str(page)]) == 0
    assert sorted(f.name for f in (tmp_path / "p").iterdir()) == ["bench-cold.png", "bench-h200-cold.png",
                                                                   "bench-h200-hot.png", "bench-hot.png"]
    text = page.read_text()
    assert text.startswith("# Performance on the NVIDIA H200\n") and "![bench cold](perf/bench-h200-cold.png)" in text
    assert "perf/bench-hot.png" not in text and "ggml-test-backend-ops-perf-mul_mat-h200.txt" in text
    assert "| q4_0 | 1x4096x4096 | 6.23 | 4.0 |" in text  # llama.cpp's H200 figure (its H100 one is 6.40)


def test_another_devices_page_without_plots(tmp_path):
    """The page checks of the plot test above that need no matplotlib (an optional extra, absent in
    CI): another device's page has its title and that device's llama.cpp figures."""
    pr = _load("perf_report")
    page = tmp_path / "performance.md"
    assert pr.main([str(ROOT / "docs/perf/profile-h200-512x4096x4096-hot.json"), "--bench", str(ROOT / "docs/perf/bench-h200.json"),
                    "--title", "Performance on the NVIDIA H200", "-o", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Performance on the NVIDIA H200\n") and "ggml-test-backend-ops-perf-mul_mat-h200.txt" in text
    assert "| q4_0 | 1x4096x4096 | 6.23 | 4.0 |" in text  # llama.cpp's H200 figure (its H100 one is 6.40)


@pytest.mark.parametrize("path", sorted(TOOLS.glob("*.py")) + sorted((ROOT / "qgemm").glob("*.py")), ids=lambda p: p.name)
def test_docstring_examples_keep_their_line_continuations(path):
    """A command split over lines in a module docstring (`... \\` then the rest) must keep its
    backslashes in `__doc__`, which `--help` prints: in a plain string a backslash before the line
    break joins the lines (perf_report.py's and compare_paths.py's --help printed each command as one
    line with the backslashes gone); such a docstring is a raw string."""
    import ast

    tree = ast.parse(path.read_text())
    node = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    if node is None or not isinstance(node.value, ast.Constant) or not isinstance(node.value.value, str):
        return
    src = path.read_text().splitlines()[node.lineno - 1:node.end_lineno]
    # a source line ending in a backslash (`\\` escaped or `\` in a raw string) must stay a line
    # ending in one in the docstring's value
    split_in_source = sum(line.endswith("\\") for line in src)
    split_in_doc = sum(line.endswith("\\") for line in node.value.value.splitlines())
    assert split_in_doc == split_in_source, f"{path.name}: make the module docstring a raw string (r\"\"\"...)"


PERF = "docs/perf/"
PUBLISHED_PAGES = {  # each page and the perf_report command that makes it (perf_report's docstring)
    "docs/performance.md": [PERF + "profile-h100-512x4096x4096-hot.json", PERF + "profile-h100-512x4096x4096-cold.json",
                            "--bench", PERF + "bench-h100.json", "--sustained-bench", PERF + "bench-sustained-h100.json",
                            "--notes", "docs/performance-notes.md"],
    "docs/performance-h200.md": [PERF + "profile-h200-512x4096x4096-hot.json", PERF + "profile-h200-512x4096x4096-cold.json",
                                 "--bench", PERF + "bench-h200.json", "--plot-stem", "bench-h200",
                                 "--title", "Performance on the NVIDIA H200"],
}


@pytest.mark.parametrize("page", sorted(PUBLISHED_PAGES))
def test_published_performance_pages_are_the_tools_output(page, tmp_path):
    """The performance pages are never edited by hand: each is exactly what tools/perf_report.py
    makes from the JSON kept in docs/perf/ (and, for the H100's, docs/performance-notes.md), so an
    edit of the notes without regenerating the page, or a hand-edited figure, fails here."""
    pr = _load("perf_report")
    out = tmp_path / "page.md"
    assert pr.main([str(ROOT / a) if a.startswith("docs/") else a for a in PUBLISHED_PAGES[page]] + ["-o", str(out)]) == 0
    assert out.read_text() == (ROOT / page).read_text(), f"{page} differs from tools/perf_report.py's output: regenerate it"
    stem = dict(zip(PUBLISHED_PAGES[page], PUBLISHED_PAGES[page][1:])).get("--plot-stem", "bench")
    assert all((ROOT / PERF / f"{stem}-{tag}.png").is_file() for tag in ("hot", "cold"))  # the plots the page shows


def test_perf_report_plots_need_the_bench_json(tmp_path, capsys):
    """`--plots` draws from `--bench`'s JSON: without one (or with a path that is not there) it
    says so and fails before writing anything, whether matplotlib is installed or not."""
    pr = _load("perf_report")
    hot = str(ROOT / "docs/perf/profile-h100-512x4096x4096-hot.json")
    for extra in ([], ["--bench", str(tmp_path / "missing.json")]):
        assert pr.main([hot, *extra, "--plots", str(tmp_path / "p"), "-o", str(tmp_path / "page.md")]) == 1
        assert "--plots draws from the --bench JSON" in capsys.readouterr().err
        assert not (tmp_path / "p").exists() and not (tmp_path / "page.md").exists()


def test_sweep_measures_the_copy_bandwidth_before_and_after(monkeypatch):
    """The copy bandwidth moves by up to ~10% between runs on one GPU: the sweep measures it before
    and after its rows and reports the higher (a row's share of it is never flattered), with both
    figures in the JSON and the markdown."""
    copies = iter([2583e9, 2749e9])
    bench = _sweep_without_a_gpu(monkeypatch, lambda *a: next(copies))
    timed = []

    def time_matmul(fmt, m, n, k, cold, rng, weights, iters=30, packed=True, sustain_s=0.0, x_dtype="f32"):
        timed.append((fmt, m, k, cold))
        return _row(fmt, m, n, k, cold)

    monkeypatch.setattr(bench, "time_matmul", time_matmul)
    monkeypatch.setattr(bench, "read_ceiling", lambda nbytes, cold, iters=20, sustain_s=0.0: {
        "bytes": nbytes, "cold": cold, "independent_us": 0.5, "dependent_us": 0.8, "pdl": True})
    data = bench.sweep(ms=(1, 2), ks=(64,), n=32, fmts=("q4_0",), peers=False, settle_s=0.0)
    assert next(copies, None) is None and len(timed) == 4  # both measured, every row timed
    assert data["copy_bandwidth_runs_gbps"] == [2583.0, 2749.0] and data["copy_bandwidth_gbps"] == 2749.0
    assert "2749 GB/s (read + write) -- the higher of 2583 before the sweep and 2749 after it" in bench.sweep_markdown(data, "qgemm bench")


def test_sweep_idles_between_the_hot_and_cold_passes(monkeypatch):
    """The cold pass's first row (a ~4 µs decode op) ran at the clock the hot pass's prefill rows
    left (1380-1530 MHz in two published benches): the sweep idles `settle_s` once, after the last
    hot row and before the first cold one, and the report says so; a hot-only sweep never waits."""
    bench = _sweep_without_a_gpu(monkeypatch)
    events = []

    def time_matmul(fmt, m, n, k, cold, rng, weights, iters=30, packed=True, sustain_s=0.0, x_dtype="f32"):
        events.append(("cold" if cold else "hot", m))
        return _row(fmt, m, n, k, cold)

    monkeypatch.setattr(bench, "time_matmul", time_matmul)
    monkeypatch.setattr(bench, "read_ceiling", lambda nbytes, cold, iters=20, sustain_s=0.0: {
        "bytes": nbytes, "cold": cold, "independent_us": 0.5, "dependent_us": 0.8, "pdl": True})
    monkeypatch.setattr(bench.time, "sleep", lambda s: events.append(("sleep", s)))
    data = bench.sweep(ms=(1, 2), ks=(64,), n=32, fmts=("q4_0",), peers=False)
    assert events == [("hot", 1), ("hot", 2), ("sleep", bench.SETTLE_S), ("cold", 1), ("cold", 2)]
    assert data["settle_s"] == bench.SETTLE_S == 2.0
    assert "idled 2 s between the hot and the cold pass (`--settle`)" in bench.sweep_markdown(data, "qgemm bench")
    events.clear()
    data = bench.sweep(ms=(1,), ks=(64,), n=32, fmts=("q4_0",), peers=False, modes=(False,), settle_s=5.0)
    assert events == [("hot", 1)] and data["settle_s"] is None
    assert "--settle" not in bench.sweep_markdown(data, "qgemm bench")


def test_perf_report_judges_cold_decode_and_the_prefill_peers():
    """performance.md's tables for the issue's two other claims, from the bench JSON alone: M = 1
    cold rows as a share of the run's copy bandwidth (>= 85%), and the kernel alone at M >= 512
    against cuBLAS fp16 and cuBLASLt int8 (must beat both)."""
    pr = _load("perf_report")
    base = {"N": 4096, "K": 4096, "kernel": "w4a8.skinny", "matmul_us": 4.0}
    rows = [{**base, "fmt": "q4_0", "M": 1, "cold": True, "weight_gbps": 2200.0},  # 2200 / 2600 = 84.6%
            {**base, "fmt": "q8_0", "M": 1, "cold": True, "weight_gbps": 2300.0},  # 88.5%
            {**base, "fmt": "q4_0", "M": 1, "cold": False, "weight_gbps": 9000.0},  # hot: not judged
            {**base, "fmt": "q4_0", "M": 512, "cold": False, "kernel": "w4a16.wgmma_rs", "kernel_us": 26.0,
             "torch_fp16_us": 26.5, "torch_int_mm_us": 27.0, "torch_bf16_us": 25.0},
            {**base, "fmt": "q8_0", "M": 512, "cold": False, "kernel": "w8a16.wgmma_rs", "kernel_us": 28.0,
             "torch_fp16_us": 26.0, "torch_int_mm_us": 27.0},
            {**base, "fmt": "q4_0", "M": 256, "cold": False, "kernel_us": 9.0, "torch_fp16_us": 9.5, "torch_int_mm_us": 9.5}]
    data = {"copy_bandwidth_gbps": 2600.0, "rows": rows}
    cold = [ln for ln in pr.cold_decode_table(data) if ln.startswith("| q")]
    assert cold == ["| q4_0 | 1x4096x4096 | 4.00 | `w4a8.skinny` | 2200 | 84.6% | no (0.4 points short) |",
                    "| q8_0 | 1x4096x4096 | 4.00 | `w4a8.skinny` | 2300 | 88.5% | yes |"]
    peers = [ln for ln in pr.prefill_peer_table(data) if ln.startswith("| q")]
    assert peers == ["| q4_0 | 512x4096x4096 | `w4a16.wgmma_rs` | 26.0 | 26.5 | 27.0 | 25.0 | yes |",
                     "| q8_0 | 512x4096x4096 | `w8a16.wgmma_rs` | 28.0 | 26.0 | 27.0 | - | no (7.7% slower) |"]
    assert pr.cold_decode_table({**data, "rows": rows[2:]}) == [] and pr.prefill_peer_table({**data, "rows": rows[:3]}) == []


def test_perf_report_adds_the_targets_timed_llamacpps_way(tmp_path):
    """--sustained-bench: a `qgemm bench --sustain` run's target rows in their own section, judged
    like the main table, which now also counts its met targets; a bench.json that was not
    sustained is refused (it would be mislabelled)."""
    pr = _load("perf_report")
    env = {"device": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "driver": "1", "nvrtc": "13.0", "date": "today"}
    row = {"fmt": "q8_0", "M": 8, "N": 4096, "K": 4096, "cold": False, "matmul_us": 6.53, "kernel_us": 6.4,
           "kernel": "w8a16.skinny", "tflops": 0.1, "weight_gbps": 1.0}
    burst = {"environment": env, "copy_bandwidth_gbps": 2800.0, "rows": [row], "command": "qgemm bench"}
    sustained = {**burst, "rows": [{**row, "matmul_us": 6.31}], "sustain_s": 1.0, "command": "qgemm bench --sustain 1"}
    paths = {}
    for name, data in (("b", burst), ("s", sustained), ("plain", {**sustained, "sustain_s": 0.0})):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(data))
    prof = pathlib.Path(__file__).resolve().parents[1] / "docs" / "perf" / "profile-h100-512x4096x4096-hot.json"
    out = tmp_path / "perf.md"
    assert pr.main([str(prof), "--bench", str(paths["b"]), "--sustained-bench", str(paths["s"]), "-o", str(out)]) == 0
    text = out.read_text()
    main, _, sust = text.partition("## The targets timed llama.cpp's way (`qgemm bench --sustain 1`)")
    # 6.53 against 6.5: shown to three decimals where one would print the target itself beside a "no"
    assert "| q8_0 | 8x4096x4096 | 14.37 | 6.5 | 6.530 | `w8a16.skinny` | 2.20x faster | no (0.5% over) |" in main
    assert "0 of the 1 timing targets met in this run" in main
    assert "| q8_0 | 8x4096x4096 | 14.37 | 6.5 | 6.3 | `w8a16.skinny` | 2.28x faster | yes |" in sust
    assert "1 of the 1 timing targets met in this run" in sust and "back to back for at least 1 s (`--sustain`)" in sust
    assert pr.main([str(prof), "--sustained-bench", str(paths["plain"]), "-o", str(out)]) == 1
    assert pr.main([str(prof), "--sustained-bench", str(tmp_path / "none.json"), "-o", str(out)]) == 1


def test_cold_rotation_uses_every_set_and_whole_rotations(monkeypatch):
    """A cold sample runs at least one whole rotation through the buffer sets, in whole rotations:
    a slow kernel's sample of 2 launches over 5 sets had used only the first sets (L2-resident),
    and a partial rotation restarted the next sample on a set used a few launches before. The
    sets rotate more than twice the L2 up to a cap."""
    import types

    from qgemm import bench

    assert bench.round_batch(1, 1) == 1 and bench.round_batch(7, 1) == 7
    assert bench.round_batch(2, 5) == 5 and bench.round_batch(11, 5) == 15 and bench.round_batch(102, 11) == 110
    monkeypatch.setattr(bench.runtime, "device_info", lambda: types.SimpleNamespace(l2_bytes=50 * 2**20))
    for nbytes in (26_214_400, 9_437_184, 1_000_000):
        sets = bench.cold_sets(nbytes)
        assert sets * nbytes > 2 * 50 * 2**20 and (sets - 1) * nbytes <= 2 * 50 * 2**20 + nbytes, (nbytes, sets)
    assert bench.cold_sets(20_992) == bench._MAX_SETS  # too small to rotate 2x L2: capped (and marked in the report)


def test_perf_report_compares_with_naive_at_the_same_m_and_marks_l2_hot_rows():
    """Decode kernels run at their largest M: their speedup is not taken against a naive time at
    M = 512 (that read 1882x for w8a8.skinny); hot rows whose bytes fit the L2 say so (they pass
    100% of the DRAM copy rate); a cold row whose rotation stays under 2x L2 is marked."""
    import copy
    import json

    pr = _load("perf_report")
    root = pathlib.Path(__file__).parent.parent / "docs/perf"
    hot = json.loads((root / "profile-h100-512x4096x4096-hot.json").read_text())
    text = pr.section(hot)
    row = {ln.split(" | ")[0][2:].strip("`"): ln for ln in text.splitlines() if ln.startswith("| `")}
    assert row["w8a8.skinny"].split(" | ")[1] == "8" and row["w8a8.skinny"].endswith("| - |")
    assert row["w4a8.mma"].endswith("x |") and "L2-hot" in row["convert.f16"] and "L2-hot" in text
    cold = json.loads((root / "profile-h100-512x4096x4096-cold.json").read_text())
    cold = copy.deepcopy(cold)
    cold["results"][0].setdefault("extra", {})["rotation_bytes"] = 10**6
    text = pr.section(cold)
    assert f"`{cold['results'][0]['kernel']}` †" in text and "not fully cold" in text and "(memory, L2-hot)" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("dependent", [False, True])
def test_stream_read_reads_every_byte(rng, dependent):
    """The read-ceiling kernel on the GPU: each CTA's XOR of its slice matches the host's, for
    sizes that split unevenly across CTAs and threads (so no byte is skipped or read twice), and
    read_ceiling gives finite times whose GB/s a 4 MB buffer can physically reach."""
    import numpy as np

    from qgemm import bench, runtime

    mod = bench._stream_read(dependent)
    for nbytes, grid, threads in ((16 * 1000003, 132, 256), (16 * 777, 7, 512), (16, 3, 256), (16 * 4096, 264, 512)):
        host = rng.integers(0, 2**32, nbytes // 4, dtype=np.uint32)
        buf = runtime.DeviceArray.from_host(host)
        out = runtime.DeviceArray.from_host(np.full(grid, 0xDEADBEEF, np.uint32))
        mod.launch("stream_read", (grid, 1, 1), (threads, 1, 1), 0, (np.uint64(buf.ptr), np.uint64(nbytes // 16),
                                                                      np.uint64(out.ptr)), pdl=True)
        got = out.to_host()
        per = -(-(nbytes // 16) // grid) * 4  # uint32 words per CTA
        want = [np.bitwise_xor.reduce(host[b * per:(b + 1) * per]) if b * per < host.size else 0 for b in range(grid)]
        assert got.tolist() == [int(w) for w in want], (nbytes, grid, threads)
        buf.free(), out.free()
    r = bench.read_ceiling(4 << 20, cold=False, iters=5)
    for key in ("independent_us", "dependent_us"):
        assert 0 < r[key] < 1e4 and (4 << 20) / r[key] / 1e3 < 50_000, r  # under 50 TB/s: the bytes were read


# ---------------------------------------------------------------------------------------------
# tools/api_doc.py: docs/api.md, the API reference generated from the code

_API_PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_pytorch_doc_host_time_tables_are_the_tools():
    """docs/pytorch.md's host-time tables are tools/host_overhead.py's renderings of the committed
    runs they name (docs/perf/host-overhead-*.json), not numbers typed by hand."""
    import json
    import re

    ho = _load("host_overhead")
    root = pathlib.Path(__file__).resolve().parents[1]
    page = (root / "docs" / "pytorch.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- host-overhead table: (\S+) (gemm|kvcache) -->\n(.*?)<!-- end host-overhead table -->",
                        page, re.S)
    assert len(blocks) == 6, "the gemm and kvcache tables of the current run and of the two runs before"
    for path, suite, body in blocks:
        data = json.loads((root / path).read_text())
        assert body == ho.markdown(data, suite), (path, suite)
        forms = {r["form"] for r in data["rows"] if r.get("suite", "gemm") == suite}
        assert body.count("\n") == 2 + len(forms) and ("F.linear" in body or "bmm" in body)
        assert data["device"] in page and (data["date"] in page or data["date"][:10] in page)


def test_api_doc_matches_the_code():
    """The committed docs/api.md is what tools/api_doc.py generates from the code as it is."""
    import difflib

    ad = _load("api_doc")
    want, have = ad.render(), _API_PAGE.read_text(encoding="utf-8")
    diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "docs/api.md", "generated"))[:60])
    assert have == want, f"docs/api.md is stale: run `python tools/api_doc.py -o docs/api.md`\n{diff}"


def test_api_doc_covers_the_public_api(monkeypatch):
    """Every name of qgemm.__all__ has an entry, every documented function, class, method and
    property has a docstring of its own, and a public name the page does not cover (in
    qgemm.__all__, or defined in qgemm.kvcache and not listed as a helper) stops the generator."""
    import qgemm

    ad = _load("api_doc")
    text = ad.render()
    assert [n for n in qgemm.__all__ if f"\n### `qgemm.{n}`\n" not in text] == []
    documented = [name for name, _, _ in ad.build().documented]
    for name in ("qgemm.matmul", "qgemm.Kernel.__call__", "qgemm.DeviceArray.to_host", "qgemm.kvcache.scores",
                 "qgemm.kvcache.CompressedKV.to_device", "qgemm.reference.exact_w4a8", "qgemm.UnknownNameError"):
        assert name in documented, name
    assert ad.missing_docstrings() == [], "write a docstring for these (then regenerate docs/api.md)"
    assert "*(no docstring)*" not in text

    monkeypatch.setattr(qgemm, "undocumented_probe", lambda: None, raising=False)
    monkeypatch.setattr(qgemm, "__all__", [*qgemm.__all__, "undocumented_probe"])
    with pytest.raises(SystemExit, match=r"qgemm\.undocumented_probe \(in qgemm\.__all__\)"):
        ad.render()
    monkeypatch.undo()
    monkeypatch.setattr(ad, "KVCACHE_HELPERS", tuple(n for n in ad.KVCACHE_HELPERS if n != "to_tiles"))
    with pytest.raises(SystemExit, match=r"qgemm\.kvcache\.to_tiles"):
        ad.render()


def test_api_doc_check_fails_on_a_stale_page(tmp_path):
    """`--check FILE` exits 0 on the page `-o` writes and 1, with a unified diff, on a stale one."""
    tool = [sys.executable, str(TOOLS / "api_doc.py")]
    fresh = tmp_path / "api.md"
    subprocess.run([*tool, "-o", str(fresh)], check=True, capture_output=True)
    assert subprocess.run([*tool, "--check", str(fresh)], capture_output=True, text=True).returncode == 0
    stale = tmp_path / "stale.md"
    stale.write_text(fresh.read_text(encoding="utf-8").replace("### `qgemm.matmul`\n", "### `qgemm.matmul_v0`\n", 1),
                     encoding="utf-8")
    r = subprocess.run([*tool, "--check", str(stale)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "\n-### `qgemm.matmul_v0`\n+### `qgemm.matmul`\n" in r.stdout and r.stdout.startswith(f"--- {stale}")
    assert "python tools/api_doc.py -o" in r.stderr
    # a mistyped path: said so, not a diff of the whole page against nothing
    r = subprocess.run([*tool, "--check", str(tmp_path / "missing.md")], capture_output=True, text=True)
    assert r.returncode == 1 and "missing.md: no such file" in r.stderr and r.stdout == ""


def test_compare_paths_parses_shapes_and_paths():
    cp = _load("compare_paths")
    assert cp.parse_shape("8x4096x14336") == (8, 4096, 14336, False)
    assert cp.parse_shape("1x4096x4096@cold") == (1, 4096, 4096, True)
    for bad in ("8x4096", "0x4096x4096", "1x4096x4096@hot", "ax1x1"):
        with pytest.raises(SystemExit):
            cp.parse_shape(bad)
    assert cp.parse_paths("default,blocks@f16,w4a16.wgmma", ["f32", "bf16"]) == [
        ("default", ["f32", "bf16"]), ("blocks", ["f16"]), ("w4a16.wgmma", ["f32", "bf16"])]
    assert cp.parse_paths("default@f16+bf16", ["f32"]) == [("default", ["f16", "bf16"])]
    for bad in ("default@fp8", "@f16", ","):
        with pytest.raises(SystemExit):
            cp.parse_paths(bad, ["f32"])
    with pytest.raises(SystemExit, match="--x-dtypes"):
        cp.main(["--shapes", "1x64x64", "--x-dtypes", "f32,int8"])


def test_compare_paths_markdown_ranges_and_kernels():
    cp = _load("compare_paths")
    rows = []
    for rep, (a, b) in enumerate([(3.381, 5.55), (3.472, 5.73)]):
        rows.append(dict(shape="1x4096x4096", fmt="q4_0", path="default", x_dtype_asked="f32", matmul_us=a,
                         kernels="w4a8.skinny"))
        rows.append(dict(shape="1x4096x4096", fmt="q4_0", path="blocks", x_dtype_asked="f16", matmul_us=b,
                         kernels="quantize.q8_1_f16 + w4a8.gemv"))
    rows.append(dict(shape="1x4096x4096@cold", fmt="q4_0", path="default", x_dtype_asked="f32", matmul_us=4.03,
                     kernels="w4a8.skinny"))
    text = cp.markdown(rows, {"device": "GPU X", "date": "D"}, "python tools/compare_paths.py --shapes s")
    lines = text.splitlines()
    assert lines[0] == "GPU X, D, `python tools/compare_paths.py --shapes s`"
    assert lines[2] == "| MxNxK | type | matmul, float32 x µs | ggml blocks, float16 x µs |"
    assert lines[4] == "| 1x4096x4096 | q4_0 | 3.38-3.47 | 5.55-5.73 |"
    assert lines[5] == "| 1x4096x4096 cold | q4_0 | 4.03 | - |"  # one repeat, and no blocks cell
    assert "| 1x4096x4096 | q4_0 | `w4a8.skinny` | `quantize.q8_1_f16 + w4a8.gemv` |" in lines


def test_compare_paths_lists_where_16_bit_activations_are_slower():
    """Half the activation bytes should never take longer: the markdown lists the cells where a
    16-bit type was slower than float32 x on the same shape, format and path by more than the gap,
    by the minima over the repeats (session 57's check)."""
    cp = _load("compare_paths")

    def row(shape, xd, us, fmt="q4_0", path="default"):
        return dict(shape=shape, fmt=fmt, path=path, x_dtype_asked=xd, matmul_us=us, kernels="k")
    rows = [row("1x14336x4096", "f32", 10.43), row("1x14336x4096", "f32", 10.60), row("1x14336x4096", "f16", 13.15),
            row("1x14336x4096", "bf16", 10.80),  # 3.5%: under the 4% gap
            row("16x6144x4096@cold", "f32", 9.39), row("16x6144x4096@cold", "f16", 12.60), row("16x6144x4096@cold", "f16", 12.46),
            row("4x4096x4096", "f32", 6.0, fmt="q8_0"), row("4x4096x4096", "f16", 5.8, fmt="q8_0"),  # faster
            row("2x4096x4096", "f16", 9.0, path="blocks")]  # no float32 cell beside it
    lines = cp.type_gaps(rows)
    assert lines[1] == "16-bit activations slower than float32 x on the same weights by more than 4% (minima):"
    assert lines[5:] == ["| 1x14336x4096 | q4_0 | default | float16 x | 13.15 | 10.43 | 1.261 |",
                         "| 16x6144x4096 cold | q4_0 | default | float16 x | 12.46 | 9.39 | 1.327 |"]
    assert len(cp.type_gaps(rows, gap=0.03)) == 8  # bfloat16's 3.5% too
    assert cp.type_gaps(rows, gap=0.5) == [] and cp.type_gaps(rows[:2]) == []
    text = cp.markdown(rows, {"device": "GPU X", "date": "D"}, "c")
    assert "| 16x6144x4096 cold | q4_0 | default | float16 x | 12.46 | 9.39 | 1.327 |" in text
    assert text.index("slower than float32") < text.index("Kernels run:")
    with pytest.raises(SystemExit, match="--gap must be a fraction"):
        cp.main(["--shapes", "1x64x64", "--gap", "-1"])


def test_run_tool_turns_what_a_user_can_fix_into_one_line():
    """tools/*.py end in `sys.exit(run_tool(main, NAME))`: no GPU, a bad name or a bad file is one
    line and exit 2 (1 for a file that could not be written); a bug keeps its traceback."""
    from qgemm import errors

    def raises(e):
        def main():
            raise e
        return main

    assert errors.run_tool(lambda: 0, "t") == 0
    assert errors.run_tool(raises(errors.NoGPUError("no GPU here")), "t") == 2
    assert errors.run_tool(raises(ValueError("bad shape")), "t") == 2
    assert errors.run_tool(raises(FileNotFoundError("x.csv")), "t") == 2
    assert errors.run_tool(raises(PermissionError("read-only")), "t") == 1
    with pytest.raises(ZeroDivisionError):
        errors.run_tool(raises(ZeroDivisionError("a bug")), "t")


@pytest.mark.parametrize("argv,said", [
    (["probe_defines.py", "mustafar.key_q2", "1x4096x4096", "base"], "tools/kv_probe.py times it"),
    (["probe_defines.py", "w4a16.skinny", "1x4096", "base"], "shape must be MxNxK"),
    (["probe_defines.py", "w4a16.skinny", "1x4096x4096", "base", "f=@nosuch"], "no kernel named 'nosuch'"),
    (["kv_probe.py", "w4a16.skinny", "32x16384x128", "base"], "is not a mustafar.* kernel"),
    (["kv_probe.py", "mustafar.key_q2", "32x16384x96", "base"], "head dim D must be one of"),
    (["pdl_probe.py", "8x4096x4096:q5_0"], "must be q4_0 or q8_0"),
    (["compare_paths.py", "--shapes", "1x4096x4096", "--fmts", "q4_0", "--paths", "w8a16.skinny"], "it would time nothing"),
    (["compare_paths.py", "--shapes", "1x4096x4096", "--json", "/nonexistent/x.json"], "not a writable directory"),
    (["sweep_order.py", "--shapes", "1x2"], "shape must be MxNxK"),
    (["precompile.py", "w4a8.naive", "--shapes", "1x64x64", "--arch", "sm_99"], "sm_99 is not supported"),
    (["precompile.py", "mustafar.key_q2", "--shapes", "1x64x64", "--arch", "sm_90"], "is a mustafar.* kernel"),
    (["api_doc.py", "--check", "/nonexistent.md"], "no such file"),
    (["perf_report.py", "docs/perf/profile-h100-512x4096x4096-hot.json", "--bench", "docs/perf/bench-h10.json"],
     "--bench docs/perf/bench-h10.json does not exist"),
    (["host_overhead.py", "--table", "docs/perf/bench-h100.json"], "not a host_overhead.py --json file"),
    (["ncu_source_top.py", "/nonexistent.csv"], "No such file"),
    (["repack_probe.py", "--ms", "1,a"], "--ms / --ks must be comma-separated integers"),
    (["quant_speed.py", "--shape", "4096"], "--shape must be NxK"),
    (["fold_error.py", "--groups", "32,x"], "--groups must be comma-separated integers"),
    (["fold_error.py", "--groups", "48"], "every G a multiple of 32 dividing K"),
    (["quant_speed.py", "--shape", "4096x4100"], "K a positive multiple of 32"),
    (["sanitize_configs.py", "racecheck", "w4a16.wgmma_rs", "--shapes", "7x33x32", "--sanitizer", "/nonexistent/cs"],
     "no compute-sanitizer at /nonexistent/cs"),
    (["sanitize_configs.py", "racecheck", "w4a16.wgmma_rs", "--shapes", "7x33x32", "-D", "RS_WS", "--sanitizer", "/bin/true"],
     "-D 'RS_WS': expected KEY=INT"),
    (["sanitize_configs.py", "racecheck", "mustafar.key_q2", "--shapes", "7x33x32", "--sanitizer", "/bin/true"],
     "mustafar.key_q2 is not a GEMM kernel"),
    (["sanitize_configs.py", "memcheck", "w4a16.wgmma_rs", "--shapes", "7x33", "--sanitizer", "/bin/true"], "shape must be MxNxK"),
    (["sanitize_configs.py", "memcheck", "w4a16.wgmma_rs", "--shapes", "7x33x32", "--sanitizer", "/bin/true", "--jobs", "0"],
     "--jobs must be at least 1"),
    (["plan_diff.py", "--old", "/nonexistent"], "/nonexistent holds no qgemm package"),
    (["plan_diff.py", "--old", ".", "--m", "0"], "--m takes positive integers"),
    (["plan_diff.py", "--old", ".", "--m", "9-1"], "--m takes positive integers"),
    (["plan_diff.py", "--old", ".", "--m", "1-9:x"], "the step after ':' must be a positive integer"),
    (["plan_diff.py", "--old", ".", "--fmts", "q5_0"], "--fmts takes q4_0 and / or q8_0"),
    (["plan_diff.py", "--old", ".", "--x-dtypes", "f64"], "--x-dtypes takes f32, f16 and / or bf16"),
    (["plan_diff.py", "--old", ".", "--k", "100"], "K must be a multiple of 32"),
    (["plan_diff.py", "--old", ".", "--arch", "sm_99"], "sm_99 is not supported"),
    (["plan_diff.py", "--old", ".", "--json", "/nonexistent/x.json"], "not a writable directory"),
    (["ab_report.py", "--old", "/nonexistent.json", "--new", "/nonexistent.json"], "--old: cannot read /nonexistent.json"),
    (["ab_report.py", "--old", ",", "--new", "x.json"], "--old and --new each name at least one JSON file"),
    (["ab_report.py", "--old", "docs/perf/bench-h100.json", "--new", "docs/perf/bench-h100.json"],
     "lacks shape, x_dtype_asked, path: expected tools/compare_paths.py rows"),
    (["ab_report.py", "--old", "README.md", "--new", "README.md"], "--old: README.md is not JSON"),
    (["ab_report.py", "--old", "x.json", "--new", "x.json", "--markdown", "/nonexistent/ab.md"], "not a writable directory"),
])
def test_tools_say_what_is_wrong_in_one_line(argv, said):
    """A tools/ audit (session 47): each of these printed a traceback, crashed later with an unrelated
    error, or timed nothing and exited 0. Now: a non-zero exit and one line that says what to fix
    (before any GPU is needed, where the input is wrong)."""
    r = subprocess.run([sys.executable, str(TOOLS / argv[0]), *argv[1:]], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert said in r.stderr + r.stdout and "Traceback" not in r.stderr, r.stderr


def test_check_scripts_fail_when_they_would_run_nothing(tmp_path):
    """gpu_check_kvcache.sh said PASS for a misspelt step, an unknown bench setting or `ab` without
    its old tree; gpu_ncu.sh returned its last grep's status whatever ncu did."""
    env = {**os.environ, "OUT": str(tmp_path / "kv")}
    for extra, said in (({"QGEMM_KV_STEPS": "bogus"}, "unknown step bogus"),
                        ({"QGEMM_KV_STEPS": "ab"}, "step ab needs QGEMM_KV_OLD_SRC"),
                        ({"QGEMM_KV_STEPS": "bench", "QGEMM_KV_BENCH": "fast"}, "QGEMM_KV_BENCH must be quick, full or none")):
        r = subprocess.run(["bash", str(TOOLS / "gpu_check_kvcache.sh")], capture_output=True, text=True,
                           env={**env, **extra}, timeout=60)
        assert r.returncode == 1 and said in r.stdout and "gpu_check_kvcache: FAIL" in r.stdout, r.stdout
    # gpu_check.sh's sanitize step: a missing sanitizer, a misspelt job, and a "sanitizer" that
    # runs nothing (exit 0 without a summary) each fail the step
    for extra, said in (({"SANITIZER": "/nonexistent/cs"}, "no compute-sanitizer at /nonexistent/cs"),
                        ({"SANITIZER": "/bin/true", "QGEMM_SAN_JOBS": "memcheck:pack"}, "no sanitizer summary in the log"),
                        ({"SANITIZER": "/bin/true", "QGEMM_SAN_JOBS": "bogus:refs-edu"}, "unknown sanitizer tool in bogus:refs-edu"),
                        ({"SANITIZER": "/bin/true", "QGEMM_SAN_JOBS": "memcheck:nope"}, "unknown sanitize part in memcheck:nope")):
        r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "OUT": str(tmp_path / "san"), "QGEMM_CHECK": "sanitize",
                                "QGEMM_CHECK_WITHOUT_GPU": "1", **extra})
        assert r.returncode == 1 and said in r.stdout and "gpu_check: FAIL" in r.stdout, r.stdout
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    r = subprocess.run(["bash", str(TOOLS / "gpu_ncu.sh")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NCU": str(fake), "OUT": str(tmp_path / "ncu"), "KERNELS": "w4a8.naive",
                            "SHAPE": "1x64x64", "QGEMM_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 1 and "!! w4a8.naive" in r.stderr, (r.stdout, r.stderr)


def test_sanitize_configs_plans_every_configuration(tmp_path, monkeypatch, capsys):
    """tools/sanitize_configs.py's plan, without a GPU (the GPU and the sanitizer stood in for):
    the untuned default plus every candidate once per shape, -D on each, shapes above a kernel's
    most tokens skipped and said, --defaults-only one per shape; a flagged run exits 1."""
    import types

    import qgemm
    from qgemm import runtime

    mod = _load("sanitize_configs")
    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(runtime, "device_info", lambda: types.SimpleNamespace(sm_count=132))

    def stand_in(rc):  # prints what a child would, with the arguments it was given
        f = tmp_path / f"cs{rc}"
        f.write_text(f'#!/bin/sh\necho "RESULT ok rel 0.00e+00 seed 1 $*"\necho "========= ERROR SUMMARY: 0 errors"\nexit {rc}\n')
        f.chmod(0o755)
        return str(f)

    def run(*args, rc=0):
        monkeypatch.setattr(sys, "argv", ["sanitize_configs.py", "memcheck", "w4a8.skinny", "w4a8.mma", "--shapes",
                                          "7x33x64,9x40x96", "--sanitizer", stand_in(rc), "--jobs", "3", *args])
        status = mod.main()
        return status, [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("clean", "FLAGGED"))]

    def count(name, shape, defaults_only=False):
        spec, (m, n, k) = qgemm.spec(name), map(int, shape.split("x"))
        seen = []
        for d in [spec.config(m, n, k, 132)] + ([] if defaults_only else spec.candidates(m, n, k)):
            seen += [d] if d not in seen else []
        return len(seen)

    want = count("w4a8.skinny", "7x33x64") + count("w4a8.mma", "7x33x64") + count("w4a8.mma", "9x40x96")
    status, rows = run("-D", "SAN_PROBE=5")
    assert status == 0 and len(rows) == want > 3, rows
    assert all('"SAN_PROBE": 5' in ln and "SAN_PROBE=5" in ln for ln in rows)
    assert not any("w4a8.skinny 9x40x96" in ln for ln in rows)  # M = 9 > the int8 skinny kernels' 8
    assert run("--defaults-only")[1].__len__() == 3
    status, rows = run(rc=86)
    assert status == 1 and len(rows) == want and all(ln.startswith("FLAGGED") for ln in rows)
    # the child judges a launch by its op's own tolerance (5e-5 for the fp16 tensor-core kernels), as
    # qgemm tune does, not by one fixed for every kernel: a stand-in launch off by 2e-5 passes there,
    # 1e-4 does not, and an output left unwritten (NaN) never does
    import numpy as np

    from qgemm import check as qcheck

    assert qgemm.get("w4a16.mma").op.exact_tol == 5e-5
    for off, want_rc in ((2e-5, 0), (1e-4, mod.WRONG), (np.nan, mod.WRONG)):
        def launch_off_by(kern, inp, m, n, k, defines=None, off=off):
            out = kern.op.exact(inp.a, inp.w) * (1 + off)
            out[0, 0] = np.nan if np.isnan(off) else out[0, 0]
            return out
        monkeypatch.setattr(qcheck, "run_poisoned", launch_off_by)
        assert mod.run_one("w4a16.mma", "7x33x64", "{}", "5") == want_rc, off


@pytest.mark.gpu
def test_sanitize_configs_gives_every_configuration_a_line(tmp_path):
    """tools/sanitize_configs.py under stand-ins for compute-sanitizer (run the program, then print a
    summary and exit with the given status): every (shape, configuration) once, each launch checked
    against the exact reference; a flagged configuration, or a "sanitizer" that prints no summary,
    fails the run."""
    import qgemm

    def stand_in(name, rc, summary=True):
        f = tmp_path / name
        f.write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift 2; done\n"$@" || exit $?\n'
                     + ('echo "========= ERROR SUMMARY: 0 errors"\n' if summary else "") + f"exit {rc}\n")
        f.chmod(0o755)
        return str(f)

    spec = qgemm.spec("w4a8.mma")
    expected = {(shape, json.dumps(d, sort_keys=True)) for shape in ("7x33x64", "9x40x96")
                for d in [spec.config(*map(int, shape.split("x")), qgemm.runtime.device_info().sm_count)]
                + spec.candidates(*map(int, shape.split("x")))}
    tool = [sys.executable, str(TOOLS / "sanitize_configs.py"), "memcheck", "w4a8.mma", "--shapes", "7x33x64,9x40x96",
            "--jobs", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([*tool, "--sanitizer", stand_in("clean", 0), "--log-dir", str(tmp_path / "logs"), "--seed", "7"],
                       capture_output=True, text=True, timeout=600, env=env)
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith(("clean", "FLAGGED", "WRONG", "TIMED", "UNCHECKED", "FAILED"))]
    assert r.returncode == 0 and len(rows) == len(expected), r.stdout + r.stderr
    assert all(ln.startswith("clean") and "| ok rel" in ln and ln.endswith("seed 7") for ln in rows), r.stdout
    assert f"{len(expected)} of {len(expected)} clean and correct under memcheck" in r.stdout
    assert len(list((tmp_path / "logs").iterdir())) == len(expected)
    r = subprocess.run([*tool, "--sanitizer", stand_in("flags", 86)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 1 and r.stdout.count("FLAGGED ") == len(expected), r.stdout
    r = subprocess.run([*tool, "--sanitizer", stand_in("silent", 0, summary=False)], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 1 and r.stdout.count("UNCHECKED ") == len(expected), r.stdout


def test_plan_diff_shows_what_a_change_moves(tmp_path):
    """tools/plan_diff.py (session 52): the plans of two trees over a grid, and where they differ as
    runs of M with only the #defines that changed. A copy of this tree with one default altered (the
    up-to-64-token wgmma_rs stages) must show exactly that change, at every M of the grid's branch
    and nowhere else; this tree against itself must show nothing."""
    import shutil

    old = tmp_path / "old"
    for part in ("qgemm", "cuda_src"):
        shutil.copytree(ROOT / part, old / part, ignore=shutil.ignore_patterns("__pycache__"))
    reg = old / "qgemm" / "registry.py"
    text = reg.read_text()
    marker = 'd = {"RS_BN": 64, "RS_WGS": 1, "RS_STAGES": 4, "RS_MINB": 1, "RS_WS": int(k >= 8192)}'
    assert text.count(marker) == 1
    reg.write_text(text.replace(marker, marker.replace('"RS_STAGES": 4', '"RS_STAGES": 3')))
    tool = [sys.executable, str(TOOLS / "plan_diff.py"), "--m", "1,16-20,64,65", "--n", "4096", "--k", "4096",
            "--fmts", "q4_0", "--x-dtypes", "f32", "--json", str(tmp_path / "d.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([*tool, "--old", str(old)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # 17-20 and 64 take the branch (M = 16 another kernel, 65 the next branch): one run of the grid's
    # neighbours per weights, its five M named
    assert lines[0] == "10 of 16 plans changed (sm_90, 132 SMs)", r.stdout
    assert lines[1:] == [f"N=4096 K=4096 q4_0 {w} f32  M 17-64 (5 of the grid's M): w4a16.wgmma_rs: RS_STAGES 3 -> 4"
                         for w in ("blocks", "packed")], r.stdout
    assert json.loads((tmp_path / "d.json").read_text()) == {"plans": 16, "changed": lines[1:]}
    same = subprocess.run([*tool, "--old", str(ROOT)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert same.returncode == 0 and same.stdout.splitlines() == ["0 of 16 plans changed (sm_90, 132 SMs)"], same.stdout


def test_plan_diff_runs_are_grid_neighbours():
    """plan_diff's runs join M only where they follow each other in the grid and change alike: a gap
    in the grid's changed M, or another change, starts a new run."""
    spec = importlib.util.spec_from_file_location("plan_diff", TOOLS / "plan_diff.py")
    pd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pd)
    ms = [1, 2, 3, 5, 8, 9, 10]
    got = pd.runs([(9, "a"), (1, "a"), (2, "a"), (5, "a"), (3, "b"), (10, "a")], ms)
    assert got == [(1, 2, 2, "a"), (3, 3, 1, "b"), (5, 5, 1, "a"), (9, 10, 2, "a")]
    before, after = ["w4a16.skinny", {"SK_R": 4, "SK_WARPS": 8}], ["w4a16.skinny", {"SK_R": 2, "SK_WARPS": 8, "SK_ACC": 2}]
    assert pd.change(before, after) == "w4a16.skinny: SK_ACC - -> 2, SK_R 4 -> 2"
    assert pd.change(before, ["w4a16.mma", {"MMA_BM": 64}]) == "w4a16.skinny SK_R=4 SK_WARPS=8 -> w4a16.mma MMA_BM=64"
    old = {"5x64x64 q4_0 packed f32": before, "8x64x64 q4_0 packed f32": before, "9x64x64 q4_0 packed f32": before}
    new = {"5x64x64 q4_0 packed f32": after, "8x64x64 q4_0 packed f32": after, "9x64x64 q4_0 packed f32": before}
    assert pd.diff(old, new, ms) == ["N=64 K=64 q4_0 packed f32  M 5-8 (2 of the grid's M): w4a16.skinny: SK_ACC - -> 2, SK_R 4 -> 2"]



def _ab_row(shape, fmt, us, split, cold=False, path="default", x="f32"):
    """One row as tools/compare_paths.py writes it (the fields ab_report reads, and a few more)."""
    return {"shape": shape, "M": 1, "N": 1, "K": 32, "fmt": fmt, "cold": cold, "x_dtype": x, "x_dtype_asked": x,
            "path": path, "kernel": "w4a16.wgmma_rs", "config": {"RS_BN": 128, "RS_SPLITK": split}, "matmul_us": us,
            "kernel_us": us - 5, "repeat": 0}


def test_ab_report_tabulates_two_trees(tmp_path):
    """tools/ab_report.py (session 53): min-max per side over its files, new / old of the minima,
    the #defines that moved, "same" where none did, "-" for a row one tree did not time, and a
    default that moved within one side (another GPU's SM count, a tuned cache) named as such."""
    ab = _load("ab_report")
    old = [_ab_row("300x4096x14336", "q4_0", 86.0, 1), _ab_row("512x4096x14336", "q4_0", 96.0, 1),
           _ab_row("300x4096x14336@cold", "q4_0", 89.0, 1, cold=True)]
    old2 = [_ab_row("300x4096x14336", "q4_0", 87.4, 1), _ab_row("512x4096x14336", "q4_0", 96.2, 1),
            _ab_row("300x4096x14336@cold", "q4_0", 89.3, 1, cold=True)]
    new = [_ab_row("300x4096x14336", "q4_0", 77.8, 4), _ab_row("512x4096x14336", "q4_0", 95.8, 1),
           _ab_row("300x4096x14336@cold", "q4_0", 81.7, 4, cold=True), _ab_row("1x4096x4096", "q8_0", 4.5, 1)]
    new2 = [_ab_row("300x4096x14336", "q4_0", 78.3, 4), _ab_row("512x4096x14336", "q4_0", 96.2, 2),
            _ab_row("300x4096x14336@cold", "q4_0", 82.1, 4, cold=True)]
    files = {}
    for name, rows in (("o1", old), ("o2", old2), ("n1", new), ("n2", new2)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({"env": {}, "command": "c", "rows": rows}))
    md = tmp_path / "ab.md"
    assert ab.main(["--old", f"{files['o1']},{files['o2']}", "--new", f"{files['n1']},{files['n2']}",
                    "--markdown", str(md)]) == 0
    lines = md.read_text().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ") and not line.startswith("| shape")]
    rows = {(c[0], c[1]): tuple(c[2:]) for c in cells}
    assert rows[("300x4096x14336", "q4_0")] == ("f32", "default", "86.00-87.40", "77.80-78.30", "0.905", "RS_SPLITK 1 -> 4")
    assert rows[("300x4096x14336 cold", "q4_0")][2:] == ("89.00-89.30", "81.70-82.10", "0.918", "RS_SPLITK 1 -> 4")
    assert rows[("1x4096x4096", "q8_0")][2:] == ("-", "4.50", "-", "-")
    assert rows[("512x4096x14336", "q4_0")][5].startswith("plans vary within a side")
    same = ab.table([_ab_row("s", "q4_0", 10.0, 2)], [_ab_row("s", "q4_0", 9.0, 2)])
    assert same[0][-2:] == (0.9, "same")


def test_gpu_check_ab_step_alternates_the_trees(tmp_path):
    """tools/gpu_check.sh's step `ab` (session 53), with a stand-in python that records its calls and
    writes each tree's compare_paths JSON: both trees precompiled, then old, new, old, new, each run
    in its own directory with only its own qgemm importable, then tools/ab_report.py's table. And
    the step refuses to run without an old tree or shapes."""
    old = tmp_path / "old"
    (old / "qgemm").mkdir(parents=True)
    (old / "tools").mkdir()
    (old / "qgemm" / "__init__.py").write_text("")
    (old / "tools" / "compare_paths.py").write_text("")
    for side, us, split in (("old", 86.0, 1), ("new", 77.8, 4)):
        (tmp_path / f"{side}.json").write_text(json.dumps({"rows": [_ab_row("300x4096x14336", "q4_0", us, split)]}))
    calls = tmp_path / "calls"
    fake = tmp_path / "py"
    fake.write_text(f"""#!/bin/sh
echo "$(pwd)|$PYTHONPATH|$*" >> {calls}
case "$*" in
  *tools/compare_paths.py*)
    out=$(printf '%s\\n' "$@" | sed -n '/^--json$/{{n;p;}}')
    side=new; [ "$(pwd)" = "{old}" ] && side=old
    cp {tmp_path}/$side.json "$out" ;;
  *tools/ab_report.py*) exec {sys.executable} "$@" ;;
esac
exit 0
""")
    fake.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(fake), "QGEMM_CHECK": "ab"}
    r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                       env={**env, "QGEMM_AB_OLD": str(old), "QGEMM_AB_SHAPES": "300x4096x14336,300x4096x14336@cold"})
    assert r.returncode == 0 and "gpu_check: PASS" in r.stdout, r.stdout + r.stderr
    seen = [line.split("|") for line in calls.read_text().splitlines() if "tools/" in line]
    work = [(cwd, pp, args.split()[0]) for cwd, pp, args in seen]
    assert work[:2] == [(str(old), str(old), "tools/precompile.py"), (str(ROOT), str(ROOT), "tools/precompile.py")]
    assert "--shapes 300x4096x14336,300x4096x14336 " in seen[0][2] + " "  # @cold stripped for compiling
    assert [(cwd, pp) for cwd, pp, tool in work[2:6]] == [(str(old), str(old)), (str(ROOT), str(ROOT))] * 2
    assert all(tool == "tools/compare_paths.py" for _, _, tool in work[2:6]) and work[6][2] == "tools/ab_report.py"
    assert all("--fmts q4_0,q8_0 " in args for _, _, args in seen[2:6])  # both formats unless told
    table = (tmp_path / "out" / "ab.md").read_text()
    assert "| 300x4096x14336 | q4_0 | f32 | default | 86.00 | 77.80 | 0.905 | RS_SPLITK 1 -> 4 |" in table
    calls.unlink()
    r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                       env={**env, "QGEMM_AB_OLD": str(old), "QGEMM_AB_SHAPES": "16x5120x4096", "QGEMM_AB_FMTS": "q4_0"})
    assert r.returncode == 0 and "gpu_check: PASS" in r.stdout, r.stdout + r.stderr
    runs = [args for _, _, args in (line.split("|") for line in calls.read_text().splitlines()) if "compare_paths" in args]
    assert len(runs) == 4 and all("--fmts q4_0 " in args for args in runs), runs
    for extra, said in (({"QGEMM_AB_SHAPES": "1x64x64"}, "step ab needs QGEMM_AB_OLD"),
                        ({"QGEMM_AB_OLD": str(tmp_path), "QGEMM_AB_SHAPES": "1x64x64"}, "step ab needs QGEMM_AB_OLD"),
                        ({"QGEMM_AB_OLD": str(old)}, "step ab needs QGEMM_AB_SHAPES")):
        r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, timeout=60, env={**env, **extra})
        assert r.returncode == 1 and said in r.stdout and "gpu_check: FAIL" in r.stdout, r.stdout


def test_gpu_check_tests_step_runs_every_test_once(tmp_path):
    """tools/gpu_check.sh's step `tests` splits the suite over processes that run side by side (one
    process would pass the device call's 10 minutes; session 54 gave wgmma_rs's configuration
    sweeps a process of their own, session 56 the registry / CLI and tool tests). With a stand-in
    python whose pytest only collects, every test of the suite lands in exactly one process, the
    GPU kernel tests in five of them, and the two sweep logs end as one file, as do the two
    logs of the rest and, since session 58, the defaults' tests on large shapes with the other GPU
    kernel tests (a device call brings back at most 8); since session 64 the torch.compile tests
    run apart and join the rest's log too."""
    fake = tmp_path / "py"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then shift 2; exec {sys.executable} -m pytest --collect-only "$@"; fi
exit 0
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake), "QGEMM_CHECK": "tests"}
    r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0 and "gpu_check: PASS" in r.stdout and "10 pytest processes" in r.stdout, r.stdout + r.stderr
    logs = sorted(p.name for p in out.glob("tests-*.log"))
    assert logs == ["tests-gemm-4097.log", "tests-gemm.log", "tests-gpu-sweeps.log", "tests-gpu.log", "tests-kvcache.log",
                    "tests-rest.log"], logs
    assert "=== wgmma configurations" in (out / "tests-gpu-sweeps.log").read_text()
    ids = [line for name in logs for line in (out / name).read_text().splitlines() if "::" in line and not line.startswith(" ")]
    whole = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    every = [line for line in whole.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    assert len(every) > 2000 and len(ids) == len(set(ids)), [i for i in set(ids) if ids.count(i) > 1][:5]
    assert sorted(ids) == sorted(every), (sorted(set(every) - set(ids))[:5], sorted(set(ids) - set(every))[:5])
    sweeps = [i for i in ids if "wgmma_configurations" in i]
    assert sweeps and all(i in (out / "tests-gpu-sweeps.log").read_text() for i in sweeps)
    rest = (out / "tests-rest.log").read_text()
    assert "=== tests/test_cli_registry.py tests/test_tools.py" in rest and "test_cli_registry.py::" in rest, rest[-500:]
    # test_packing.py stands for the CPU-side rest (test_formats.py, skipped whole without gguf, would
    # tie this test to an optional package: session 66's device call without gguf failed here)
    assert "test_packing.py::" in rest.split("===")[0] and "test_cli_registry.py::" not in rest.split("===")[0]
    torch_part = rest.split("=== tests/test_torch_ops.py tests/test_docs_pytorch.py (a process of its own) ===")
    assert len(torch_part) == 2 and "test_docs_pytorch.py::" in torch_part[1], rest[-500:]  # torch.compile apart
    assert "test_docs_pytorch.py::" not in torch_part[0]
    gpu = (out / "tests-gpu.log").read_text().split("=== fill_the_gpu or defaults_on_wide_weights")
    assert len(gpu) == 2 and "test_matmul_defaults_that_fill_the_gpu" in gpu[1], gpu[-1][-500:]
    assert "test_decode_defaults_on_wide_weights" in gpu[1] and "fill_the_gpu" not in gpu[0], gpu[0][-500:]


def test_the_suite_collects_the_same_tests_without_gguf():
    """gguf is a test dependency the device image lacks (tools/gpu_check.sh installs a carried wheel
    when there is one). Only a module that skips itself whole without it (`X = pytest.importorskip
    ("gguf")` at module level) may lose tests then. Session 70 imported a helper from
    test_formats.py, such a module, into test_gpu_kernels.py: on the device every GPU kernel test
    was skipped, and the call reported "1 skipped"."""
    pytest.importorskip("gguf")  # without it both collections below are the same by construction
    need_gguf = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")
                 if re.search(r'^\w+ = pytest\.importorskip\("gguf"\)', p.read_text(), re.M)}
    assert "tests/test_formats.py" in need_gguf and "tests/test_gpu_kernels.py" not in need_gguf, need_gguf
    collect = "import pytest, sys; sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests']))"

    def ids(block_gguf: bool) -> set[str]:
        code = ("import sys; sys.modules['gguf'] = None; " if block_gguf else "") + collect
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return {line for line in r.stdout.splitlines() if "::" in line and not line.startswith(" ")}

    every, without = ids(False), ids(True)
    assert len(every) > 2000 and without <= every
    lost = {i.split("::")[0] for i in every - without}
    assert lost <= need_gguf, sorted(lost - need_gguf)


def _stand_in_tuner(tmp_path, stored, step):
    """A stand-in python for tools/gpu_check.sh's tune steps: it records its arguments in
    tmp_path/calls, answers `qgemm tune --json PATH` by copying the stored file of PATH's name from
    `stored`, and runs tools/split_model.py for real. The environment that runs `step` with it."""
    fake = tmp_path / "py"
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {tmp_path / "calls"}
case "$*" in
  "-m qgemm tune "*)
    out=$(printf '%s\\n' "$@" | sed -n '/^--json$/{{n;p;}}')
    cp {stored}/$(basename "$out") "$out" ;;
  *tools/split_model.py*) exec {sys.executable} "$@" ;;
esac
exit 0
""")
    fake.chmod(0o755)
    return {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(fake), "QGEMM_CHECK": step}


def test_gpu_check_rs_tunes_step_remakes_the_stored_tunes(tmp_path):
    """tools/gpu_check.sh's step `rs-tunes` (session 55) times what docs/perf/tunes-h100 stores. With
    a stand-in python whose `qgemm tune` copies the stored file for its kernel and shape to the
    --json path: both kernels precompiled at the shapes, each shape tuned by both (dry run, one JSON
    each), tools/split_model.py's report of them, the JSONs packed into one tunes.tgz. Without
    QGEMM_RS_TUNE_SHAPES the shapes are every stored one."""
    import tarfile

    stored = ROOT / "docs" / "perf" / "tunes-h100"
    calls, out = tmp_path / "calls", tmp_path / "out"
    env = _stand_in_tuner(tmp_path, stored, "rs-tunes")
    r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**env, "QGEMM_RS_TUNE_SHAPES": "384x4096x8192,300x3072x7168"})
    assert r.returncode == 0 and "gpu_check: PASS" in r.stdout, r.stdout + r.stderr
    seen = [line for line in calls.read_text().splitlines() if not line.startswith("-c ")]  # the gguf probe
    assert seen[0] == "tools/precompile.py w4a16.wgmma_rs w8a16.wgmma_rs --shapes 384x4096x8192,300x3072x7168"
    tunes = [line for line in seen if line.startswith("-m qgemm tune ")]
    assert [t.split()[3:6] for t in tunes] == [["w4a16.wgmma_rs", "--shape", "384x4096x8192"],
                                               ["w8a16.wgmma_rs", "--shape", "384x4096x8192"],
                                               ["w4a16.wgmma_rs", "--shape", "300x3072x7168"],
                                               ["w8a16.wgmma_rs", "--shape", "300x3072x7168"]]
    assert all("--dry-run" in t and f"--json {out}/tunes/" in t for t in tunes)
    with tarfile.open(out / "tunes.tgz") as tar:
        names = sorted(n for n in tar.getnames() if n.endswith(".json"))
    assert names == ["tunes/w4a16-300x3072x7168.json", "tunes/w4a16-384x4096x8192.json",
                     "tunes/w8a16-300x3072x7168.json", "tunes/w8a16-384x4096x8192.json"]
    assert not (out / "tunes").exists()
    report = (out / "split_model.md").read_text()
    assert "w8a16.wgmma_rs 384x4096x8192" in report and "its pick the measured best at 4 of 4 shapes" in report
    # the default shapes: every stored one, each tuned by both kernels
    calls.unlink()
    r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0 and "gpu_check: PASS" in r.stdout, r.stdout + r.stderr
    tuned = sorted(f"{t.split()[3][:5]}-{t.split()[5]}.json" for t in calls.read_text().splitlines() if t.startswith("-m qgemm tune "))
    assert tuned == sorted(p.name for p in stored.glob("*.json")) and len(tuned) == 40


def test_gpu_check_decode_tunes_step_remakes_the_stored_tunes(tmp_path):
    """tools/gpu_check.sh's step `decode-tunes` (session 55) times what docs/perf/tunes-h100/decode
    stores (KERNEL-SHAPE.json). With a stand-in python whose `qgemm tune` copies the stored file to
    the --json path: each kernel precompiled at its own shapes, each pair tuned (dry run, 20
    samples, one JSON each), the JSONs packed into one tunes-decode.tgz. Without
    QGEMM_DECODE_TUNE_PAIRS the pairs are every stored file."""
    import tarfile

    stored = ROOT / "docs" / "perf" / "tunes-h100" / "decode"
    calls, out = tmp_path / "calls", tmp_path / "out"
    env = _stand_in_tuner(tmp_path, stored, "decode-tunes")
    pairs = "w4a8.skinny@1x4096x4096 w4a16.skinny@2x1024x4096 w4a8.skinny@1x4096x14336"
    r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**env, "QGEMM_DECODE_TUNE_PAIRS": pairs})
    assert r.returncode == 0 and "gpu_check: PASS" in r.stdout, r.stdout + r.stderr
    seen = [line for line in calls.read_text().splitlines() if not line.startswith("-c ")]  # the gguf probe
    assert seen[:2] == ["tools/precompile.py w4a16.skinny --shapes 2x1024x4096",
                        "tools/precompile.py w4a8.skinny --shapes 1x4096x4096,1x4096x14336"]
    tunes = [line.split() for line in seen[2:]]
    assert [t[3:6] for t in tunes] == [[p.split("@")[0], "--shape", p.split("@")[1]] for p in pairs.split()]
    assert all(t[6:10] == ["--iters", "20", "--dry-run", "--json"] for t in tunes) and len(seen) == 5
    with tarfile.open(out / "tunes-decode.tgz") as tar:
        names = sorted(n for n in tar.getnames() if n.endswith(".json"))
    assert names == ["decode/w4a16.skinny-2x1024x4096.json", "decode/w4a8.skinny-1x4096x14336.json",
                     "decode/w4a8.skinny-1x4096x4096.json"] and not (out / "decode").exists()
    calls.unlink()
    r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0 and "gpu_check: PASS" in r.stdout, r.stdout + r.stderr
    tuned = sorted(f"{t.split()[3]}-{t.split()[5]}.json" for t in calls.read_text().splitlines() if t.startswith("-m qgemm tune "))
    assert tuned == sorted(p.name for p in stored.glob("*.json")) and len(tuned) == 12


def _tune_json(path, kernel, shape, times):
    """A `qgemm tune --json` file: times maps (RS_BN, RS_WGS, RS_SPLITK) -> µs (None: a wrong result)."""
    cands = [{"config": {"RS_BN": bn, "RS_WGS": w, "RS_STAGES": 4, "RS_SPLITK": s, "RS_MINB": 1, "RS_WS": 1},
              "us": us if us is not None else 1.0, "check": "ok" if us is not None else "wrong result", "default": False}
             for (bn, w, s), us in times.items()]
    path.write_text(json.dumps({"command": "qgemm tune", "environment": {"device": "H100", "sm_count": 132},
                                "kernel": kernel, "shape": list(shape), "candidates": cands}))
    return str(path)


def test_split_model_orders_tune_timings(tmp_path):
    """tools/split_model.py (session 54) reads `qgemm tune --json` files of wgmma_rs and sets the
    cost model (`registry.rs_grid_cost`) against them. Timings made from the model itself fit it
    exactly, its pick is theirs; a timing that disagrees shows as the rms error and as a pick
    that is not the measured best, by how much; a wrong result or a tile without a rate never
    counts; --overhead / --rate change the model; bad files and arguments are refused by name."""
    from qgemm import registry as R

    tool = _load("split_model")
    rates, overhead = dict(R.RS_TILE_RATES), R.RS_SPLIT_OVERHEAD_K
    shape = (300, 3072, 7168)
    tiles = [(128, 2, 1), (128, 2, 3), (128, 1, 1), (64, 2, 1)]
    exact = {t: R.rs_grid_cost(*shape, *t, 132) / 200 for t in tiles}
    assert min(exact, key=exact.get) == (64, 2, 1)  # the 64-token tiles of session 54's rule
    f1 = _tune_json(tmp_path / "a.json", "w4a16.wgmma_rs", shape, {**exact, (256, 1, 1): 1.0, (128, 2, 2): None})
    text, rms = tool.report([f1], None, {}, None)
    assert rms == pytest.approx(0, abs=1e-9) and "measured best 64 tokens x 128 rows, split 1" in text
    assert "| 256 tokens x 64 rows, split 1 | 96 | 1.0 | - | - |" in text and "split 2" not in text
    assert "its pick the measured best at 1 of 1 shapes" in text
    # the 64-token tiles measured 40% slower than the model says: the pick is now off the best
    slow = {**exact, (64, 2, 1): exact[(64, 2, 1)] * 1.4}
    f2 = _tune_json(tmp_path / "b.json", "w8a16.wgmma_rs", shape, slow)
    text, rms = tool.report([f2], None, {}, None)
    best = min(slow, key=slow.get)
    assert best != (64, 2, 1) and rms > 5 and "at 0 of 1 shapes" in text
    assert f"{100 * (slow[(64, 2, 1)] / slow[best] - 1):.1f}% slower" in text
    # a lower rate for the 64-token tiles, as that timing says, restores the pick
    rate = R.RS_TILE_RATES[(64, 2)] / 1.4
    text, rms = tool.report([f2], None, {(64, 2): rate}, None)
    assert "at 1 of 1 shapes" in text and f"64x2={rate:g}" in text and rms == pytest.approx(0, abs=1e-9)
    # through main: the report printed and written, bad input refused with exit 2
    md = tmp_path / "r.md"
    assert tool.main([f1, "--markdown", str(md), "--overhead", "768"]) == 0 and "overhead 768 K" in md.read_text()
    (tmp_path / "bench.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "mma.json").write_text(json.dumps({"kernel": "w4a16.mma", "shape": [1, 2, 32], "candidates": []}))
    (tmp_path / "junk.json").write_text("{")
    for args, said in (([str(tmp_path / "none.json")], "cannot read it"), ([str(tmp_path / "junk.json")], "not JSON"),
                       ([str(tmp_path / "bench.json")], "not the output of `qgemm tune --json`"),
                       ([str(tmp_path / "mma.json")], "the model is wgmma_rs's"),
                       ([f1, "--markdown", str(tmp_path / "no" / "r.md")], "--markdown")):
        r = subprocess.run([sys.executable, str(TOOLS / "split_model.py"), *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and said in r.stderr, (args, r.stderr)
    for args in (["--rate", "64x3=1"], ["--rate", "64x2"], ["--overhead", "-1"], ["--sm", "0"]):
        with pytest.raises(SystemExit) as e:
            tool.main([f1, *args])
        assert e.value.code == 2, args
    assert R.RS_TILE_RATES == rates and R.RS_SPLIT_OVERHEAD_K == overhead  # the model's own constants untouched


def test_decode_map_selects_models_and_shapes():
    dm = _load("decode_map")
    every = dm.select(None, None)
    assert len(every) == len({(n, k) for pairs in dm.MODELS.values() for n, k in pairs})  # each matrix once
    assert every[0] == ("llama3-8b", 6144, 4096)
    assert dm.select("llama3-70b", "5120x14336,8192x8192") == \
        [("llama3-70b", n, k) for n, k in dm.MODELS["llama3-70b"]] + [("", 5120, 14336)]
    assert dm.select(None, "4608x3584") == [("", 4608, 3584)]  # --shapes alone: no models
    for bad, said in (("5000x100", "multiple of 32"), ("5120", "NxK pairs"), ("0x4096", "positive"), (",", "no NxK")):
        with pytest.raises(ValueError, match=said):
            dm.parse_pairs(bad)
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        dm.select("gpt", None)
    for argv, said in ((["--m", "0"], "positive token counts"), (["--fmts", "q5_0"], "q4_0 and / or q8_0"),
                       (["--x-dtype", "f64"], "f32, f16 or bf16"), (["--models", "x"], "unknown model")):
        with pytest.raises(SystemExit):
            dm.main(argv + ["--dry-run"])
    import numpy as np

    from qgemm import formats as F

    b = dm.random_blocks("q8_0", 3, 96, np.random.default_rng(0))
    assert b.shape == (3, 3) and b.dtype == F.block_q8_0 and 0.001 <= b["d"].astype(np.float32).min()


def test_decode_map_dry_run_prints_the_plans(capsys):
    dm = _load("decode_map")
    assert dm.main(["--dry-run", "--models", "llama3-70b", "--m", "16", "--fmts", "q4_0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(dm.MODELS["llama3-70b"])
    row = next(line for line in lines if " 16x10240x8192 " in line)  # session 60's split 3
    assert row.startswith("llama3-70b q4_0 16x10240x8192 w4a16.skinny ") and "SK_WARPS=4" in row and "SK_GSPLIT=3" in row


def test_decode_map_table_without_a_gpu(monkeypatch, tmp_path):
    """The GPU parts stood in for (copy bandwidth 2000 GB/s, a time per shape): the table holds every
    row, weakest share of the copy bandwidth first, with the device, the mode and the command."""
    import types

    from qgemm import bench, runtime

    dm = _load("decode_map")
    monkeypatch.setattr(bench, "measure_copy_bandwidth", lambda *a: 2.0e12)
    monkeypatch.setattr(runtime, "device_info", lambda: types.SimpleNamespace(name="GPU X"))
    seen = []

    def time_matmul(fmt, m, n, k, cold, rng, weights, iters, x_dtype):
        seen.append((fmt, m, n, k, cold, x_dtype))
        assert weights[(fmt, n, k)].shape == (n, k // 32)
        gbps = 1000.0 * m if n == 1024 else 1500.0
        return {"kernel": "w4a16.skinny", "config": {"SK_R": 2}, "matmul_us": 5.0, "weight_gbps": gbps}
    monkeypatch.setattr(bench, "time_matmul", time_matmul)
    out = tmp_path / "map.md"
    assert dm.main(["--shapes", "1024x4096,4096x4096", "--m", "1,2", "--fmts", "q4_0", "--x-dtype", "f16",
                    "--markdown", str(out)]) == 0
    assert seen == [("q4_0", m, n, 4096, True, "f16") for n in (1024, 4096) for m in (1, 2)]
    lines = out.read_text().splitlines()
    assert lines[0].startswith("GPU X, cold, f16 x, `python tools/decode_map.py --shapes 1024x4096,4096x4096")
    rows = [line for line in lines if line.startswith("| ") and "x4096 |" in line]
    assert [r.split(" | ")[2] for r in rows] == ["1x1024x4096", "1x4096x4096", "2x4096x4096", "2x1024x4096"]
    assert [r.split(" | ")[6] for r in rows] == ["50.0%", "75.0%", "75.0%", "100.0%"]
    assert "SK_R=2" in rows[0] and "`w4a16.skinny`" in rows[0]


def test_fold_error_reproduces_llamacpps_error_and_measures_coarser_folds():
    """tools/fold_error.py (docs/perf/NOTES.md session 65): at G = 32 the int8 requantization of
    Q8_0 weights is exact (ggml's amax maps to +-127, so the int8 grid is the block's), so its
    error is llama.cpp's; folding every 128 values costs well over llama.cpp's error for both
    formats -- the reason no int8 prefill path folds less often."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fold_error.py"), "--m", "16", "--n", "128", "--k", "1024"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ratios = {(ln.split()[0], ln.split()[1], int(ln.split()[2])): float(ln.split()[-1])
              for ln in r.stdout.splitlines()[2:]}
    assert len(ratios) == 12
    for acts in ("Gaussian", "outliers"):
        assert 0.97 < ratios[(acts, "q8_0", 32)] < 1.03, ratios
        assert ratios[(acts, "q4_0", 128)] > 1.3 and ratios[(acts, "q8_0", 128)] > 1.3, ratios


def _tool(tmp_path, *argv, env=None):
    """A tools/ script as a user runs it: (exit status, stdout + stderr)."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), "QGEMM_CACHE_DIR": str(tmp_path / "cache"), **(env or {})}
    r = subprocess.run([*argv], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def test_tools_the_session_69_audit_found(tmp_path):
    """Each was a traceback, a silent success or a wrong verdict before."""
    py = sys.executable
    for argv, rc, said in (
        ([py, "tools/plan_diff.py", "--old", ""], 2, "--old is empty"),  # was the tree against itself: "0 changed"
        ([py, "tools/perf_report.py", "docs/perf/bench-h100.json"], 2,
         "docs/perf/bench-h100.json is not a `qgemm profile --json` output"),
        ([py, "tools/perf_report.py", "docs/perf/profile-h100-512x4096x4096-hot.json", "--bench", "docs/perf/kvcache-h100.json"],
         2, "kvcache-h100.json is not a `qgemm bench`'s bench.json output"),
        ([py, "tools/precompile.py", "w4a16.skinny", "--shapes", "1x4096x100", "--arch", "sm_90"], 1,
         "K must be a multiple of 32 for w4a16.skinny"),
        ([py, "tools/decode_map.py", "--models", ""], 2, "--models is empty"),
        ([py, "tools/decode_map.py", "--iters", "0"], 2, "--iters must be at least 1"),
        ([py, "tools/decode_map.py", "--markdown", str(tmp_path / "no" / "x.md")], 2, "is not a writable directory"),
        ([py, "tools/quant_speed.py", "--json", str(tmp_path / "no" / "q.json")], 2, "is not a writable directory"),
        ([py, "tools/api_doc.py", "--check", ""], 2, "--check is empty"),
        ([py, "tools/api_doc.py", "--check", "README.md"], 1, "README.md is not the API reference page"),
    ):
        status, out = _tool(tmp_path, *argv)
        assert status == rc and said in out and "Traceback" not in out, (argv, status, out)
    assert "docs/perf/profile-h100-*-hot.json" in _load("perf_report").__doc__  # the example remakes the H100 page only
    if not __import__("qgemm").gpu_available():
        # the GPU scripts: one line, not a traceback; the check scripts refuse at once (every GPU test
        # would skip and pytest exit 0: they read PASS)
        for argv in ([py, "tools/decode_map.py", "--models", "llama3-8b"], [py, "tools/quant_speed.py"]):
            status, out = _tool(tmp_path, *argv)
            assert status == 2 and "needs an NVIDIA GPU" in out and "Traceback" not in out, (argv, out)
        for script, env in (("tools/gpu_check.sh", {"QGEMM_CHECK": "tests"}), ("tools/gpu_check_kvcache.sh", {"QGEMM_KV_STEPS": "tests"})):
            status, out = _tool(tmp_path, "bash", script, env={**env, "OUT": str(tmp_path / "out"), "PYTHON": py})
            assert status == 2 and "needs an NVIDIA GPU" in out and "PASS" not in out, (script, out)
