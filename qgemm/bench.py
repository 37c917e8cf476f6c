"""Timing with CUDA events, bytes and FLOPs, and the device's roofline.

`profile()` warms up, then times replays of a CUDA graph of back-to-back launches between two
events (see _time_launches) and reports the median, min and max of the per-launch time. Hot: the
same buffers every launch (they stay in L2 when they fit, to a degree that depends on the traffic
before the timing: see clear_l2). Cold:
several sets of buffers, together more than twice the L2, used in rotation, so each launch reads
its operands from device memory.

The roofline: floor = max(FLOPs / compute peak, bytes / memory bandwidth); "% of roofline" is
floor / measured. The memory bandwidth is *measured* (a device-to-device copy, bytes read plus
written); the compute peaks are nominal (SM count x clock x per-SM rate of the unit), see PEAKS.
"""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache, wraps

import numpy as np

from . import formats as F
from . import packing, runtime
from .check import make_inputs
from .ops import Kernel

# Per-SM, per-clock operation rates of the unit that bounds an op (2 ops per multiply-add).
#   fp32: FFMA lanes x 2 (64 lanes on sm_75/sm_80, 128 on sm_86+)
#   dp4a: 64 IDP4A per SM per clock on sm_80+ (x 4 MACs x 2) = 512; H100: 132 SMs x 1.98 GHz x 512
#         = 134 TOPS, the ~133 TOPS ceiling measured for DP4A on Hopper
#   imma: dense int8 tensor-core rate per SM per clock (datasheet dense INT8 / SMs / clock: H100 SXM
#         1979 TOPS / 132 / 1.83 GHz -> 8192; mma.sync reaches about 2/3 of it on Hopper, wgmma the
#         rest). peak_ops multiplies by the clock the device reports (1.98 GHz on the H100), so the
#         rooflines' peaks are ~8% above the datasheet's: 2141 TOPS int8, 1070 TFLOPS fp16.
PEAKS = {
    "fp32": {75: 128, 80: 128, 86: 256, 87: 256, 89: 256, 90: 256, 100: 256, 120: 256},
    "dp4a": {75: 256, 80: 512, 86: 512, 87: 512, 89: 512, 90: 512, 100: 512, 120: 512},
    "imma": {75: 2048, 80: 4096, 86: 2048, 87: 4096, 89: 2048, 90: 8192, 100: 8192, 120: 4096},
    "hmma": {75: 1024, 80: 2048, 86: 1024, 87: 2048, 89: 1024, 90: 4096, 100: 4096, 120: 2048},
}


def peak_ops(unit: str, info: runtime.DeviceInfo) -> float | None:
    """Nominal ops/s of `unit` on this device, or None when not compute-bound ('memory')."""
    table = PEAKS.get(unit)
    if not table or not info.clock_khz:
        return None
    cc = max((c for c in table if c <= info.cc), default=None)
    if cc is None:
        return None
    return table[cc] * info.sm_count * info.clock_khz * 1e3


