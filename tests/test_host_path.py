"""The eager call's host path: what qgemm.matmul memoizes so that a decode step outside a CUDA
graph is not bound by Python (tools/host_overhead.py measures it on a GPU), and that each memo
answers what the uncached code would, and forgets when it must. CPU only: the driver and the
device are stood in for."""

import contextlib
import types

import numpy as np
import pytest

import qgemm
from qgemm import dispatch, runtime, tuning

ONE_GPU = runtime.DeviceInfo("Stand-in GPU", 90, 132, 1980000, 2619000, 5120, 50 << 20, 232448, 80 << 30,
                             (13, 0), "580.00", device_count=1)


@pytest.fixture
def clean_memos(monkeypatch):
    monkeypatch.setattr(runtime, "_checked_pointers", set())
    monkeypatch.setattr(runtime, "_foreign_streams", {})
    monkeypatch.setattr(dispatch, "_matmul_plans", {})
    monkeypatch.setattr(tuning, "_paths", {})
    yield
    tuning.forget_cache()


def test_tuning_path_follows_the_cache_directory(monkeypatch, tmp_path, clean_memos):
    monkeypatch.setattr(runtime, "device_info", lambda: ONE_GPU)
    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setenv("QGEMM_CACHE_DIR", str(tmp_path / "a"))
    pa = tuning.path()
    assert pa == tmp_path / "a" / "tuning" / "stand-in-gpu-sm_90.json" and tuning.path() is pa  # memoized
    monkeypatch.setenv("QGEMM_CACHE_DIR", str(tmp_path / "b"))
    assert tuning.path() == tmp_path / "b" / "tuning" / "stand-in-gpu-sm_90.json"
    s1 = tuning.state()
    assert s1 == (str(tuning.path()), s1[1]) and tuning.state() == s1
    tuning.forget_cache()
    assert tuning.state() != s1  # a forgotten (or stored) tuning changes the token


def test_matmul_plan_memo(monkeypatch, tmp_path, clean_memos):
    """Same arguments -> the same Plan (no re-planning per call); a stored tuning entry, another
    cache directory or forget_cache -> planned again; a bad argument raises every time."""
    monkeypatch.setattr(runtime, "gpu_available", lambda: False)  # sm_80's plans, no tuning file
    calls = []
    real = dispatch._plan
    monkeypatch.setattr(dispatch, "_plan", lambda *a: calls.append(a) or real(*a))
    p1 = dispatch._matmul_plan(8, 4096, 4096, "q4_0", "f32", None, True)
    p2 = dispatch._matmul_plan(8, 4096, 4096, "q4_0", "f32", None, True)
    assert p1 is p2 and len(calls) == 1
    assert dispatch._matmul_plan(9, 4096, 4096, "q4_0", "f32", None, True).m == 9 and len(calls) == 2
    tuning.forget_cache()
    assert dispatch._matmul_plan(8, 4096, 4096, "q4_0", "f32", None, True) is not p1 and len(calls) == 3
    for _ in range(2):
        with pytest.raises(ValueError, match="K must be a multiple of 32"):
            dispatch._matmul_plan(8, 4096, 4100, "q4_0", "f32", None, True)
        with pytest.raises(ValueError, match="a kernel name is a string"):
            dispatch._matmul_plan(8, 4096, 4096, "q4_0", "f32", ["w4a8.mma"], False)  # unhashable: not memoized
    assert len(calls) == 7
    assert str(p1) == str(qgemm.plan(8, 4096, 4096, "q4_0", packed=True))  # what plan() says


def test_matmul_plan_memo_sees_stored_tuning(monkeypatch, tmp_path, clean_memos):
    monkeypatch.setattr(runtime, "device_info", lambda: ONE_GPU)
    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setenv("QGEMM_CACHE_DIR", str(tmp_path))
    tuning.forget_cache()
    before = dispatch._matmul_plan(3, 1024, 1024, "q4_0", "f32", None, False)
    assert before.kernel == "w4a8.gemv" and before.source == "default"
    cand = qgemm.spec("w4a8.gemv").candidates(3, 1024, 1024)
    pick = next(c for c in cand if c != before.defines)
    tuning.store("w4a8.gemv", 3, 1024, 1024, pick, 1.0)
    after = dispatch._matmul_plan(3, 1024, 1024, "q4_0", "f32", None, False)
    assert after.source == "tuned" and after.defines == tuning.fit("w4a8.gemv", 3, 1024, 1024, pick)


class _CAI:
    """A device-array stand-in that counts reads of its interface (torch builds it per read)."""

    def __init__(self, cai):
        self._cai, self.reads = cai, 0

    @property
    def __cuda_array_interface__(self):
        self.reads += 1
        if self._cai is AttributeError:
            raise AttributeError("not on the GPU")  # a CPU tensor's property
        return self._cai


def test_device_array_or_none_reads_the_interface_once(monkeypatch):
    monkeypatch.setattr(runtime, "gpu_available", lambda: False)  # no pointer check without a GPU
    a = _CAI({"shape": (2, 32), "typestr": "<f4", "data": (0x7000, False), "version": 3})
    d = runtime.device_array_or_none(a)
    assert a.reads == 1 and d.shape == (2, 32) and d.dtype == np.float32 and d.ptr == 0x7000
    assert runtime.device_array_or_none(np.zeros(3)) is None
    assert runtime.device_array_or_none([1.0, 2.0]) is None
    cpu = _CAI(AttributeError)
    assert runtime.device_array_or_none(cpu) is None and not runtime.is_device_array(cpu)
    own = runtime.DeviceArray(0x9000, (4,), np.float32)
    assert runtime.device_array_or_none(own) is own
    with pytest.raises(ValueError, match="must be a dict"):  # an interface holding None: refused, as before
        runtime.device_array_or_none(_CAI(None))
    with pytest.raises(ValueError, match="was freed"):
        freed = runtime.DeviceArray(0x9000, (4,), np.float32)
        freed._freed = True
        runtime.device_array_or_none(freed)


