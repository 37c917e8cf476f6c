"""The GPU side: device and primary context, modules, device arrays, copies, streams, events.

cuda.core gives the device/context, streams, events, module loading and `launch`; cuda.bindings'
driver module does the rest (allocation, copies, memset, attributes). Every driver result is
checked and a failure raises `CudaError` naming the call.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import CudaError, NoGPUError
from .formats import BF16_DTYPE, is_bf16

# ---------------------------------------------------------------------------------------------
# checking results


def check(result, call: str):
    """Unwrap a cuda.bindings return tuple (err, *values); raise CudaError on err != 0."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        from cuda.bindings import driver

        name = getattr(err, "name", str(err))
        try:
            _, desc = driver.cuGetErrorString(err)
            desc = desc.decode() if isinstance(desc, bytes) else str(desc)
        except Exception:
            desc = "(no description)"
        raise CudaError(call, desc, name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _wrap(call: str, fn, *args, **kwargs):
    """Run a cuda.core call, turning its exceptions into CudaError that names the call."""
    try:
        return fn(*args, **kwargs)
    except (NoGPUError, CudaError, ValueError):
        raise
    except Exception as e:
        raise CudaError(call, str(e)) from e


def remember(table: dict, key, value, cap: int):
    """table[key] = value, returned: the store of the host path's memos (plans, launch
    configurations, checked streams), emptied first once it holds `cap` entries so that a process
    cycling through shapes cannot grow one without bound. No lock: threads racing here at worst
    work an entry out twice."""
    if len(table) >= cap:
        table.clear()
    table[key] = value
    return value


_mods: dict = {}


def _cuda_core():
    """cuda.core, imported on first use and then a dict read: `from cuda.core import X` inside a
    function costs ~0.5 us per call even when imported, and the launch path runs several per op."""
    m = _mods.get("core")
    if m is None:
        import cuda.core as m

        _mods["core"] = m
    return m


def _cuda_driver():
    """cuda.bindings.driver, as _cuda_core."""
    m = _mods.get("driver")
    if m is None:
        from cuda.bindings import driver as m

        _mods["driver"] = m
    return m


# ---------------------------------------------------------------------------------------------
# the device


@lru_cache(maxsize=None)
def device_ordinal() -> int:
    """The GPU qgemm runs on: `QGEMM_DEVICE`, an ordinal among the devices the driver shows
    (after CUDA_VISIBLE_DEVICES), default 0. Read once per process: kernels, device arrays and
    streams all belong to that device's primary context. ValueError if it is not an integer >= 0."""
    raw = os.environ.get("QGEMM_DEVICE", "").strip()
    if not raw:
        return 0
    try:
        ordinal = int(raw)
    except ValueError:
        ordinal = -1
    if ordinal < 0:
        raise ValueError(f"QGEMM_DEVICE must be a CUDA device ordinal (an integer >= 0), got {raw!r}")
    return ordinal


@lru_cache(maxsize=None)
def _probe() -> tuple[bool, str]:
    try:
        ordinal = device_ordinal()
    except ValueError as e:
        return False, str(e)
    try:
        from cuda.bindings import driver
    except Exception as e:
        return False, f"cuda.bindings is not importable ({e})"
    try:
        err = driver.cuInit(0)[0]
    except Exception as e:  # libcuda.so not found: no NVIDIA driver on this machine
        return False, f"no NVIDIA driver found ({type(e).__name__}: {e})"
    if int(err) != 0:
        name = getattr(err, "name", err)
        if _forked_from is not None and int(err) == int(driver.CUresult.CUDA_ERROR_NOT_INITIALIZED):
            # in a forked child, cuInit returns exactly this when the parent had initialised CUDA
            return False, (f"cuInit failed: {name}: this process is a fork of process {_forked_from}, which had "
                           "initialised CUDA (qgemm, torch, CuPy or another library) before forking, and CUDA "
                           "cannot be used in such a child; start the processes that use the GPU with "
                           "multiprocessing's 'spawn' or 'forkserver' method")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and int(err) == int(driver.CUresult.CUDA_ERROR_NO_DEVICE):
            return False, (f"cuInit failed: {name}: CUDA_VISIBLE_DEVICES={visible!r} leaves this process no GPU "
                           "(unset it, or name a GPU that nvidia-smi lists by index or UUID)")
        return False, f"cuInit failed: {name} (no usable GPU or driver)"
    err, count = driver.cuDeviceGetCount()
    if int(err) != 0 or count == 0:
        return False, "the NVIDIA driver reports no CUDA devices"
    if ordinal >= count:
        return False, (f"QGEMM_DEVICE={ordinal} names no device: the driver reports {count} "
                       f"(ordinals 0..{count - 1}{', after CUDA_VISIBLE_DEVICES' if os.environ.get('CUDA_VISIBLE_DEVICES') else ''})")
    return True, ""


def gpu_available() -> bool:
    """Whether a usable NVIDIA GPU and driver are here (and QGEMM_DEVICE names one). Probed once
    per process (and again in a forked child, where CUDA is unusable if the parent had initialised
    it); never raises (`qgemm.runtime.gpu_unavailable_reason()` says why not)."""
    return _probe()[0]


def gpu_unavailable_reason() -> str:
    return _probe()[1]


def dtype_name(dt) -> str:
    """A dtype for messages: numpy's name, "bfloat16" for the 2-byte void qgemm holds bfloat16 as
    (qgemm.formats.BF16), or what another opaque typestr is."""
    dt = np.dtype(dt)
    if is_bf16(dt):
        return "bfloat16"
    if dt.kind == "V" and dt.names is None:
        return f"an opaque {dt.itemsize}-byte type ({dt.str})"
    if dt.names is not None:  # numpy would say "void16"
        return f"a {dt.itemsize}-byte structured type {dt.descr}"
    if not dt.isnative:
        return f"{dt.name} in non-native byte order ({dt.str})"
    return dt.name


def require_gpu(what: str = "this") -> None:
    ok, why = _probe()
    if not ok:
        raise NoGPUError(f"{what} needs an NVIDIA GPU, but none is usable here: {why}")


@lru_cache(maxsize=None)
def device():
    """qgemm's cuda.core Device (device_ordinal(): QGEMM_DEVICE, default 0), made current (its
    primary context) in this thread."""
    require_gpu("the GPU runtime")
    from cuda.core import Device

    ordinal = device_ordinal()
    dev = _wrap(f"cuda.core.Device({ordinal})", Device, ordinal)
    _wrap("Device.set_current", dev.set_current)
    return dev


def ensure_current():
    """Make qgemm's device's primary context current in the calling thread (threads start with none)."""
    dev = device()
    _wrap("Device.set_current", dev.set_current)
    return dev


def _attr(name: str) -> int:
    from cuda.bindings import driver

    ensure_current()
    attr = getattr(driver.CUdevice_attribute, name)
    dev = check(driver.cuDeviceGet(device_ordinal()), "cuDeviceGet")
    return int(check(driver.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name})"))


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    cc: int  # 90 for sm_90
    sm_count: int
    clock_khz: int
    mem_clock_khz: int
    bus_width_bits: int
    l2_bytes: int
    smem_per_block_optin: int
    total_mem: int
    driver_cuda_version: tuple[int, int]
    driver_version: str
    ordinal: int = 0       # which device (QGEMM_DEVICE)
    device_count: int = 1  # of how many the driver shows

    @property
    def arch(self) -> str:
        return f"sm_{self.cc}"

    @property
    def nominal_bandwidth(self) -> float:
        """Bytes/s from the memory clock and bus width (DDR: x2). A datasheet-style figure."""
        return 2.0 * self.mem_clock_khz * 1e3 * self.bus_width_bits / 8


@lru_cache(maxsize=None)
def device_info() -> DeviceInfo:
    from cuda.bindings import driver

    dev = device()
    ver = int(check(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
    drv = "unknown"
    try:  # the display driver's version (e.g. 580.159.04) comes from NVML, which may be absent
        from cuda.core import system

        for fn in ("get_kernel_mode_driver_version", "get_user_mode_driver_version", "get_driver_version"):
            if hasattr(system, fn):
                v = getattr(system, fn)()
                drv = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
                break
    except Exception:
        pass
    cc = dev.compute_capability
    cudev = check(driver.cuDeviceGet(device_ordinal()), "cuDeviceGet")
    total = int(check(driver.cuDeviceTotalMem(cudev), "cuDeviceTotalMem"))

    def safe(name: str) -> int:
        try:
            return _attr(name)
        except Exception:
            return 0

    return DeviceInfo(
        name=str(dev.name),
        cc=int(cc[0]) * 10 + int(cc[1]),
        sm_count=_attr("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
        clock_khz=safe("CU_DEVICE_ATTRIBUTE_CLOCK_RATE"),
        mem_clock_khz=safe("CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE"),
        bus_width_bits=safe("CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH"),
        l2_bytes=safe("CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE"),
        smem_per_block_optin=safe("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        total_mem=total,
        driver_cuda_version=(ver // 1000, (ver % 1000) // 10),
        driver_version=drv,
        ordinal=device_ordinal(),
        device_count=int(check(driver.cuDeviceGetCount(), "cuDeviceGetCount")),
    )


def device_arch() -> str:
    """'sm_XX' of qgemm's device."""
    return device_info().arch


# ---------------------------------------------------------------------------------------------
# fork

_forked_from: int | None = None  # in a process forked after qgemm was imported: the parent's pid


def _after_fork_in_child() -> None:
    # A forked child inherits the parent's probe result and cuda.core Device, but no usable CUDA
    # if the parent had initialised it: every driver call then fails with CUDA_ERROR_NOT_INITIALIZED
    # (a "Device.set_current failed" from deep inside a launch, or a "no usable GPU"). Forget both,
    # so that the child's first GPU use probes again and _probe says why. (device_info stays: the
    # same GPU, and it launches nothing.)
    global _forked_from
    _forked_from = os.getppid()
    _probe.cache_clear()
    device.cache_clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------------------------------
# streams and events


def default_stream():
    return device().default_stream


def as_stream(stream=None):
    """None -> the device's default stream; a cuda.core Stream; an int handle; or an object with
    `cuda_stream` (torch.cuda.Stream, cupy.cuda.Stream) or `__cuda_stream__`. ValueError for
    anything else, and for a stream of another GPU than qgemm's."""
    return _as_stream(stream, False)


def launch_stream(stream=None):
    """as_stream for qgemm's own calls (matmul, the kernels, the KV-cache ops), which never hand
    the Stream out or close it: a caller's handle comes back as the one wrapper qgemm keeps for
    it (wrapping costs ~5 us of an eager call's host time)."""
    return _as_stream(stream, True)


def _as_stream(stream, shared: bool):
    if stream is None:
        return default_stream()
    Stream = _cuda_core().Stream
    if isinstance(stream, Stream):  # qgemm's own streams come this way, once per launch: not re-checked
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return _foreign_stream(int(stream.__cuda_stream__()[1]), stream, shared)
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, (int, np.integer)) and not isinstance(handle, (bool, np.bool_)):
        if int(handle) < 0:
            raise ValueError(f"stream: an int stream handle is an address, >= 0 (0: the default stream), got {int(handle)}")
        if int(handle) == 0:
            return default_stream()
        return _foreign_stream(int(handle), stream, shared)
    raise ValueError(f"stream: expected a cuda.core Stream, an int handle or a torch/CuPy stream, got {type(stream).__name__}")


_checked_streams: dict = {}  # handle -> the cuda.core Stream _same_device passed (one-GPU processes)


def _foreign_stream(handle: int, given, shared: bool = False):
    """A caller's stream handle as a cuda.core Stream of qgemm's device, device-checked once per
    handle where there is one GPU (a handle destroyed and reused is still a stream of that GPU;
    the check's driver queries were the largest part of an eager call's host time when given
    torch's current stream). shared: qgemm's own calls, which never hand the Stream out or close
    it, take the one wrapper kept for the handle (wrapping costs ~5 us); anyone else gets a new
    one, which they may close."""
    Stream = _cuda_core().Stream
    kept = _checked_streams.get(handle)
    if kept is not None:
        ensure_current()  # what _same_device does first: a fresh thread has no context
        return kept if shared else _wrap("Stream.from_handle", Stream.from_handle, handle)
    s = _same_device(_wrap("Stream.from_handle", Stream.from_handle, handle), given)
    if gpu_available() and device_info().device_count == 1:
        remember(_checked_streams, handle, s if shared else _wrap("Stream.from_handle", Stream.from_handle, handle), 256)
    return s


def _same_device(s, given):
    """A stream of another GPU's context must not get qgemm's launches: the kernel would run on
    that GPU against buffers of this one (or the launch fail, naming nothing). Said up front."""
    from cuda.bindings import driver

    ensure_current()
    with relaxed_capture():
        err, ctx = driver.cuStreamGetCtx(s.handle)
        if int(err) != 0:  # not a stream handle at all: the launch reports it
            return s
        ordinal = _context_device(ctx)
    if ordinal != device_ordinal():
        raise ValueError(f"stream: expected a stream of CUDA device {device_ordinal()} (qgemm's device), got a "
                         f"{type(given).__name__} of device {ordinal}")
    return s


def record_event(stream=None):
    """A timing event recorded on `stream`; `end - start` gives milliseconds (cuda.core Event)."""
    s = as_stream(stream)
    return _wrap("Stream.record", s.record, options=_timing_options())


@lru_cache(maxsize=None)
def _timing_options():
    from cuda.core import EventOptions

    try:  # cuda.core >= 0.3 spells it timing_enabled; older releases enable_timing
        return EventOptions(timing_enabled=True)
    except TypeError:
        return EventOptions(enable_timing=True)


def elapsed_ms(start, end) -> float:
    _wrap("Event.sync", end.sync)
    return float(_wrap("cuEventElapsedTime", lambda: end - start))


def create_stream():
    """A new non-blocking stream of the device (graph capture needs one: the legacy default
    stream cannot be captured)."""
    return _wrap("Device.create_stream", device().create_stream)


@contextlib.contextmanager
def relaxed_capture():
    """This thread may make calls a stream capture would otherwise refuse (cuMemAlloc is
    "potentially unsafe" while any stream is captured in global mode, torch.cuda.graph's default):
    they run now, outside the graph -- as torch's own allocator does during a capture."""
    from cuda.bindings import driver

    err, old = driver.cuThreadExchangeStreamCaptureMode(driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    if int(err) != 0:  # pragma: no cover - a driver without capture modes
        yield
        return
    try:
        yield
    finally:
        driver.cuThreadExchangeStreamCaptureMode(old)


def is_capturing(stream=None) -> bool:
    """Whether `stream` is being captured into a CUDA graph (work queued on it is recorded, not
    run); True too for the legacy stream while a blocking stream captures: it cannot take work."""
    return capture_id(stream) is not None


def capture_id(stream=None) -> int | None:
    """The id of the CUDA graph capture `stream` is in (unique within the process), None when it is
    not being captured; 0 for the legacy stream while a blocking stream captures (CAPTURE_IMPLICIT:
    it cannot take work, and the launch will say so)."""
    ensure_current()  # the legacy stream means the current context's: a fresh thread has none
    return stream_capture_id(as_stream(stream).handle)


def stream_capture_id(handle) -> int | None:
    """capture_id of a stream handle (a cuda.core Stream's .handle or an int), in a thread where
    qgemm's context is already current (qgemm.matmul asks once per call, after prepare_call)."""
    driver = _cuda_driver()
    # cuStreamIsCapturing first: the capture info (several objects built by the bindings) is only
    # needed while a capture is on, and this runs in every matmul
    err, status = driver.cuStreamIsCapturing(handle)
    if getattr(err, "name", "") == "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT":
        return 0
    check(err, "cuStreamIsCapturing")
    if status == driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
        return None
    res = driver.cuStreamGetCaptureInfo(handle)
    err = res[0]
    if getattr(err, "name", "") == "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT":
        return 0
    check(err, "cuStreamGetCaptureInfo")
    if res[1] != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return None
    return int(res[2])


def prepare_call(stream, what: str, uncapturable: str | None = None) -> None:
    """What every public entry point does before it queues work: make qgemm's context current in
    this thread (threads start with none); while torch captures, insist on the capturing stream
    (check_capture_stream); and refuse, while `stream` is captured, a call that cannot be --
    `uncapturable` says why (None: this call can be)."""
    ensure_current()
    check_capture_stream(stream, what)
    if uncapturable and is_capturing(stream):
        raise ValueError(f"{what}: {uncapturable}")


def check_capture_stream(stream, what: str) -> None:
    """Inside `torch.cuda.graph` a call on another stream than the capturing one is not captured:
    it runs now, once, and the replays leave its output stale -- with no error from CUDA, since
    torch captures on a non-blocking stream (the legacy default stream, stream=None, stays free).
    So while torch captures its current stream (when torch is imported at all), qgemm's stream
    must be a capturing one."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        capturing = bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # a torch without CUDA
        return
    if capturing and not is_capturing(stream):
        raise ValueError(f"{what}: torch is capturing a CUDA graph on its current stream, but this call's stream "
                         f"({'the default stream: stream=None' if stream is None else type(stream).__name__}) is not being "
                         "captured: it would run once, now, outside the graph; pass stream=torch.cuda.current_stream()")


# Device buffers the ops of a capture took for the graph's replays (qgemm.dispatch's per-capture
# scratch), by capture id. A qgemm Graph takes its capture's when the capture ends and frees them
# with itself; those of a caller's capture (torch.cuda.graph) stay for the process.
_capture_buffers: dict = {}
_capture_lock = threading.Lock()


def hold_for_capture(cid: int, buf) -> None:
    with _capture_lock:
        _capture_buffers.setdefault(cid, []).append(buf)


def _take_capture_buffers(cid: int) -> list:
    from . import dispatch

    dispatch._forget_capture(cid)
    with _capture_lock:
        return _capture_buffers.pop(cid, [])


class Graph:
    """Launches recorded once on a stream and replayed as one CUDA graph: the replay has no host
    overhead between kernels, so timing B replayed launches measures the GPU, not Python. The
    scratch the recorded ops took lives as long as this object (bench and compare-llamacpp
    capture one graph per row)."""

    def __init__(self, record, stream):
        from cuda.bindings import driver

        h = stream.handle
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(driver.cuStreamBeginCapture(h, mode), "cuStreamBeginCapture")
        cid = None
        try:
            cid = capture_id(stream)
            record()
        except BaseException:
            res = driver.cuStreamEndCapture(h)
            try:  # the partial graph, if the driver returned one, is not kept
                g = res[1] if isinstance(res, tuple) and len(res) > 1 else None
                if g is not None and int(g):
                    driver.cuGraphDestroy(g)
            except Exception:
                pass
            if cid is not None:
                _take_capture_buffers(cid)  # dropped: no graph will replay them
            raise
        self._held = _take_capture_buffers(cid)
        self._graph = check(driver.cuStreamEndCapture(h), "cuStreamEndCapture")
        self._exec = check(driver.cuGraphInstantiate(self._graph, 0), "cuGraphInstantiate")
        self.stream = stream

    def launch(self) -> None:
        from cuda.bindings import driver

        check(driver.cuGraphLaunch(self._exec, self.stream.handle), "cuGraphLaunch")

    def __del__(self):
        try:
            from cuda.bindings import driver

            driver.cuGraphExecDestroy(self._exec)
            driver.cuGraphDestroy(self._graph)
        except Exception:
            pass


def synchronize(stream=None) -> None:
    """Wait until the work queued on `stream` (None: the default stream) has finished."""
    _wrap("Stream.sync", as_stream(stream).sync)


def reset_persisting_l2() -> None:
    """Demote every L2 line held with persisting priority to normal (cuCtxResetPersistingL2Cache):
    lines a stream access-policy window marked persisting otherwise keep part of the L2 from the
    kernels after it. (tools/sweep_order.py --after-peers reset-l2 tried it after the torch peers
    of `qgemm bench`, session 11: it did not change the decode rows that follow them.)"""
    from cuda.bindings import driver

    ensure_current()
    check(driver.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")


# ---------------------------------------------------------------------------------------------
# device arrays


_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_CUDA_TYPES = (_DL_CUDA, _DL_CUDA_MANAGED)


def _other_device_message(what: str, ordinal: int) -> str:
    return (f"expected an array on CUDA device {device_ordinal()} (qgemm's device), got a {what} on device {ordinal}; "
            f"move it there, or run qgemm on device {ordinal} (QGEMM_DEVICE={ordinal}, set before qgemm first uses the GPU)")


def _pointer_device(ptr: int) -> int | None:
    """The ordinal of the device whose memory `ptr` is, or None if CUDA does not know it.

    From the allocation's context: CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL reads 0 for every device
    in cuda.bindings up to at least 13.3 (NVIDIA/cuda-python#2928: the value is read back from the
    wrong field). Memory without a context (virtual-memory and pool allocations, e.g. torch's
    expandable segments or its cudaMallocAsync backend) can only ask it: a nonzero ordinal is real
    (once the bindings are fixed), but a 0 may be the bug, so it counts as qgemm's device -- not
    refused: until then qgemm, on any device, cannot tell such memory of another GPU."""
    from cuda.bindings import driver

    attrs = driver.CUpointer_attribute
    err, ctx = driver.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_CONTEXT, ptr)
    if int(err) != 0:
        return None
    if int(ctx) == 0:
        err, ordinal = driver.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        if int(err) != 0:
            return None
        return int(ordinal) or device_ordinal()
    return _context_device(ctx)


def _context_device(ctx) -> int:
    """The device ordinal of a CUDA context (qgemm's own context is current). With one GPU every
    context is that GPU's: answered without the driver (every pointer and stream check asks, and
    the driver's answer took two to four calls: current context, or push / device / pop)."""
    from cuda.bindings import driver

    if device_info().device_count == 1:
        return device_ordinal()
    if int(ctx) == int(check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")):
        return device_ordinal()
    check(driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        return int(check(driver.cuCtxGetDevice(), "cuCtxGetDevice"))
    finally:
        check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _check_pointer_device(ptr: int, what: str) -> None:
    """A foreign (__cuda_array_interface__) pointer must be memory of qgemm's device: a kernel
    given another GPU's memory would fault (a sticky error that ends the CUDA context) or read it
    over the interconnect, and one given an address CUDA does not know would fault. Managed
    memory may live anywhere. Skipped without a GPU (nothing can launch then)."""
    if not gpu_available() or ptr in _checked_pointers:
        return
    from cuda.bindings import driver

    ensure_current()
    with relaxed_capture():  # queries, not stream work: fine inside a caller's graph capture
        ordinal = _pointer_device(ptr)
    if ordinal is None:
        raise ValueError(f"the data pointer {ptr:#x} of a {what} is not memory that CUDA knows; expected device "
                         f"memory of CUDA device {device_ordinal()}")
    if ordinal != device_ordinal():
        with relaxed_capture():
            err, managed = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr)
        if int(err) != 0 or not int(managed):
            raise ValueError(_other_device_message(what, ordinal))
    # With one GPU a passed address is remembered (a serving loop passes the same tensors every
    # step; the queries were ~6 us per operand of an eager call): memory CUDA knows on the only
    # GPU stays that GPU's. What the memo gives up is the refusal of an address freed since it
    # passed, which the check catches only while nothing is mapped there again: qgemm's own
    # frees empty the memo (_release), so a DeviceArray freed under a non-owning wrapper is still
    # refused; a foreign allocator's cuMemFree under such a wrapper is not seen. With several
    # GPUs a freed range may come back as another device's memory, so every call asks.
    if device_info().device_count == 1:
        if len(_checked_pointers) >= 4096:
            _checked_pointers.clear()
        _checked_pointers.add(ptr)


_checked_pointers: set = set()  # device addresses _check_pointer_device passed (one-GPU processes)


_NO_CAI = object()  # no __cuda_array_interface__ (None is a value one may hold, and is refused)


def _typestr(dtype: np.dtype) -> str:
    return dtype.str if dtype.fields is None else f"|V{dtype.itemsize}"


class DeviceArray:
    """A C-contiguous array in device memory. Owns its allocation unless it wraps a foreign one.

    Exposes __cuda_array_interface__ (v3), so torch.as_tensor / cupy.asarray wrap it without a
    copy. Structured block dtypes are described with `descr`; libraries that do not understand
    them can view the bytes through `.bytes_view()` (uint8). `.shape` and `.dtype` are numpy's.
    """

    readonly = False  # a wrapped producer's read-only flag (CUDA array interface data[1], DLPack): never an out=

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype, owner=None, owns: bool = False):
        self._ptr = int(ptr)
        self._freed = False
        self.shape = tuple(map(int, shape))
        self.dtype = np.dtype(dtype)
        self._owner = owner  # keeps a foreign array alive while we point into it
        self._owned = [self._ptr] if owns and self._ptr else []  # claimed by one list.pop(): see free()

    @property
    def freed(self) -> bool:
        """True once free() ran on this array or on the array it is a view of."""
        return self._freed or (isinstance(self._owner, DeviceArray) and self._owner.freed)

    @property
    def ptr(self) -> int:
        """The device address. A freed array (or a view of one) raises instead of handing out a
        dangling or null address: a kernel given one would fault and poison the CUDA context."""
        if self.freed:
            raise ValueError(f"DeviceArray(shape={self.shape}, dtype={self.dtype}) was freed (free() ran on it or on the "
                             "array it views); allocate a new one")
        return self._ptr

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def empty(cls, shape, dtype) -> "DeviceArray":
        """Uninitialized device memory. Allowed while a stream is being captured into a CUDA graph
        (torch.cuda.graph or qgemm's own): the allocation happens now, outside the graph, which
        then uses the memory on every replay -- keep the array alive as long as the graph."""
        from cuda.bindings import driver

        ensure_current()
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        with relaxed_capture():
            res = driver.cuMemAlloc(max(nbytes, 1))
        if int(res[0]) == int(driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY):
            raise CudaError(f"cuMemAlloc({nbytes} bytes)", _out_of_memory_note(nbytes), res[0].name)
        ptr = int(check(res, f"cuMemAlloc({nbytes} bytes)"))
        _live_allocations[ptr] = max(nbytes, 1)
        return cls(ptr, shape, dtype, owns=True)

    @classmethod
    def from_host(cls, a: np.ndarray) -> "DeviceArray":
        """A new device array holding a copy of the host array (made C-contiguous); the upload
        has finished when this returns."""
        a = np.ascontiguousarray(a)
        out = cls.empty(a.shape, a.dtype)
        out.copy_from_host(a)
        return out

    @classmethod
    def from_cai(cls, obj) -> "DeviceArray":
        """Wrap (without copying) an object exposing __cuda_array_interface__."""
        return cls._from_cai(obj, obj.__cuda_array_interface__)

    @classmethod
    def _from_cai(cls, obj, cai) -> "DeviceArray":
        """from_cai with the interface's value already read (torch builds it anew on every access)."""
        what = f"{type(obj).__name__}.__cuda_array_interface__"
        if not isinstance(cai, dict):
            raise ValueError(f"{what} must be a dict (the CUDA array interface), got {type(cai).__name__}")
        missing = [key for key in ("shape", "typestr", "data") if key not in cai]
        if missing:
            raise ValueError(f"{what} lacks {', '.join(repr(m) for m in missing)} (the CUDA array interface needs "
                             "shape, typestr and data)")
        if cai.get("mask") is not None:  # the interface asks a consumer that cannot honour a mask to refuse it
            raise ValueError(f"{what} has a mask; masked device arrays are not supported")
        try:
            shape = tuple(int(v) for v in cai["shape"])
            ptr = int(cai["data"][0])
            readonly = bool(cai["data"][1]) if len(cai["data"]) > 1 else False
            typestr = cai["typestr"]
            if typestr.startswith("|V") and "descr" in cai and len(cai["descr"]) > 1:
                dtype = np.dtype([tuple(f) for f in cai["descr"]])
                if dtype.itemsize != np.dtype(typestr).itemsize:
                    raise ValueError(f"its descr describes {dtype.itemsize} bytes, its typestr {typestr} "
                                     f"{np.dtype(typestr).itemsize}")
            else:
                dtype = np.dtype(typestr)
            dtype = _ingested_dtype(obj, dtype)
            if any(v < 0 for v in shape):
                raise ValueError("negative dimension")
            if dtype.hasobject:
                raise ValueError("Python objects have no device representation")
        except (TypeError, ValueError, IndexError, AttributeError) as e:
            raise ValueError(f"{what} is malformed (shape {cai.get('shape')!r}, typestr {cai.get('typestr')!r}, "
                             f"data {cai.get('data')!r}): {e}") from None
        size = math.prod(shape)
        strides = cai.get("strides")
        if strides is not None:
            expected = []
            acc = dtype.itemsize
            for s in reversed(shape):
                expected.append(acc)
                acc *= s
            if tuple(strides) != tuple(reversed(expected)) and size > 1:
                raise ValueError(
                    f"device array must be C-contiguous: shape {shape}, strides {tuple(strides)} "
                    f"(expected {tuple(reversed(expected))}); call .contiguous() / cupy.ascontiguousarray first"
                )
        if ptr == 0 and size > 0:
            raise ValueError("device array has a null data pointer")
        if size > 0:
            _check_pointer_device(ptr, type(obj).__name__)
        arr = cls(ptr, shape, dtype, owner=obj)
        arr.readonly = readonly
        return arr

    @classmethod
    def from_dlpack(cls, obj, stream=None) -> "DeviceArray":
        """Wrap (without copying) an object exposing __dlpack__ (torch, CuPy, JAX...), through
        cuda.core's StridedMemoryView; the producer's pending work is ordered before `stream`."""
        from cuda.core.utils import StridedMemoryView

        dev_type, dev_id = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (None, None)
        if dev_type == _DL_CPU:
            raise ValueError(f"expected a device (CUDA) array, got a host array ({type(obj).__name__} on the CPU); "
                             "pass a numpy array for host data, or move it to the GPU first")
        if dev_type is not None and dev_type not in _DL_CUDA_TYPES:
            raise ValueError(f"expected a CUDA device array, got a DLPack tensor on device type {dev_type}")
        if dev_id is not None and dev_type == _DL_CUDA and dev_id != device_ordinal():
            raise ValueError(_other_device_message(type(obj).__name__, dev_id))
        # The consumer stream the producer orders its pending work before: the caller's, or (no
        # stream: the kernels go on the legacy default stream, handle 0) DLPack's 1, the legacy
        # default stream -- a producer on a non-blocking stream is not ordered before it otherwise.
        handle = int(as_stream(stream).handle) if stream is not None else 0
        make = getattr(StridedMemoryView, "from_dlpack", None) or StridedMemoryView  # older cuda.core: the constructor
        view = _wrap("StridedMemoryView.from_dlpack", make, obj, handle if handle else 1)
        if not view.is_device_accessible:
            raise ValueError(f"expected a device array, got host memory from {type(obj).__name__}")
        shape = tuple(view.shape)
        strides = view.strides
        if strides is not None:
            expected, acc = [], 1
            for d in reversed(shape):
                expected.append(acc)
                acc *= d
            if tuple(strides) != tuple(reversed(expected)) and int(np.prod(shape)) > 1:
                raise ValueError(f"device array must be C-contiguous: shape {shape}, strides {tuple(strides)} (elements)")
        try:
            dtype = np.dtype(view.dtype)
        except NotImplementedError as e:  # cuda.core names bfloat16 only through ml_dtypes, when installed
            if not _owner_says_bf16(obj):
                raise ValueError(f"{type(obj).__name__}: a DLPack dtype numpy cannot hold ({e})") from None
            dtype = BF16_DTYPE
        arr = cls(int(view.ptr), shape, _ingested_dtype(obj, dtype), owner=(view, obj))
        arr.readonly = bool(getattr(view, "readonly", False))
        return arr

    # -- DLPack export -------------------------------------------------------------------------
    def __dlpack_device__(self):
        """(kDLCUDA, qgemm's device ordinal), for the DLPack protocol."""
        return (_DL_CUDA, device_ordinal())

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export through cuda.core's StridedMemoryView, so torch.from_dlpack / cupy.from_dlpack
        take qgemm's results without a copy. Block dtypes have no DLPack type: export
        `.bytes_view()` instead."""
        if self.dtype.fields is not None:
            raise BufferError(f"{self.dtype} blocks have no DLPack dtype; export arr.bytes_view() (uint8) instead")
        from cuda.core.utils import StridedMemoryView

        if dl_device is not None:  # the protocol: the producer's own device is always acceptable
            if tuple(int(v) for v in dl_device) != self.__dlpack_device__():
                raise BufferError(f"a qgemm DeviceArray lives on {self.__dlpack_device__()}; cannot export it to "
                                  f"dl_device={tuple(dl_device)} without a copy")
            dl_device = None
        view = StridedMemoryView.from_cuda_array_interface(self, stream_ptr=-1)
        kw = {k: v for k, v in (("stream", stream), ("max_version", max_version), ("dl_device", dl_device), ("copy", copy)) if v is not None}
        return view.__dlpack__(**kw)

    # -- properties ----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of elements (blocks, for a block dtype)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the data."""
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def __cuda_array_interface__(self) -> dict:
        """The CUDA array interface (version 3), block dtypes with their `descr`. ValueError once
        the array is freed."""
        d = {"shape": self.shape, "typestr": _typestr(self.dtype), "data": (self.ptr, False), "strides": None, "version": 3}
        if self.dtype.fields is not None:
            d["descr"] = self.dtype.descr
        return d

    def __repr__(self) -> str:
        where = "freed" if self.freed else f"ptr=0x{self._ptr:x}"
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, {where})"

    def reshape(self, *shape) -> "DeviceArray":
        """A view of the same memory in another shape (a tuple or separate ints) of as many
        elements; ValueError otherwise."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if not all(isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)) and n >= -1 for n in shape) \
                or list(shape).count(-1) > 1:
            raise ValueError(f"reshape: a shape of non-negative ints (one of them may be -1, inferred), got {tuple(shape)!r}")
        shape = tuple(int(n) for n in shape)
        if -1 in shape:  # as numpy: the one size that makes the element count match
            known = int(np.prod([n for n in shape if n != -1], dtype=np.int64))
            if known == 0 or self.size % known:
                raise ValueError(f"cannot reshape {self.shape} into {shape}")
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {shape}")
        return self._derived(tuple(shape), self.dtype)

    def _derived(self, shape, dtype) -> "DeviceArray":
        """A view of this array's memory (not owning it, read-only if this is)."""
        out = DeviceArray(self.ptr, shape, dtype, owner=self)
        out.readonly = self.readonly
        return out

    def view(self, dtype) -> "DeviceArray":
        """Reinterpret the last dimension's bytes as `dtype` (as numpy's view)."""
        dtype = np.dtype(dtype)
        if not self.shape:
            raise ValueError(f"view: a 0-d {self.dtype} array has no last dimension to reinterpret as {dtype}")
        last = self.shape[-1] * self.dtype.itemsize
        if last % dtype.itemsize:
            raise ValueError(f"cannot view {self.dtype} [..., {self.shape[-1]}] as {dtype}")
        return self._derived(self.shape[:-1] + (last // dtype.itemsize,), dtype)

    def bytes_view(self) -> "DeviceArray":
        """The same memory as uint8, the last dimension in bytes: what libraries without the block
        dtypes take (torch, DLPack)."""
        return self.view(np.uint8)

    # -- copies --------------------------------------------------------------------------------
    def copy_from_host(self, a: np.ndarray) -> None:
        """Overwrite the array with a host array of the same byte size (ValueError otherwise); the
        upload has finished when this returns."""
        from cuda.bindings import driver

        a = np.ascontiguousarray(a)
        if a.nbytes != self.nbytes:
            raise ValueError(f"copy_from_host: {a.nbytes} bytes into a {self.nbytes}-byte device array")
        if a.nbytes:
            ensure_current()
            check(driver.cuMemcpyHtoD(self.ptr, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
            # From pageable memory the copy returns once the data is staged; its DMA runs on the
            # legacy stream, which a kernel on a non-blocking stream (a torch side stream, a
            # cuda.core stream) is not ordered after: wait for it here, or that kernel could read
            # the allocation before the upload lands.
            check(driver.cuStreamSynchronize(driver.CUstream(0)), "cuStreamSynchronize (the upload)")

    def to_host(self) -> np.ndarray:
        """Synchronous copy back (waits for all work in qgemm's context first: cuCtxSynchronize)."""
        from cuda.bindings import driver

        out = np.empty(self.shape, dtype=self.dtype)
        if out.nbytes:
            ensure_current()
            check(driver.cuCtxSynchronize(), "cuCtxSynchronize")
            check(driver.cuMemcpyDtoH(out.ctypes.data, self.ptr, out.nbytes), "cuMemcpyDtoH")
        return out

    get = to_host

    def fill_bytes(self, value: int, stream=None) -> None:
        """memset every byte to `value` (0xFF poisons float32 with NaN)."""
        from cuda.bindings import driver

        if self.nbytes:
            ensure_current()
            s = as_stream(stream)
            check(driver.cuMemsetD8Async(self.ptr, int(value) & 0xFF, self.nbytes, s.handle), "cuMemsetD8Async")

    def copy_to(self, other: "DeviceArray", stream=None) -> None:
        """Queue a copy of the whole array into `other`, a device array of the same byte size
        (ValueError otherwise), on `stream`."""
        from cuda.bindings import driver

        if not isinstance(other, DeviceArray):
            raise ValueError(f"copy_to: expected a qgemm.DeviceArray, got {type(other).__name__}")
        if other.nbytes != self.nbytes:
            raise ValueError(f"copy_to: size mismatch: this array has {self.nbytes} bytes ({self.dtype} {self.shape}), "
                             f"the destination {other.nbytes} ({other.dtype} {other.shape})")
        if self.nbytes:
            ensure_current()
            s = as_stream(stream)
            check(driver.cuMemcpyDtoDAsync(other.ptr, self.ptr, self.nbytes, s.handle), "cuMemcpyDtoDAsync")

    @property
    def _owns(self) -> bool:
        return bool(self._owned)

    @_owns.setter
    def _owns(self, value: bool) -> None:
        self._owned = [self._ptr] if value and self._ptr else []

    # -- copies of the Python object ------------------------------------------------------------
    def __copy__(self) -> "DeviceArray":
        """A view (the same memory, not owning it): two owners of one allocation would free it twice."""
        return self._derived(self.shape, self.dtype)

    def __deepcopy__(self, memo) -> "DeviceArray":
        """A new allocation holding a copy of the data (queued on the legacy default stream)."""
        out = DeviceArray.empty(self.shape, self.dtype)
        self.copy_to(out)
        return out

    def __reduce_ex__(self, protocol):
        raise TypeError("a DeviceArray is GPU memory and cannot be pickled; pickle its .to_host() instead")

    # -- lifetime ------------------------------------------------------------------------------
    def free(self) -> None:
        """Release the allocation now (an owned array; on a view or a wrapped foreign array it only
        marks this object unusable). Afterwards .ptr raises, and so does every launch given it."""
        self._freed = True
        try:  # one pop hands the allocation to exactly one caller: two threads freeing at once
            ptr = self._owned.pop()  # (or __del__ beside free()) would otherwise both cuMemFree it
        except IndexError:
            return
        _release(ptr)

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass


_deferred_frees: list[int] = []
# qgemm's own allocations not yet freed, address -> bytes (allocated_bytes). A dict's single
# setitem / pop needs no lock; an address waiting in _deferred_frees is still held, so still counted.
_live_allocations: dict[int, int] = {}


def _out_of_memory_note(nbytes: int) -> str:
    """What an out-of-memory allocation tells the user: the ask, what the device has free, and how
    much of the rest qgemm's own arrays hold (the rest is this process's other allocations --
    torch's caching allocator among them -- or other processes')."""
    from cuda.bindings import driver

    gib = 2.0**30
    note, in_use = f"out of memory: asked for {nbytes / gib:.3f} GiB", "of the memory in use"
    try:
        free, total = (int(v) for v in check(driver.cuMemGetInfo(), "cuMemGetInfo"))
        note += f" with {free / gib:.3f} GiB of the device's {total / gib:.1f} GiB free"
        in_use = f"of the {(total - free) / gib:.2f} GiB in use"
    except Exception:
        pass
    return (note + f"; {in_use}, qgemm's own device arrays hold {allocated_bytes() / gib:.2f} GiB "
            "(qgemm.runtime.allocated_bytes()) and the rest is this process's other allocations "
            "(torch's caching allocator keeps freed blocks: torch.cuda.empty_cache()) or other processes'")


def allocated_bytes() -> int:
    """Device memory qgemm itself holds now, in bytes: every `DeviceArray` it allocated (yours,
    results, and its own reusable scratch: staged activations, repacked weights, per-capture
    buffers) not yet freed -- as `torch.cuda.memory_allocated` for torch. Arrays qgemm only wraps
    (torch, CuPy) are not counted. Level across repeated calls of the same shapes: a call's
    temporaries are freed or reused (tests/test_gpu_steady.py)."""
    return sum(_live_allocations.copy().values())  # (a copy: other threads may allocate or free meanwhile)


def _release(ptr: int) -> None:
    """cuMemFree in qgemm's context (a thread that drops an array may have none current), in
    relaxed capture mode: an array dropped while a CUDA graph is being captured (torch's global
    mode refuses a plain cuMemFree then, and invalidates the capture). An address the driver still
    refuses for the capture waits and is freed by a later release. No lock: this runs from
    __del__, which the garbage collector may call inside any code, this function included; the
    list's single pop / append calls hand each waiting address to exactly one release."""
    from cuda.bindings import driver

    _checked_pointers.clear()  # an address checked before may be freed now (_check_pointer_device)
    todo = []
    while True:
        try:
            todo.append(_deferred_frees.pop())
        except IndexError:
            break
    todo = todo[::-1] + [ptr]  # the waiting ones first, oldest first
    try:
        # the thread's current context, put back afterwards: the garbage collector may free in a
        # thread that never called qgemm, or inside another library's context push / pop
        saved = driver.cuCtxGetCurrent()[1]
        ensure_current()
    except Exception:  # no usable GPU now (interpreter shutdown): kept for a later release, not dropped
        _deferred_frees.extend(todo)
        return
    try:
        with relaxed_capture():
            for p in todo:
                try:
                    res = driver.cuMemFree(p)
                except Exception:
                    continue
                err = res[0] if isinstance(res, tuple) else res
                if getattr(err, "name", "").startswith("CUDA_ERROR_STREAM_CAPTURE"):
                    _deferred_frees.append(p)
                elif int(err) == 0:
                    _live_allocations.pop(p, None)
    finally:
        try:
            driver.cuCtxSetCurrent(saved)
        except Exception:
            pass


def element_alignment(dtype) -> int:
    """The byte boundary a kernel needs an array of `dtype` on: the largest power of two dividing
    its itemsize, at most 16 -- 4 for float32, 2 for the 16-bit types and ggml's 18- and 34-byte
    Q4_0 / Q8_0 blocks (read as 16-bit words), 4 for the 36-byte Q8_1 blocks (their qs read as
    ints). A misaligned load faults, and the fault ends the CUDA context."""
    size = np.dtype(dtype).itemsize
    return min(size & -size, 16) if size else 1


def check_alignment(arr: "DeviceArray", who: str, role: str) -> None:
    """ValueError, before any launch, for a device array not on element_alignment(its dtype)
    (only a hand-made DeviceArray or a raw pointer can be: torch and CuPy views keep it)."""
    align = element_alignment(arr.dtype)
    if arr.ptr % align:
        raise ValueError(f"{who}: {role} must start on a {align}-byte boundary ({dtype_name(arr.dtype)} elements), "
                         f"got address {arr.ptr:#x}")


def host_array(obj, who: str, what: str) -> np.ndarray:
    """A host operand as numpy (no copy where numpy allows): a CPU torch tensor detached (one that
    requires grad cannot be read by .numpy()), its bfloat16 as the bare 2-byte type qgemm holds
    bfloat16 in (numpy has none: torch refuses .numpy() of it); a meta tensor, which has no data,
    refused; anything else as np.asarray takes it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            raise ValueError(f"{who}: {what} is a meta tensor, which holds no values (meta tensors are for tracing: "
                             "torch.compile reaches qgemm through qgemm.torch_ops)")
        t = obj.detach()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(np.dtype("V2"))
        return t.numpy()
    return np.asarray(obj)


def is_device_array(obj) -> bool:
    """True for qgemm/torch/CuPy device arrays (CUDA Array Interface, or DLPack on a CUDA device);
    numpy arrays and CPU tensors are host arrays."""
    if isinstance(obj, DeviceArray) or hasattr(obj, "__cuda_array_interface__"):
        return True
    return _dlpack_on_device(obj)


def _dlpack_on_device(obj) -> bool:
    if isinstance(obj, np.ndarray) or not hasattr(obj, "__dlpack_device__"):
        return False
    try:
        return obj.__dlpack_device__()[0] != _DL_CPU
    except Exception:
        return False


def _owner_says_bf16(obj) -> bool:
    """The object's own dtype (torch.bfloat16, JAX / ml_dtypes' bfloat16) is bfloat16."""
    return str(getattr(obj, "dtype", "")).rsplit(".", 1)[-1] == "bfloat16"


def _ingested_dtype(obj, dtype: np.dtype) -> np.dtype:
    """A foreign array's dtype as qgemm holds it: bfloat16 in any of its spellings -- ml_dtypes'
    type, the bare '<V2' torch's __cuda_array_interface__ reports, and the '<f2' it reported in
    torch 2.5 (the same typestr as float16: only the tensor's dtype tells them apart) -- becomes
    formats.BF16_DTYPE; anything else is kept."""
    if dtype.itemsize == 2 and (is_bf16(dtype) or _owner_says_bf16(obj)):
        return BF16_DTYPE
    return dtype


# torch dtypes the fast path reads, as numpy holds them (what their __cuda_array_interface__
# typestr becomes in _from_cai); filled at the first torch tensor, torch being optional
_TORCH_DTYPES: dict = {}


def _torch_array(obj) -> DeviceArray | None:
    """A plain CUDA torch.Tensor as a DeviceArray read from the tensor's own accessors; None for
    anything else, which takes the general path. Why: torch builds `__cuda_array_interface__` in
    Python on every access (a dict, its typestr, a contiguity test), and with `_from_cai`'s
    parsing that was 5-10 us per operand of an eager call on H100 hosts, two or three operands
    per call (docs/pytorch.md, "Host time per call"). Only what the interface would have said
    the same way is taken here: a `torch.Tensor` itself (a subclass may export something else),
    strided, C-contiguous, not requiring grad (torch's interface refuses that one: the general
    path raises torch's own error), of a dtype in _TORCH_DTYPES. The device check is the general
    path's (`_check_pointer_device`), so another GPU's tensor is refused alike. A tensor (or
    subclass) with torch's lazy negation or conjugation bit set is refused: its memory holds the
    values before that operation (`z.conj().imag` is -Im z, read from Im z's memory). Most such
    views are strided, and the general path refuses them as non-contiguous, but the interface
    exports a contiguous one (`torch._neg_view(x)`, a one-element `.imag`) as its memory is: a
    silently wrong operand."""
    torch = _mods.get("torch")
    if torch is None:
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "Tensor"):
            return None
        for name, np_dtype in (("float32", "<f4"), ("float16", "<f2"), ("bfloat16", BF16_DTYPE),
                               ("float64", "<f8"), ("uint8", "|u1"), ("int8", "|i1"), ("int16", "<i2"),
                               ("int32", "<i4"), ("int64", "<i8")):
            if hasattr(torch, name):
                _TORCH_DTYPES[getattr(torch, name)] = np.dtype(np_dtype)
        _mods["torch"] = torch  # (after the table: a thread seeing it sees the table filled)
    if not isinstance(obj, torch.Tensor):
        return None
    if _lazy_bit(obj, "is_neg") or _lazy_bit(obj, "is_conj"):
        raise ValueError(f"a torch tensor with its lazy {'negation' if _lazy_bit(obj, 'is_neg') else 'conjugation'} "
                         "bit set holds the values before that operation in memory; call .resolve_neg() / "
                         ".resolve_conj() first")
    if type(obj) is not torch.Tensor:
        return None
    dtype = _TORCH_DTYPES.get(obj.dtype)
    if (dtype is None or not obj.is_cuda or obj.requires_grad or obj.layout is not torch.strided
            or not obj.is_contiguous()):
        return None
    shape = tuple(obj.shape)
    if math.prod(shape) == 0:  # the interface's data pointer of an empty tensor is 0 (an empty view's
        return DeviceArray(0, shape, dtype, owner=obj)  # data_ptr() may point into its storage)
    ptr = obj.data_ptr()
    if ptr == 0:
        raise ValueError("device array has a null data pointer")
    _check_pointer_device(ptr, "Tensor")
    return DeviceArray(ptr, shape, dtype, owner=obj)


def _lazy_bit(t, name: str) -> bool:
    """torch's is_neg() / is_conj() (absent in old releases: False)."""
    fn = getattr(t, name, None)
    return bool(fn()) if fn is not None else False


def device_array_or_none(obj, stream=None) -> DeviceArray | None:
    """as_device_array(obj) for a device array (is_device_array), None for anything else (numpy,
    CPU tensors, lists): the two calls in one, reading the array interface once. (torch builds
    `__cuda_array_interface__` anew on every access, a few microseconds each: an eager decode
    call is host-bound, so it asks once -- and a plain CUDA tensor is read without it,
    `_torch_array`.)"""
    if isinstance(obj, DeviceArray):
        obj.ptr  # a freed array raises here, before any launch
        return obj
    if isinstance(obj, np.ndarray):
        return None
    arr = _torch_array(obj)
    if arr is not None:
        return arr
    cai = getattr(obj, "__cuda_array_interface__", _NO_CAI)  # a CPU tensor's property raises AttributeError
    if cai is not _NO_CAI:
        return DeviceArray._from_cai(obj, cai)
    if _dlpack_on_device(obj):
        return as_device_array(obj, stream)
    return None


def as_output_array(obj, who: str, stream=None) -> DeviceArray:
    """as_device_array for an out= operand: a producer's read-only array is refused."""
    arr = as_device_array(obj, stream)
    if arr.readonly:
        raise ValueError(f"{who}: out= is read-only ({type(obj).__name__} exports it so); pass a writable device array")
    return arr


def as_device_array(obj, stream=None) -> DeviceArray:
    if isinstance(obj, DeviceArray):
        obj.ptr  # a freed array raises here, before any launch
        return obj
    arr = _torch_array(obj)
    if arr is not None:
        return arr
    cai = getattr(obj, "__cuda_array_interface__", _NO_CAI)
    if cai is not _NO_CAI:
        return DeviceArray._from_cai(obj, cai)
    if hasattr(obj, "__dlpack__"):
        return DeviceArray.from_dlpack(obj, stream)
    raise ValueError(f"expected a device array (__cuda_array_interface__ or __dlpack__), got {type(obj).__name__}")


# ---------------------------------------------------------------------------------------------
# modules and launches


class LoadedKernel:
    """A cubin loaded into the current context; `launch` runs one of its entries."""

    def __init__(self, cubin: bytes, entries: list[str], label: str):
        from cuda.core import ObjectCode

        ensure_current()
        self.label = label
        self.object_code = _wrap(f"ObjectCode.from_cubin({label})", ObjectCode.from_cubin, cubin, name=label)
        self.kernels = {e: _wrap(f"get_kernel({e})", self.object_code.get_kernel, e) for e in entries}
        self._smem_ok: dict[str, int] = {}
        self._smem_lock = threading.Lock()
        self._configs = threading.local()  # .d: (entry, grid, block, shmem, pdl) -> cuda.core LaunchConfig

    def _static_smem(self, entry: str) -> int:
        """The kernel's static shared memory (a property in cuda.core 1.x, a method in older releases)."""
        size = self.kernels[entry].attributes.shared_size_bytes
        return int(size() if callable(size) else size)

    def _allow_dynamic_smem(self, entry: str, shmem: int) -> None:
        """A kernel gets only 48 KB of shared memory, static and dynamic together, unless it opts
        in to more dynamic shared memory (which must then cover all of the dynamic part)."""
        from cuda.bindings import driver

        if shmem <= self._smem_ok.get(entry, 0):
            return
        with self._smem_lock:  # threads share the module: the attribute only ever grows, set once per size
            if shmem <= self._smem_ok.get(entry, 0):
                return
            if entry not in self._smem_ok:  # what fits without opting in
                self._smem_ok[entry] = max(0, 48 * 1024 - self._static_smem(entry))
                if shmem <= self._smem_ok[entry]:
                    return
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            handle = self.kernels[entry].handle
            if isinstance(handle, driver.CUkernel):
                dev = check(driver.cuDeviceGet(device_ordinal()), "cuDeviceGet")
                check(driver.cuKernelSetAttribute(attr, int(shmem), handle, dev), f"cuKernelSetAttribute({entry}, {shmem} B smem)")
            else:
                check(driver.cuFuncSetAttribute(handle, attr, int(shmem)), f"cuFuncSetAttribute({entry}, {shmem} B smem)")
            self._smem_ok[entry] = int(shmem)

    def launch(self, entry: str, grid, block, shmem: int, args, stream=None, pdl: bool = False) -> None:
        """pdl: programmatic dependent launch -- the kernel may start while the previous kernel
        in the stream finishes; it must itself wait (griddepcontrol.wait) before reading that
        kernel's output. Ignored (a plain launch) where cuda.core or the GPU lack it."""
        core = _cuda_core()
        s = as_stream(stream)
        pdl = bool(pdl) and pdl_enabled()  # read at every launch (QGEMM_PDL), once: the memo is keyed on it
        key = (entry, tuple(grid), tuple(block), shmem, pdl)
        # A LaunchConfig per geometry, made once (an eager decode call is host-bound), and per
        # thread: cuda.core's launch() rewrites the config's native attribute list on each call,
        # and releases the GIL while the driver reads it.
        configs = getattr(self._configs, "d", None)
        if configs is None:
            configs = self._configs.d = {}
        cfg = configs.get(key)
        if cfg is None:
            if shmem > 0:
                self._allow_dynamic_smem(entry, shmem)
            geo = dict(grid=tuple(int(g) for g in grid), block=tuple(int(b) for b in block), shmem_size=int(shmem))
            cfg = _pdl_config(geo, decided=True) if pdl else None
            cfg = remember(configs, key, core.LaunchConfig(**geo) if cfg is None else cfg, 256)
        try:
            core.launch(s, cfg, self.kernels[entry], *args)
        except (NoGPUError, CudaError, ValueError):
            raise
        except Exception as e:  # _wrap's rule, with the label made only when it is needed
            raise CudaError(f"launch({entry}, grid={tuple(grid)}, block={tuple(block)})", str(e)) from e


_PDL = {"supported": None}


def pdl_enabled() -> bool:
    """Programmatic dependent launch is used unless QGEMM_PDL=0 (read at every launch, so a
    benchmark can time both in one process; and the first thing to turn off when debugging a
    race between consecutive kernels)."""
    return os.environ.get("QGEMM_PDL", "1").strip() != "0"


@contextlib.contextmanager
def pdl_setting(value):
    """QGEMM_PDL=value (0: plain launches) inside the block, restored after; None leaves it as
    it is. Launches read it as they are made, CUDA graph captures included, so a benchmark can
    time both in one process."""
    old = os.environ.get("QGEMM_PDL")
    if value is not None:
        os.environ["QGEMM_PDL"] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("QGEMM_PDL", None)
        else:
            os.environ["QGEMM_PDL"] = old


def _pdl_config(geo: dict, decided: bool = False):
    """A LaunchConfig with programmatic stream serialization (sm_90+, cuda.core >= 0.4), or None
    (also when QGEMM_PDL=0; decided: the caller has read QGEMM_PDL already -- not read twice, so
    a switch between the two reads cannot file a plain config under a PDL launch's key)."""
    from cuda.core import LaunchConfig

    if not decided and not pdl_enabled():
        return None
    if _PDL["supported"] is None:
        _PDL["supported"] = gpu_available() and device_info().cc >= 90
    if not _PDL["supported"]:
        return None
    try:
        return LaunchConfig(**geo, programmatic_stream_serialization=True)
    except TypeError:  # an older cuda.core without the option: plain launches from now on
        _PDL["supported"] = False
        return None


def check_last_error(what: str) -> None:
    """Surface an asynchronous launch failure now (synchronizes the context)."""
    from cuda.bindings import driver

    check(driver.cuCtxSynchronize(), f"cuCtxSynchronize after {what}")