@lru_cache(maxsize=None)
def copy_bandwidth(nbytes: int = 512 << 20, iters: int = 10) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus written
    (measured once per process: measure_copy_bandwidth measures again)."""
    return measure_copy_bandwidth(nbytes, iters)


def measure_copy_bandwidth(nbytes: int = 512 << 20, iters: int = 10) -> float:
    """One measurement of copy_bandwidth: the median of `iters` copies of `nbytes` (512 MiB: ~10x
    the H100's 50 MB L2, so the copy streams through DRAM). It moves by up to ~13% between runs on
    the H100s of docs/perf/NOTES.md (2575-2923 GB/s; the published bench measured 2848 before its
    sweep and 2895 after), so the bench measures it before and after its sweep."""
    src = runtime.DeviceArray.empty((nbytes,), np.uint8)
    dst = runtime.DeviceArray.empty((nbytes,), np.uint8)
    src.fill_bytes(0x5A)
    for _ in range(2):
        src.copy_to(dst)
    times = []
    for _ in range(iters):
        e0 = runtime.record_event()
        src.copy_to(dst)
        e1 = runtime.record_event()
        times.append(runtime.elapsed_ms(e0, e1))
    src.free()
    dst.free()
    return 2.0 * nbytes / (statistics.median(times) * 1e-3)


def operand_bytes(kernel: Kernel, m: int, n: int, k: int) -> int:
    """Fewest bytes the op must move: each input read once, the output written once."""
    op = kernel.op
    if op.kind == "pack":  # the N x K blocks read, their packed copy written
        return op.a.nbytes(n, k) + packing.packed_nbytes(op.a.name, n, k)
    if op.kind == "quantize":
        return op.a.nbytes(m, k) + op.out.nbytes(m, k)  # Format.nbytes(rows, K)
    return op.a.nbytes(m, k) + op.w.nbytes(n, k) + m * n * 4


def flops(kernel: Kernel, m: int, n: int, k: int) -> int:
    return 0 if kernel.op.kind in ("quantize", "pack") else 2 * m * n * k


@dataclass
class Profile:
    kernel: str
    shape: tuple[int, int, int]
    cold: bool
    iters: int
    median_us: float
    min_us: float
    max_us: float
    tflops: float
    bytes: int
    gbps: float
    floor_us: float
    roofline_pct: float
    bound: str  # "memory" or "compute"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


_SAMPLE_US = 1000.0  # GPU time one sample (one graph replay) should span
_MAX_BATCH = 1000
_TRIAL_BATCH = 16
# --sustain: samples are queued this many at a time before the host reads their times, so the GPU
# always has replays waiting and runs them back to back, as llama.cpp's perf loop does
_SUSTAIN_CHUNK = 50
_MAX_SETS = 1024  # cold buffer sets; an op so small that these cannot rotate 2x L2 is reported as such


def cold_sets(nbytes: int) -> int:
    """Buffer sets for a cold timing: enough that one rotation through them moves more than twice
    the L2, so no launch finds its operands there (at most _MAX_SETS: its rows carry rotation_bytes)."""
    l2 = max(runtime.device_info().l2_bytes, 1)
    return min(_MAX_SETS, max(2, int(np.ceil(2 * l2 / max(nbytes, 1))) + 1))


def round_batch(batch: int, sets: int) -> int:
    """Launches per sample for `sets` rotating buffer sets: at least one full rotation and a whole
    number of them. A sample of fewer launches than sets used only the first sets (all of a slow
    kernel's launches could hit one L2-resident set), and a partial rotation restarted the next
    sample at set 0 a few launches after it was last used."""
    if sets <= 1:
        return max(batch, 1)
    return -(-max(batch, sets) // sets) * sets


_L2_JUNK = None
_L2_READ = None  # (LoadedKernel, sink) of cuda_src/bench/l2_read.cu
L2_MODES = ("read", "memset", "off")


def l2_mode() -> str:
    """QGEMM_BENCH_L2: what every timing does to the L2 before its warm-up -- `off` (default:
    nothing, a timing starts from the L2 the work before it left, as an op inside a model would),
    `read` (a kernel reads twice the L2's size of a zeroed buffer) or `memset` (writes it)."""
    mode = os.environ.get("QGEMM_BENCH_L2", "off").strip().lower() or "off"
    if mode not in L2_MODES:
        raise ValueError(f"QGEMM_BENCH_L2 must be one of {', '.join(L2_MODES)}, got {mode!r}")
    return mode


def clear_l2(stream=None) -> bool:
    """Stream twice the L2's size through it before a timing (QGEMM_BENCH_L2=read or memset; off by
    default); True if it queued anything on `stream`. What it showed on the H100 (session 11, docs/perf/NOTES.md): a hot op's time depends
    on the traffic before it, and the L2 does not forget that traffic within the tens of
    milliseconds a row is measured. After the torch peers, Q8_0 1x4096x4096 (17.8 MB of weights)
    ran at 5.6-5.7 us against 4.8 before them; after either reset, hot rows with 17-33 MB of
    weights were slower still (Q4_0 1x4096x14336 11.5 us against 8.5 without a reset), i.e. a
    streamed 100 MB leaves the L2 keeping a re-read working set of that size worse than the
    bench's own earlier rows do. So there is no order-free "hot" at those sizes; the default
    keeps the order the bench always had (and says so)."""
    global _L2_JUNK, _L2_READ
    mode = l2_mode()
    if mode == "off":
        return False
    if _L2_JUNK is None:
        _L2_JUNK = runtime.DeviceArray.empty((2 * max(runtime.device_info().l2_bytes, 1 << 20),), np.uint8)
        _L2_JUNK.fill_bytes(0)
    if mode == "memset":
        _L2_JUNK.fill_bytes(0, stream)
        return True
    if _L2_READ is None:
        from . import jit

        ck = jit.compile_kernel("bench.l2_read", "bench/l2_read.cu", ["l2_read"], runtime.device_arch())
        _L2_READ = (runtime.LoadedKernel(ck.cubin, ["l2_read"], "bench.l2_read"),
                    runtime.DeviceArray.empty((1,), np.uint32))
    mod, sink = _L2_READ
    n16 = _L2_JUNK.nbytes // 16
    mod.launch("l2_read", (4 * runtime.device_info().sm_count, 1, 1), (256, 1, 1), 0,
               (np.uint64(_L2_JUNK.ptr), np.uint64(n16), np.uint64(sink.ptr)), stream=stream)
    return True


# ---- read ceilings (cuda_src/bench/stream_read.cu) ------------------------------------------------
READ_CEILING_CTAS_PER_SM = (1, 2, 4)
READ_CEILING_THREADS = (256, 512)
_STREAM_READ: dict = {}  # (arch, dependent) -> LoadedKernel


def _stream_read(dependent: bool):
    from . import jit

    arch = runtime.device_arch()
    key = (arch, dependent)
    if key not in _STREAM_READ:
        ck = jit.compile_kernel("bench.stream_read", "bench/stream_read.cu", ["stream_read"], arch,
                                {"RD_DEPENDENT": int(dependent)})
        _STREAM_READ[key] = runtime.LoadedKernel(ck.cubin, ["stream_read"], "bench.stream_read")
    return _STREAM_READ[key]


def read_ceiling(nbytes: int, cold: bool, iters: int = 20, sustain_s: float = 0.0) -> dict:
    """What a kernel that only reads `nbytes` once achieves here, launched back to back and timed as
    the bench times an op (graph-batched; cold: buffer sets rotated through > 2x L2): the fastest of
    a few grid shapes, as two ceilings (cuda_src/bench/stream_read.cu says why two) --
    `independent_us`, the reads free to overlap the previous launch (programmatic dependent launch
    with no wait before them: the bound for any op), and `dependent_us`, the reads after the wait
    for the previous launch (the bound for an op whose every byte depends on the one before). A
    decode op's time between them says how much of its weight stream it starts early. sustain_s:
    the grid shapes are compared on short samples, then each ceiling's fastest shape is timed again
    back to back for at least that long (`_samples`), as the sustained bench's rows are."""
    info = runtime.device_info()
    n16 = max(1, -(-nbytes // 16))
    sets = cold_sets(n16 * 16) if cold else 1
    bufs = [runtime.DeviceArray.empty((n16 * 16,), np.uint8) for _ in range(sets)]
    out = runtime.DeviceArray.empty((max(READ_CEILING_CTAS_PER_SM) * info.sm_count,), np.uint32)
    result = {"bytes": n16 * 16, "cold": cold, "buffer_sets": sets,
              "pdl": runtime.pdl_enabled() and info.cc >= 90}
    try:
        for b in bufs:
            b.fill_bytes(0x5A)
        for dependent in (False, True):
            mod = _stream_read(dependent)
            best = None
            for per_sm in READ_CEILING_CTAS_PER_SM:
                for threads in READ_CEILING_THREADS:
                    grid = per_sm * info.sm_count

                    def launch(i, stream=None, grid=grid, threads=threads):
                        mod.launch("stream_read", (grid, 1, 1), (threads, 1, 1), 0,
                                   (np.uint64(bufs[i].ptr), np.uint64(n16), np.uint64(out.ptr)), stream=stream, pdl=True)

                    times, _ = _time_launches(launch, sets, 3, iters)
                    med = statistics.median(times)
                    if best is None or med < best[0]:
                        best = (med, per_sm, threads, launch)
            if sustain_s > 0:
                best = (statistics.median(_time_launches(best[3], sets, 3, iters, sustain_s)[0]),) + best[1:]
            name = "dependent" if dependent else "independent"
            result[f"{name}_us"] = best[0]
            result[f"{name}_config"] = f"{best[1]} CTA(s) per SM x {best[2]} threads"
        runtime.check_last_error("bench.stream_read")
    finally:
        for b in bufs + [out]:
            b.free()
    return result


def _samples(replay_timed, iters: int, sustain_s: float) -> list[float]:
    """Sample times in ms: `replay_timed()` queues one timed replay and returns a function that
    reads its time. Without sustain_s, `iters` samples, each read before the next is queued. With
    it, samples queued _SUSTAIN_CHUNK at a time, then read back, until they add up to sustain_s
    seconds of GPU time (and at least `iters` of them): llama.cpp's `test-backend-ops perf` runs
    each op back to back for at least a second, so its figure includes the L2's steady state and
    whatever the clock does under sustained load."""
    if sustain_s <= 0:
        return [replay_timed()() for _ in range(iters)]
    times, total_ms = [], 0.0
    while total_ms < sustain_s * 1e3 or len(times) < iters:
        pending = [replay_timed() for _ in range(_SUSTAIN_CHUNK)]
        for elapsed in pending:
            times.append(elapsed())
            total_ms += times[-1]
    return times


def _time_launches(launch, sets: int, warmup: int, iters: int, sustain_s: float = 0.0) -> tuple[list[float], dict]:
    """Per-launch times in us. A single launch between two events would also time Python's launch
    overhead whenever the kernel is shorter than it (the GPU idles waiting for the launch), so
    launches are batched: B back-to-back launches (cycling through the buffer sets) are captured
    once as a CUDA graph and replayed; each replay's time / B is one sample. B is chosen so a
    replay takes about 1 ms of GPU time, from a captured trial graph of 16 launches: sizing it from
    one plain launch (as before session 9) measured Python's launch overhead (25-110 us per call
    with qgemm.matmul's planning), gave batches of 9-39 decode ops, and left the graph's own
    launch latency (a few us per replay) in every sample. Falls back to uncaptured back-to-back
    batches if capture fails. Starts with clear_l2 (a no-op unless QGEMM_BENCH_L2 asks for it).
    sustain_s > 0: samples for at least that long (`_samples`), and never fewer than `iters`."""
    stream = runtime.create_stream()
    clear_l2(stream)
    for i in range(max(warmup, 1)):
        launch(i % sets, stream)
    runtime.synchronize(stream)
    e0 = runtime.record_event(stream)
    launch(0, stream)
    e1 = runtime.record_event(stream)
    single = runtime.elapsed_ms(e0, e1) * 1e3

    def recorder(count):
        def record():
            for j in range(count):
                launch(j % sets, stream)
        return record

    try:
        trial = runtime.Graph(recorder(_TRIAL_BATCH), stream)
        trial.launch()
        runtime.synchronize(stream)
        e0 = runtime.record_event(stream)
        trial.launch()
        e1 = runtime.record_event(stream)
        per_launch = runtime.elapsed_ms(e0, e1) * 1e3 / _TRIAL_BATCH
        batch = round_batch(int(min(max(_SAMPLE_US / max(per_launch, 1e-3), 1), _MAX_BATCH)), sets)
        graph = runtime.Graph(recorder(batch), stream)
        replay = graph.launch
        method = f"CUDA graph of {batch} back-to-back launches per sample"
    except Exception as e:  # pragma: no cover - depends on the driver
        batch = round_batch(int(min(max(_SAMPLE_US / max(single, 1e-3), 1), 200)), sets)
        method = f"batches of {batch} back-to-back launches (graph capture failed: {e})"
        replay = recorder(batch)
    replay()
    runtime.synchronize(stream)
    def replay_timed():
        e0 = runtime.record_event(stream)
        replay()
        e1 = runtime.record_event(stream)
        return lambda: runtime.elapsed_ms(e0, e1)

    times = [ms * 1e3 / batch for ms in _samples(replay_timed, iters, sustain_s)]
    if sustain_s > 0:
        method += f", {len(times)} samples back to back over >= {sustain_s:g} s"
    return times, {"method": method, "launches_per_sample": batch, "single_launch_us": single}


def profile(kernel: Kernel, shape: tuple[int, int, int], warmup: int = 10, iters: int = 50,
            cold: bool = False, seed: int = 0, weights: np.ndarray | None = None, opts: dict | None = None) -> Profile:
    if getattr(kernel.spec, "runner", None) is not None:  # kernels outside the GEMM convention (mustafar.*)
        return kernel.spec.runner.profile(kernel, shape, warmup, iters, cold, opts or {})
    m, n, k = shape
    op = kernel.op
    kernel.check_launch(m, n, k)
    info = runtime.device_info()
    nbytes = operand_bytes(kernel, m, n, k)
    sets = cold_sets(nbytes) if cold else 1  # enough buffer sets that a rotation overflows L2 twice
    rng = np.random.default_rng(seed)
    inp = make_inputs(op, m, n, k, rng, weights)
    kernel._module()  # compile and load before any timing
    if op.kind == "pack":
        dws = [runtime.DeviceArray.from_host(inp.w) for _ in range(sets)]
        dps = [runtime.DeviceArray.empty((packing.packed_nbytes(op.a.name, n, k),), np.uint8) for _ in range(sets)]

        def launch(i, stream=None):
            kernel.launch_pack(dws[i], dps[i], n, k, stream=stream)
    elif op.kind == "quantize":
        xs = [runtime.DeviceArray.from_host(inp.a) for _ in range(sets)]
        ys = [runtime.DeviceArray.empty((m, k // op.out.block), op.out.dtype) for _ in range(sets)]
        status = runtime.DeviceArray.from_host(np.zeros(1, np.int32))

        def launch(i, stream=None):
            kernel.launch_quantize(xs[i], ys[i], m, k, status, stream=stream)
    else:
        da = [kernel.upload_activations(inp.a) for _ in range(sets)]
        dw = [kernel.upload_weights(inp.w) for _ in range(sets)]
        dc = [runtime.DeviceArray.empty((m, n), np.float32) for _ in range(sets)]

        def launch(i, stream=None):
            kernel.launch(da[i], dw[i], dc[i], m, n, k, stream=stream)

    times, how = _time_launches(launch, sets, warmup, iters)
    runtime.check_last_error(kernel.name)
    med = statistics.median(times)
    fl = flops(kernel, m, n, k)
    bw = copy_bandwidth()
    unit = kernel.spec.unit or op.unit
    peak = peak_ops(unit, info)
    t_mem = nbytes / bw * 1e6
    t_cmp = fl / peak * 1e6 if peak else 0.0
    floor = max(t_mem, t_cmp)
    return Profile(
        kernel=kernel.name, shape=shape, cold=cold, iters=iters, median_us=med, min_us=min(times), max_us=max(times),
        tflops=fl / (med * 1e-6) / 1e12 if fl else 0.0, bytes=nbytes, gbps=nbytes / (med * 1e-6) / 1e9,
        floor_us=floor, roofline_pct=100.0 * floor / med, bound="compute" if t_cmp > t_mem else "memory",
        extra={"copy_bandwidth_gbps": bw / 1e9, "peak_tops": (peak or 0) / 1e12, "unit": unit, "buffer_sets": sets,
               "rotation_bytes": sets * nbytes if cold else 0, **how},
    )


def on_qgemm_device(fn):
    """Run a torch timing with torch's "cuda" (tensors, streams, events, graphs) meaning qgemm's
    device (QGEMM_DEVICE), so the peers run on the GPU the kernels do."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            import torch
        except Exception:
            return fn(*args, **kwargs)
        if not torch.cuda.is_available():
            return fn(*args, **kwargs)
        with torch.cuda.device(runtime.device_ordinal()):
            return fn(*args, **kwargs)

    return wrapper


@on_qgemm_device
def torch_peers(shape: tuple[int, int, int], warmup: int = 10, iters: int = 50) -> list[dict]:
    """torch A @ W.T in fp32/fp16/bf16 (cuBLAS) and torch._int_mm (cuBLASLt int8) on the same
    shape, timed the same way (hot, CUDA events, median). Empty when torch/CUDA is absent."""
    try:
        import torch
    except Exception:
        return []
    if not torch.cuda.is_available():
        return []
    m, n, k = shape
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)

    def timeit(fn):
        # timed as the bench's peers are (torch_time: hot, CUDA graphs of up to ~1 ms of
        # back-to-back calls, shorter at small shapes; per-call time = replay / calls)
        return torch_time(lambda: (), lambda: fn(), cold=False, warmup=warmup, iters=iters)

    for dt, label in ((torch.float16, "torch fp16 A@W.T (cuBLAS)"), (torch.bfloat16, "torch bf16 A@W.T (cuBLAS)"),
                      (torch.float32, "torch fp32 A@W.T (cuBLAS)")):
        a = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=dt, generator=g)
        us = timeit(lambda: a @ w.T)
        out.append({"peer": label, "median_us": us, "tflops": 2 * m * n * k / (us * 1e-6) / 1e12})
    if m > 16 and k % 8 == 0 and n % 8 == 0:  # _int_mm needs M > 16 and multiples of 8
        try:
            a = torch.randint(-128, 127, (m, k), device="cuda", dtype=torch.int8, generator=g)
            w = torch.randint(-128, 127, (n, k), device="cuda", dtype=torch.int8, generator=g)
            wt = w.T  # column-major B, as cuBLASLt wants it
            us = timeit(lambda: torch._int_mm(a, wt))
            out.append({"peer": "torch._int_mm int8 (cuBLASLt)", "median_us": us, "tflops": 2 * m * n * k / (us * 1e-6) / 1e12})
        except Exception as e:  # pragma: no cover - depends on the torch build
            out.append({"peer": "torch._int_mm int8 (cuBLASLt)", "error": str(e)})
    return out


def environment() -> dict:
    """Device, versions and date, stamped on every report."""
    from . import jit

    info = runtime.device_info()
    d = {
        "device": info.name,
        "device_ordinal": info.ordinal,
        "arch": info.arch,
        "sm_count": info.sm_count,
        "l2_mib": info.l2_bytes / 2**20,
        "driver": info.driver_version,
        "driver_cuda": "%d.%d" % info.driver_cuda_version,
        "nvrtc": "%d.%d" % jit.nvrtc_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        # programmatic dependent launch between consecutive kernels (QGEMM_PDL=0 turns it off):
        # back-to-back ops then overlap one's launch and first weight loads with the other's tail
        "pdl": bool(runtime.pdl_enabled() and info.cc >= 90),
    }
    try:
        import torch

        d["torch"] = torch.__version__
    except Exception:
        pass
    return d


# ---------------------------------------------------------------------------------------------
# qgemm bench: the sweep against peers

# the target shapes (tools/perf_report.py TARGETS: N = 4096, K = 4096 and 14336, M = 1 / 8
# / 64 / 512 / 2048), M swept over the powers of two around them
SWEEP_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SWEEP_N = 4096
SWEEP_K = (4096, 14336)


class ClockSampler:
    """The SM clock and board power sampled by `nvidia-smi` every `period_ms` while it is open, so a
    timing can be set beside the clock it ran at (a slower row: a lower clock, or not?). The
    constructor returns once the first sample is in (at most start_timeout_s; at once if nvidia-smi
    exits), so the first timing has a clock too. Without nvidia-smi it samples nothing and `window` returns None.

        with ClockSampler() as clk:
            t0 = time.time(); ...; w = clk.window(t0, time.time())   # {"sm_mhz", "power_w", "samples"}
    """

    def __init__(self, period_ms: int = 20, start_timeout_s: float = 5.0):
        self._proc = None
        self._log = None
        self._samples: list[tuple[float, float, float]] = []  # (time, MHz, W), parsed as the log grows
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".csv", prefix="qgemm-clocks-", delete=False)
        # a second handle of our own to read with: nvidia-smi writes through the first one, whose
        # file offset it shares, so seeking that one would move where its next line lands
        self._reader = open(self._log.name)
        self._partial = ""
        try:
            self._proc = subprocess.Popen([exe, "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                           "-lms", str(period_ms)], stdout=self._log, stderr=subprocess.DEVNULL)
        except OSError:  # not executable after all: time without clocks rather than fail the bench
            self.close()
            return
        self._wait_first_sample(start_timeout_s)

    def _wait_first_sample(self, timeout_s: float) -> None:
        """Return once nvidia-smi has written its first sample, has exited, or timeout_s has passed.
        Its start takes 0.1-1 s, more on a loaded host (beside the GPU suite's parallel processes the
        test's fake took over 0.3 s): a caller that times at once (tools/sweep_order.py's first
        shape) got no clock for its first timings."""
        deadline = time.monotonic() + timeout_s
        while not self._samples and self._proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
            self._read_new()

    def _read_new(self) -> None:
        """Parse the complete lines nvidia-smi appended since the last call (each line once)."""
        lines = (self._partial + self._reader.read()).split("\n")
        self._partial = lines.pop()  # "" or a line nvidia-smi is still writing
        for line in lines:
            parts = [p.strip() for p in line.split(",")]
            try:
                ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self._samples.append((ts, float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                continue  # a header, "[N/A]"

    def window(self, t0: float, t1: float) -> dict | None:
        """Medians of the samples taken in [t0, t1] (time.time() seconds), or None."""
        if self._log is None:
            return None
        self._read_new()
        inside = [(mhz, w) for ts, mhz, w in self._samples if t0 <= ts <= t1]
        if not inside:
            return None
        return {"sm_mhz": statistics.median(m for m, _ in inside), "power_w": statistics.median(w for _, w in inside),
                "samples": len(inside)}

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._proc = None
        if self._log is not None:
            self._reader.close()
            self._log.close()
            os.unlink(self._log.name)
            self._log = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _sets_for(nbytes: int, cold: bool) -> int:
    return cold_sets(nbytes) if cold else 1


# how pack_weights repacks (the `pack_ms` figures of a bench run): since session 36 on the GPU
PACK_METHOD = "upload of the host blocks + repacking on the GPU (pack.*)"


def time_matmul(fmt: str, m: int, n: int, k: int, cold: bool, rng, weights: dict, warmup: int = 5, iters: int = 30,
                path: str | None = None, packed: bool = True, sustain_s: float = 0.0, x_dtype: str = "f32") -> dict:
    """The whole op as qgemm.matmul runs it (prologue + GEMM), graph-batched like llama.cpp's perf
    mode. packed: the weights were made by qgemm.pack_weights (their one-time repacking is timed
    separately, by `sweep`), so the skinny kernels may run; else raw ggml blocks. sustain_s: each
    timing runs back to back for at least that long (`_time_launches`). x_dtype: the activations'
    type ("f32", "f16" or "bf16"), as a model in that precision hands them over."""
    from . import dispatch as mm
    from . import packing

    p = mm.plan(m, n, k, fmt, x_dtype, path, packed)
    xfmt = F.get_format(p.x_dtype)
    wq = weights[(fmt, n, k)]
    wbuf = packing.pack(wq, fmt) if p.packed and p.repack is None else wq
    nbytes = m * k * xfmt.dtype.itemsize + wq.nbytes + m * n * 4 + p.packed_weights_bytes
    sets = _sets_for(nbytes, cold)
    xs = [runtime.DeviceArray.from_host(F.from_float32(rng.standard_normal((m, k), dtype=np.float32), xfmt))
          for _ in range(sets)]
    ws = [runtime.DeviceArray.from_host(wbuf) for _ in range(sets)]
    staged = p.staged_format
    qs = [runtime.DeviceArray.empty(*staged) if staged else xs[i] for i in range(sets)]
    cs = [runtime.DeviceArray.empty((m, n), np.float32) for _ in range(sets)]
    # ggml blocks repacked on every call (Plan.repack): the op writes its packed copy here, and the
    # kernel alone reads it (packed by the op's timing, which runs first)
    ps = [runtime.DeviceArray.empty((p.packed_weights_bytes,), np.uint8) for _ in range(sets)] if p.repack else ws
    status = runtime.DeviceArray.from_host(np.zeros(1, np.int32))

    def launch(i, stream=None):
        p.launch(xs[i], ws[i], qs[i], cs[i], status, stream=stream, dpack=ps[i])

    def kernel_only(i, stream=None):
        from . import registry

        registry.get(p.kernel).launch(qs[i], ps[i], cs[i], m, n, k, stream=stream, defines=p.defines or None)

    t_all, how = _time_launches(launch, sets, warmup, iters, sustain_s)
    t_k, _ = _time_launches(kernel_only, sets, warmup, iters, sustain_s)
    med, kmed = statistics.median(t_all), statistics.median(t_k)
    for arr in xs + ws + cs + ([] if staged is None else qs) + (ps if p.repack else []):
        arr.free()
    return {"fmt": fmt, "M": m, "N": n, "K": k, "cold": cold, "x_dtype": p.x_dtype, "kernel": p.kernel, "packed": p.packed,
            "quantizer": p.quantizer, "repack": p.repack, "config": p.defines, "config_source": p.source,
            "matmul_us": med, "kernel_us": kmed, "quantize_us": max(med - kmed, 0.0), "tflops": 2 * m * n * k / med / 1e6,
            "weight_gbps": wq.nbytes / med / 1e3, "buffer_sets": sets, "method": how["method"]}


@on_qgemm_device
def torch_time(make, fn, cold: bool, warmup: int = 5, iters: int = 30, sustain_s: float = 0.0) -> float:
    """Median µs of `fn(*make())` (torch, CUDA events): B calls captured as one CUDA graph, B sized
    from one plain call's event time -- which includes torch's host overhead (~20-30 µs) -- and
    capped at 200, so a sample spans at most ~1 ms and less for short ops (~0.3 ms for a 10 µs
    GEMV). cold: rotated through 1 + ceil(2 L2 / set bytes) sets from `make`, at most 33 -- more
    than twice the L2 for sets above ~2 L2 / 33 (3.2 MB on a 50 MB L2; every default shape's), and
    partly L2-resident below that. The torch peers of
    `qgemm bench` and of its kvcache suite are timed by this one function. Starts with clear_l2,
    as qgemm's own timings do (a no-op unless QGEMM_BENCH_L2 asks for a reset). sustain_s: sampled
    back to back for at least that long, as qgemm's own rows (`_samples`)."""
    import torch

    l2 = max(runtime.device_info().l2_bytes, 1)
    if clear_l2():
        runtime.synchronize()  # torch times on its own stream
    one = make()
    nbytes = sum(t.numel() * t.element_size() for t in one)
    sets = [one] + ([make() for _ in range(min(32, int(np.ceil(2 * l2 / max(nbytes, 1)))))] if cold else [])
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn(*sets[0])
    e1.record()
    e1.synchronize()
    batch = round_batch(int(min(max(1.0 / max(e0.elapsed_time(e1), 1e-6), 1), 200)), len(sets))

    def run_batch():
        for j in range(batch):
            fn(*sets[j % len(sets)])

    # captured as a CUDA graph, as qgemm's own rows are: a Python loop of torch calls also timed
    # torch's launch overhead (~20-30 us per call), which bounded the small shapes' peers
    replay = run_batch
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_batch()  # cuBLAS picks its kernels and workspaces outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_batch()
        replay = graph.replay
    except Exception:  # pragma: no cover - a torch or driver without graph capture: the loop
        torch.cuda.synchronize()
    replay()
    torch.cuda.synchronize()
    def replay_timed():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        return lambda: (b.synchronize(), a.elapsed_time(b))[1]

    return statistics.median(ms * 1e3 / batch for ms in _samples(replay_timed, iters, sustain_s))


@on_qgemm_device
def torch_peer_times(m: int, n: int, k: int, cold: bool, warmup: int = 5, iters: int = 30, sustain_s: float = 0.0) -> dict:
    """torch fp16/bf16 A @ W.T (cuBLAS) and torch._int_mm (cuBLASLt int8), hot or rotated."""
    try:
        import torch
    except Exception:
        return {}
    if not torch.cuda.is_available():
        return {}
    out = {}

    def measure(make, fn):
        return torch_time(make, fn, cold, warmup, iters, sustain_s)

    for dt, key in ((torch.float16, "torch_fp16_us"), (torch.bfloat16, "torch_bf16_us")):
        out[key] = measure(lambda: (torch.randn(m, k, device="cuda", dtype=dt), torch.randn(n, k, device="cuda", dtype=dt)),
                           lambda a, w: a @ w.T)
    if m > 16:
        try:
            out["torch_int_mm_us"] = measure(
                lambda: (torch.randint(-128, 127, (m, k), device="cuda", dtype=torch.int8),
                         torch.randint(-128, 127, (n, k), device="cuda", dtype=torch.int8).T),
                lambda a, wt: torch._int_mm(a, wt))
        except Exception:
            pass
    return out


# Seconds the GPU idles between the sweep's hot and cold passes. The hot pass ends with its largest
# prefill rows, and the cold pass's first row (Q4_0 1x4096x4096, a ~4 µs op, the one judged against
# the copy bandwidth) then ran while the SM clock recovered from them: 1380-1530 MHz in sessions 36
# and 42's benches (73-76% of the copy bandwidth) against 1980 MHz and 80% after the pause, as when
# that row runs alone. Not before the hot K = 14336 pass, whose first row follows the 4096-token
# rows too: after 2 s idle the hot Q4_0 1x4096x14336 row ran at 1980 MHz but at ~123 W and slower,
# 10.2-10.5 µs against 9.6-10.1 without the pause (session 42, H100): the idle GPU's low power
# state costs a 33 MB hot row more than the clock gains, while the cold rows stream from DRAM.
SETTLE_S = 2.0


def sweep(ms=SWEEP_M, ks=SWEEP_K, n: int = SWEEP_N, fmts=("q4_0", "q8_0"), modes=(False, True), peers: bool = True,
          progress=None, iters: int = 30, clocks: bool = False, sustain_s: float = 0.0, x_dtype: str = "f32",
          settle_s: float = SETTLE_S) -> dict:
    """Everything `qgemm bench` reports, as a dict (environment, copy bandwidth, rows, and with an
    M = 1 row the read ceilings at its weight bytes; `progress` is called after each). clocks: each
    row also gets the SM clock and power during its qgemm.matmul / kernel timings (`ClockSampler`).
    sustain_s: every timing (qgemm's and the peers') runs back to back for at least that long.
    x_dtype: qgemm's activations ("f32", "f16" or "bf16"; the peers take theirs in fp16 / bf16 / int8).
    settle_s: the GPU idles this long before the cold pass (see SETTLE_S)."""
    rng = np.random.default_rng(0)
    weights = {}
    for fmt in fmts:
        for k in ks:
            weights[(fmt, n, k)] = F.quantize(rng.standard_normal((n, k), dtype=np.float32), fmt)
    from . import packing

    pack_ms = {}  # the one-time repacking (PACK_METHOD), not part of any matmul time
    packing.pack_weights(np.zeros((16, 4), F.block_q4_0)).packed.free()  # first-use costs are not the repack's
    for (fmt, nn, k), wq in weights.items():
        pw = packing.pack_weights(wq)
        pack_ms[f"{fmt} {nn}x{k}"] = pw.pack_seconds * 1e3
        pw.packed.free()
        pw.blocks.free()
    copy_start = measure_copy_bandwidth()
    rows = []
    jobs = [(cold, k, m, fmt) for cold in modes for k in ks for m in ms for fmt in fmts]
    peer_cache: dict = {}
    sampler = ClockSampler() if clocks else None
    try:
        for i, (cold, k, m, fmt) in enumerate(jobs):
            if i and cold and not jobs[i - 1][0]:
                time.sleep(settle_s)
            t0 = time.time()
            r = time_matmul(fmt, m, n, k, cold, rng, weights, iters=iters, sustain_s=sustain_s, x_dtype=x_dtype)
            if sampler is not None:
                r["clock"] = sampler.window(t0, time.time())
            if r["packed"]:  # the same op on raw ggml blocks (no pack_weights): what an unpacked caller gets
                rb = time_matmul(fmt, m, n, k, cold, rng, weights, iters=iters, packed=False, sustain_s=sustain_s,
                                 x_dtype=x_dtype)
                r.update(blocks_kernel=(f"{rb['repack']} + " if rb.get("repack") else "") + rb["kernel"],
                         blocks_matmul_us=rb["matmul_us"])
            if peers:
                key = (m, k, cold)
                if key not in peer_cache:
                    peer_cache[key] = torch_peer_times(m, n, k, cold, iters=iters, sustain_s=sustain_s)
                r.update(peer_cache[key])
            rows.append(r)
            if progress:
                progress(r)
    finally:  # the nvidia-smi child must not outlive a failed sweep
        if sampler is not None:
            sampler.close()
    # the read ceilings at the decode rows' weight bytes, in the same run (`read_ceiling`)
    ceilings = []
    if 1 in ms:
        for cold in modes:
            for (fmt, nn, k), wq in weights.items():
                ceilings.append({"fmt": fmt, "N": nn, "K": k, **read_ceiling(wq.nbytes, cold, iters=iters, sustain_s=sustain_s)})
                if progress:
                    progress(ceilings[-1])
    # the higher of the two measurements: a row's share of the copy bandwidth is never flattered by a slow copy
    copies = [copy_start / 1e9, measure_copy_bandwidth() / 1e9]
    return {"environment": environment(), "copy_bandwidth_gbps": max(copies), "copy_bandwidth_runs_gbps": copies,
            "pack_ms": pack_ms, "pack_method": PACK_METHOD, "rows": rows, "read_ceilings": ceilings, "l2_reset": l2_mode(), "sustain_s": sustain_s,
            "x_dtype": x_dtype, "settle_s": settle_s if len(set(modes)) > 1 else None}


def sweep_markdown(data: dict, command: str) -> str:
    from .dispatch import _X_NAMES  # "bf16" -> "bfloat16"

    env = data["environment"]
    out = [f"- device: **{env['device']}** ({env['arch']}), driver {env['driver']}, NVRTC {env['nvrtc']}"
           + (f", torch {env['torch']}" if "torch" in env else ""),
           f"- date: {env['date']}", f"- command: `{command}`",
           *([f"- qgemm's activations: {_X_NAMES[data['x_dtype']]} (--x-dtype; the peers are timed as in every run)"]
             if data.get("x_dtype", "f32") != "f32" else []),
           f"- measured copy bandwidth: {data['copy_bandwidth_gbps']:.0f} GB/s (read + write)"
           + (" -- the higher of {:.0f} before the sweep and {:.0f} after it".format(*data["copy_bandwidth_runs_gbps"])
              if data.get("copy_bandwidth_runs_gbps") else "")]
    if data.get("pack_ms"):
        # (a JSON from before session 36 has no pack_method: its repacking ran on the host)
        out.append(f"- one-time weight repacking for the skinny kernels (`qgemm.pack_weights`: "
                   f"{data.get('pack_method', 'host repack + upload')}, not in any time below): "
                   + ", ".join(f"{k} {v:.1f} ms" for k, v in data["pack_ms"].items()))
    out.append("- `qgemm.matmul µs` takes packed weights; `ggml blocks µs` is the same call on raw ggml blocks "
               "(where that picks another kernel; `pack.*` + a kernel: the blocks repacked on the GPU in every call)")
    out.append("- every figure is the median of CUDA-graph samples of back-to-back launches (~1 ms each for "
               "qgemm's rows; the torch peers' samples are shorter at small shapes) after 5 "
               "warm-up launches; `kernel µs` is the GEMM kernel timed on its own in a separate graph, not a part "
               "of the op's time (two timings, each with its own spread: at small M it can come out a little above "
               "the op's); "
               "`torch int8` is `torch._int_mm`, which takes M > 16 only")
    reset = data.get("l2_reset")
    if reset == "off":
        out.append("- hot timings start from the L2 the previous row left (`QGEMM_BENCH_L2=off`, the default): with "
                   "17-33 MB of weights a hot time depends on that order (docs/performance-notes.md)")
    elif reset:
        how = {"read": "a kernel reads twice its size", "memset": "twice its size of memset"}[reset]
        out.append(f"- every timing (qgemm and torch) starts from a reset L2 ({how}, `QGEMM_BENCH_L2={reset}`), "
                   "then warms up")
    if data.get("sustain_s"):
        out.append(f"- every timing (qgemm's and torch's) ran its samples back to back for at least "
                   f"{data['sustain_s']:g} s (`--sustain`), as llama.cpp's `test-backend-ops perf` runs each op for "
                   "at least a second; the median of all of them")
    if data.get("settle_s"):
        out.append(f"- the GPU idled {data['settle_s']:g} s between the hot and the cold pass (`--settle`), so the cold "
                   "pass does not start at the clock the hot pass's prefill rows left")
    clk = [r["clock"] for r in data["rows"] if r.get("clock")]
    if clk:
        mhz, watts = [c["sm_mhz"] for c in clk], [c["power_w"] for c in clk]
        out.append(f"- SM clock during the qgemm timings (`--clocks`, nvidia-smi every 20 ms, median per row): "
                   f"{min(mhz):.0f}-{max(mhz):.0f} MHz, board power {min(watts):.0f}-{max(watts):.0f} W")
    out.append("")
    for cold in (False, True):
        rows = [r for r in data["rows"] if r["cold"] == cold]
        if not rows:
            continue
        out.append(f"### {'Cold (buffers rotated through > 2x L2)' if cold else 'Hot (same buffers, back-to-back)'}\n")
        with_clk = any(r.get("clock") for r in rows)  # `--clocks`: the row's SM clock and board power
        out.append("| type | M | N | K | qgemm.matmul µs | kernel µs | kernel | TFLOPS | weight GB/s | ggml blocks µs (kernel) "
                   "| torch fp16 µs | torch bf16 µs | torch int8 µs |" + (" SM MHz (W) |" if with_clk else ""))
        out.append("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if with_clk else ""))
        for r in rows:
            f = lambda key: f"{r[key]:.1f}" if key in r else "-"  # noqa: E731
            blocks = f"{r['blocks_matmul_us']:.1f} (`{r['blocks_kernel']}`)" if "blocks_matmul_us" in r else "-"
            c = r.get("clock")
            clk = (f" {c['sm_mhz']:.0f} ({c['power_w']:.0f}) |" if c else " - |") if with_clk else ""
            out.append(f"| {r['fmt']} | {r['M']} | {r['N']} | {r['K']} | {r['matmul_us']:.1f} | {r['kernel_us']:.1f} | "
                       f"`{r['kernel']}` | {r['tflops']:.1f} | {r['weight_gbps']:.0f} | {blocks} | {f('torch_fp16_us')} | "
                       f"{f('torch_bf16_us')} | {f('torch_int_mm_us')} |" + clk)
        out.append("")
    out += read_ceiling_table(data)
    return "\n".join(out)


def read_ceiling_table(data: dict) -> list[str]:
    """The decode rows (M = 1) beside the read ceilings measured at their weight bytes in the same
    run (`read_ceiling`); empty for a bench without them."""
    ceilings = data.get("read_ceilings") or []
    rows = {(r["fmt"], r["N"], r["K"], r["cold"]): r for r in data["rows"] if r["M"] == 1}
    if not ceilings:
        return []
    out = ["### Read ceilings at the decode rows' weight bytes\n",
           "What a kernel that only reads the M = 1 row's weight bytes achieves, launched back to back as the row is "
           "timed (`qgemm.bench.read_ceiling`, cuda_src/bench/stream_read.cu): *independent*, its reads free to "
           "overlap the previous launch; *dependent*, its reads after the programmatic-dependent-launch wait for the "
           "previous launch. A decode op reads its weights before that wait only as far as it can hold them."
           + ("" if all(c.get("pdl") for c in ceilings) else
              " (Here launches were plain -- PDL off or before sm_90 -- so the two ceilings measure the same thing.)")
           + "\n",
           "| type | weights | MB | cache | qgemm.matmul µs | independent µs (GB/s) | dependent µs (GB/s) |",
           "|---|---|---:|---|---:|---:|---:|"]
    for c in sorted(ceilings, key=lambda c: (c["cold"], c["K"], c["fmt"])):
        r = rows.get((c["fmt"], c["N"], c["K"], c["cold"]))
        op = f"{r['matmul_us']:.2f}" if r else "-"
        gbps = lambda us: c["bytes"] / us / 1e3  # noqa: E731
        out.append(f"| {c['fmt']} | {c['N']}x{c['K']} | {c['bytes'] / 1e6:.2f} | {'cold' if c['cold'] else 'hot'} | {op} | "
                   f"{c['independent_us']:.2f} ({gbps(c['independent_us']):.0f}) | "
                   f"{c['dependent_us']:.2f} ({gbps(c['dependent_us']):.0f}) |")
    return out + [""]


def sweep_plots(data: dict, directory, stem: str = "bench") -> list[str]:
    """TFLOPS vs M and weight GB/s vs M (with the measured copy bandwidth), one PNG per mode (hot,
    cold) in `directory`, named `{stem}-hot.png` / `{stem}-cold.png` (another device's run beside
    the published one: stem="bench-h200"); returns the paths. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for cold in (False, True):
        fig = _sweep_figure(data, cold)
        if fig is None:
            continue
        p = directory / f"{stem}-{'cold' if cold else 'hot'}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        files.append(str(p))
    return files


def _sweep_figure(data: dict, cold: bool):
    """The figure of one mode (None without rows): a series per (format, K), drawn in the same
    colour on both panels (a reader matches a TFLOPS curve to its GB/s curve by colour), and
    torch fp16 per K dashed in grey, since its weights are fp16, not the format's blocks."""
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r["cold"] == cold]
    if not rows:
        return None
    tag = "cold" if cold else "hot"
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    series = sorted({(r["fmt"], r["K"]) for r in rows})
    ks = sorted({k for _, k in series})
    peer_grey = {k: str(0.15 + 0.45 * i / max(1, len(ks) - 1)) for i, k in enumerate(ks)}
    for i, (fmt, k) in enumerate(series):
        sel = sorted((r for r in rows if r["fmt"] == fmt and r["K"] == k), key=lambda r: r["M"])
        ms = [r["M"] for r in sel]
        style = dict(marker="o", color=f"C{i}", label=f"qgemm {fmt} K={k}")
        axes[0].plot(ms, [r["tflops"] for r in sel], **style)
        axes[1].plot(ms, [r["weight_gbps"] for r in sel], **style)
    for k in ks:  # the peer once per K (every format's rows time the same torch matmul)
        sel = sorted((r for r in rows if r["K"] == k and "torch_fp16_us" in r and r["fmt"] == series[0][0]),
                     key=lambda r: r["M"])
        if sel:
            axes[0].plot([r["M"] for r in sel], [2 * r["M"] * r["N"] * r["K"] / r["torch_fp16_us"] / 1e6 for r in sel],
                         ls="--", color=peer_grey[k], label=f"torch fp16 K={k}")
    # the figure the cold-decode target is judged against (tools/perf_report.py): read + write
    # bytes of a device copy per second -- what the memory system moves, so a read-only stream
    # can approach it (a line at half of it, the copy's reads alone, was once drawn here)
    axes[1].axhline(data["copy_bandwidth_gbps"], color="k", ls=":", label="measured copy bandwidth (read + write)")
    for ax, title, ylabel in zip(axes, ("TFLOPS vs M", "weight bytes / time (GB/s) vs M"), ("TFLOPS", "GB/s of weight bytes")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, {tag}\n{data['environment']['device']}, {data['environment'].get('date', '')}", fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