def _stand_in_driver(monkeypatch, count):
    """gpu_available, `count` devices, and a cuPointerGetAttribute that counts its calls."""
    from cuda.bindings import driver

    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(runtime, "device_info", lambda: types.SimpleNamespace(device_count=count))
    monkeypatch.setattr(runtime, "ensure_current", lambda: None)
    monkeypatch.setattr(runtime, "relaxed_capture", contextlib.nullcontext)
    monkeypatch.setattr(runtime, "device_ordinal", lambda: 0)
    asked = []

    def attribute(which, ptr):
        asked.append(ptr)
        if ptr == 0x4000:
            return driver.CUresult.CUDA_ERROR_INVALID_VALUE, None
        return driver.CUresult.CUDA_SUCCESS, driver.CUcontext(7)

    monkeypatch.setattr(driver, "cuPointerGetAttribute", attribute)
    monkeypatch.setattr(runtime, "_context_device", lambda ctx: 0)
    return asked


def test_pointer_check_memo_with_one_gpu(monkeypatch, clean_memos):
    asked = _stand_in_driver(monkeypatch, 1)
    for _ in range(3):
        runtime._check_pointer_device(0x1000, "Tensor")
    assert asked == [0x1000]  # asked once: with one GPU the answer cannot change
    for _ in range(2):  # a refusal is never memoized
        with pytest.raises(ValueError, match="not memory that CUDA knows"):
            runtime._check_pointer_device(0x4000, "Tensor")
    assert asked == [0x1000, 0x4000, 0x4000]


def test_pointer_check_asks_every_time_with_several_gpus(monkeypatch, clean_memos):
    asked = _stand_in_driver(monkeypatch, 2)
    for _ in range(3):
        runtime._check_pointer_device(0x1000, "Tensor")
    assert asked == [0x1000] * 3 and not runtime._checked_pointers


@pytest.mark.parametrize("count", [1, 2])
def test_foreign_stream_memo(monkeypatch, clean_memos, count):
    """A caller's stream handle is wrapped and checked once with one GPU, every time with more;
    a stream of another device is refused either way."""
    import cuda.core

    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(runtime, "device_info", lambda: types.SimpleNamespace(device_count=count))
    made = []

    class Stream:  # cuda.core's type cannot be patched; the whole name is stood in for
        @staticmethod
        def from_handle(h):
            made.append(h)
            return ("stream", h)

    monkeypatch.setattr(cuda.core, "Stream", Stream)

    def same_device(s, given):
        if s[1] == 0xBAD:
            raise ValueError("stream: expected a stream of CUDA device 0 (qgemm's device), got a int of device 1")
        return s

    monkeypatch.setattr(runtime, "_same_device", same_device)
    torch_like = types.SimpleNamespace(cuda_stream=0x5000)
    got = [runtime.as_stream(torch_like) for _ in range(3)]
    assert got == [("stream", 0x5000)] * 3 and made == [0x5000] * (1 if count == 1 else 3)
    for _ in range(2):
        with pytest.raises(ValueError, match="of device 1"):
            runtime.as_stream(0xBAD)
    assert 0xBAD not in runtime._foreign_streams


def test_launch_configs_made_once_per_geometry(monkeypatch):
    """LoadedKernel.launch builds a cuda.core LaunchConfig once per (entry, grid, block, shared
    memory, PDL); QGEMM_PDL still decides at every launch; a failed launch names the kernel."""
    import cuda.core

    made, launched = [], []

    class Config:
        def __init__(self, **kw):
            made.append(kw)
            self.kw = kw

    monkeypatch.setattr(cuda.core, "LaunchConfig", Config)
    monkeypatch.setattr(cuda.core, "launch", lambda s, cfg, kern, *args: launched.append((cfg.kw, kern, args)))
    monkeypatch.setattr(runtime, "as_stream", lambda s=None: "stream")
    monkeypatch.setitem(runtime._PDL, "supported", True)
    mod = object.__new__(runtime.LoadedKernel)
    mod.label, mod.kernels, mod._smem_ok, mod._configs = "t", {"k": "K"}, {"k": 1 << 20}, {}
    for _ in range(3):
        mod.launch("k", (4, 1, 1), (128, 1, 1), 0, (1, 2), pdl=True)
    assert len(made) == 1 and made[0]["programmatic_stream_serialization"] is True and len(launched) == 3
    monkeypatch.setenv("QGEMM_PDL", "0")
    mod.launch("k", (4, 1, 1), (128, 1, 1), 0, (1, 2), pdl=True)
    assert len(made) == 2 and "programmatic_stream_serialization" not in made[1]
    mod.launch("k", (8, 1, 1), (128, 1, 1), 0, (1, 2), pdl=True)
    assert len(made) == 3 and made[2]["grid"] == (8, 1, 1)

    def fail(*a):
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(cuda.core, "launch", fail)
    with pytest.raises(qgemm.CudaError, match=r"launch\(k, grid=\(8, 1, 1\), block=\(128, 1, 1\)\)"):
        mod.launch("k", (8, 1, 1), (128, 1, 1), 0, (1, 2))
