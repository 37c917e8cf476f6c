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
from qgemm import kvcache as kv

ONE_GPU = runtime.DeviceInfo("Stand-in GPU", 90, 132, 1980000, 2619000, 5120, 50 << 20, 232448, 80 << 30,
                             (13, 0), "580.00", device_count=1)


@pytest.fixture
def clean_memos(monkeypatch):
    monkeypatch.setattr(runtime, "_checked_streams", {})
    monkeypatch.setattr(runtime, "_checked_pointers", set())
    monkeypatch.setattr(kv, "_call_plans", {})
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


class _FakeDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):  # what runtime._owner_says_bf16 reads
        return f"torch.{self.name}"


class _FakeTorch(types.ModuleType):
    """Enough of torch for runtime._torch_array: a Tensor class whose accessors and
    __cuda_array_interface__ say the same things, as torch's do (torch/_tensor.py)."""

    def __init__(self):
        super().__init__("torch")
        self.strided, self.sparse_coo = object(), object()
        self._typestr = {}
        for name, ts in (("float32", "<f4"), ("float16", "<f2"), ("bfloat16", "<V2"), ("float64", "<f8"),
                         ("uint8", "|u1"), ("int8", "|i1"), ("int16", "<i2"), ("int32", "<i4"), ("int64", "<i8"),
                         ("bool", "|b1"), ("complex64", "<c8")):
            dt = _FakeDtype(name)
            setattr(self, name, dt)
            self._typestr[id(dt)] = ts
        torch = self

        class Tensor:
            def __init__(self, shape, dtype, ptr=0x7000, cuda=True, grad=False, layout=None, contiguous=True,
                         neg=False, conj=False):
                self.shape, self.dtype, self._ptr, self.is_cuda = tuple(shape), dtype, ptr, cuda
                self.requires_grad, self.layout, self._contiguous = grad, layout or torch.strided, contiguous
                self._neg, self._conj = neg, conj
                self.cai_reads = 0

            def is_neg(self):
                return self._neg

            def is_conj(self):
                return self._conj

            def is_contiguous(self):
                return self._contiguous

            def data_ptr(self):  # an empty view may point into its storage (torch.randn(6, 4)[6:])
                return self._ptr

            def numel(self):
                return int(np.prod(self.shape))

            @property
            def __cuda_array_interface__(self):
                self.cai_reads += 1
                if not self.is_cuda:
                    raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor")
                if self.requires_grad:
                    raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")
                ts = torch._typestr[id(self.dtype)]
                strides = None if self._contiguous else tuple(reversed([np.dtype(ts).itemsize * 3 ** i
                                                                        for i in range(len(self.shape))]))
                return {"typestr": ts, "shape": self.shape, "strides": strides,
                        "data": (self.data_ptr() if self.numel() > 0 else 0, False), "version": 2}

        self.Tensor = Tensor


def test_torch_tensors_are_read_without_their_array_interface(monkeypatch):
    """A plain CUDA torch tensor is read from its accessors (the interface is rebuilt by torch on
    each access: ~10 us per operand with its parsing); the DeviceArray is the one the interface
    gives, and everything else -- a subclass, a tensor requiring grad, non-contiguous, sparse, on
    the CPU, of a dtype outside the table -- goes the general way, with its errors."""
    torch = _FakeTorch()
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    monkeypatch.setattr(runtime, "_mods", {k: v for k, v in runtime._mods.items() if k != "torch"})
    monkeypatch.setattr(runtime, "_TORCH_DTYPES", {})
    monkeypatch.setattr(runtime, "gpu_available", lambda: False)  # no pointer check without a GPU
    for dtype, shape in ((torch.float32, (3, 64)), (torch.float16, (5,)), (torch.bfloat16, (2, 3, 32)),
                         (torch.uint8, (7, 18)), (torch.int32, (1,)), (torch.float32, (0, 64)), (torch.int8, (4, 2)),
                         (torch.int16, (6,)), (torch.int64, (2, 2)), (torch.float64, (3,))):
        t = torch.Tensor(shape, dtype)
        fast = runtime.device_array_or_none(t)
        general = runtime.DeviceArray._from_cai(t, t.__cuda_array_interface__)
        assert t.cai_reads == 1  # only the line above read it
        assert (fast._ptr, fast.shape, fast.dtype, fast.readonly) == (general._ptr, general.shape, general.dtype,
                                                                      general.readonly)
        assert fast._owner is t and runtime.as_device_array(t).shape == shape and t.cai_reads == 1
    assert runtime.device_array_or_none(torch.Tensor((2, 32), torch.bfloat16)).dtype == qgemm.formats.BF16_DTYPE

    class Sub(torch.Tensor):
        pass

    others = {"subclass": Sub((2, 32), torch.float32), "bool": torch.Tensor((4,), torch.bool),
              "complex": torch.Tensor((4,), torch.complex64), "sparse": torch.Tensor((4,), torch.float32,
                                                                                   layout=torch.sparse_coo)}
    for name, t in others.items():
        assert runtime._torch_array(t) is None, name
        runtime.device_array_or_none(t)
        assert t.cai_reads == 1, name  # the general path read the interface
    cpu = torch.Tensor((2, 32), torch.float32, cuda=False)
    assert runtime._torch_array(cpu) is None and runtime.device_array_or_none(cpu) is None
    with pytest.raises(RuntimeError, match="requires grad"):  # torch's own refusal, as before
        runtime.device_array_or_none(torch.Tensor((2, 32), torch.float32, grad=True))
    with pytest.raises(ValueError, match="C-contiguous"):
        runtime.as_device_array(torch.Tensor((2, 32), torch.float32, contiguous=False))
    # lazily negated / conjugated views hold the values before the operation: refused, subclasses too
    for t in (torch.Tensor((2, 32), torch.float32, neg=True), Sub((2, 32), torch.float32, neg=True),
              torch.Tensor((4,), torch.complex64, conj=True), torch.Tensor((2, 32), torch.float32, neg=True, cuda=False)):
        with pytest.raises(ValueError, match="lazy (negation|conjugation) bit"):
            runtime.device_array_or_none(t)
        with pytest.raises(ValueError, match="resolve_neg"):
            runtime.as_device_array(t)
    # the device check is the general path's, with the same name in its messages
    checked = []
    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(runtime, "_check_pointer_device", lambda ptr, what: checked.append((ptr, what)))
    runtime.device_array_or_none(torch.Tensor((2, 32), torch.float32, ptr=0x9100))
    runtime.device_array_or_none(torch.Tensor((0, 32), torch.float32, ptr=0x9200))  # empty: nothing to check
    assert checked == [(0x9100, "Tensor")]
    with pytest.raises(ValueError, match="null data pointer"):
        runtime.device_array_or_none(torch.Tensor((2, 32), torch.float32, ptr=0))


def _stand_in_driver(monkeypatch, count):
    """gpu_available, `count` devices, a cuPointerGetAttribute that counts its calls (addresses in
    `known` are memory of context 7), and a context -> device query that counts its calls."""
    from cuda.bindings import driver

    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(runtime, "device_info", lambda: types.SimpleNamespace(device_count=count))
    monkeypatch.setattr(runtime, "ensure_current", lambda: None)
    monkeypatch.setattr(runtime, "relaxed_capture", contextlib.nullcontext)
    monkeypatch.setattr(runtime, "device_ordinal", lambda: 0)
    asked, known, ctx_asked = [], {0x1000}, []

    def attribute(which, ptr):
        asked.append(ptr)
        if ptr not in known:
            return driver.CUresult.CUDA_ERROR_INVALID_VALUE, None
        return driver.CUresult.CUDA_SUCCESS, driver.CUcontext(7)

    def current():
        ctx_asked.append("current")
        return driver.CUresult.CUDA_SUCCESS, driver.CUcontext(7)

    monkeypatch.setattr(driver, "cuPointerGetAttribute", attribute)
    monkeypatch.setattr(driver, "cuCtxGetCurrent", current)
    return asked, known, ctx_asked


def test_pointer_check_memo_with_one_gpu(monkeypatch, clean_memos):
    """With one GPU a pointer that passed is not asked about again, until qgemm frees memory (an
    address checked before may have been freed: refused again then); a refusal is never
    memoized; the context's device needs no driver call."""
    asked, known, ctx_asked = _stand_in_driver(monkeypatch, 1)
    for _ in range(3):
        runtime._check_pointer_device(0x1000, "Tensor")
    assert asked == [0x1000] and ctx_asked == []
    for _ in range(2):
        with pytest.raises(ValueError, match="not memory that CUDA knows"):
            runtime._check_pointer_device(0x4000, "Tensor")
    assert asked == [0x1000, 0x4000, 0x4000]
    known.discard(0x1000)  # freed under a non-owning wrapper, by qgemm:
    monkeypatch.setattr(runtime, "_deferred_frees", [])
    from cuda.bindings import driver

    freed = []
    monkeypatch.setattr(driver, "cuMemFree", lambda p: freed.append(p) or (driver.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(driver, "cuCtxSetCurrent", lambda c: (driver.CUresult.CUDA_SUCCESS,))  # (the stand-in context
    runtime._release(0x1000)  # _release puts back must never reach a real driver)
    assert freed == [0x1000]
    with pytest.raises(ValueError, match="not memory that CUDA knows"):
        runtime._check_pointer_device(0x1000, "Tensor")


def test_pointer_check_asks_every_time_with_several_gpus(monkeypatch, clean_memos):
    asked, known, ctx_asked = _stand_in_driver(monkeypatch, 2)
    for _ in range(3):
        runtime._check_pointer_device(0x1000, "Tensor")
    assert asked == [0x1000] * 3 and ctx_asked == ["current"] * 3 and not runtime._checked_pointers


@pytest.mark.parametrize("count", [1, 2])
def test_foreign_stream_checked_once_wrapped_each_time(monkeypatch, clean_memos, count):
    """A caller's stream handle is device-checked once with one GPU (every time with more), and
    as_stream wraps it anew on every call -- a caller closing the Stream it got must not close
    anyone else's -- while qgemm's own calls share one kept wrapper; the context is made current
    on a memo hit too; a stream of another device is refused every time."""
    import cuda.core

    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(runtime, "device_info", lambda: types.SimpleNamespace(device_count=count))
    current = []
    monkeypatch.setattr(runtime, "ensure_current", lambda: current.append(1))

    class Stream:  # cuda.core's type cannot be patched; the whole name is stood in for
        def __init__(self, h):
            self.h = h

        @staticmethod
        def from_handle(h):
            return Stream(h)

    monkeypatch.setattr(cuda.core, "Stream", Stream)
    checked = []

    def same_device(s, given):
        checked.append(s.h)
        runtime.ensure_current()
        if s.h == 0xBAD:
            raise ValueError("stream: expected a stream of CUDA device 0 (qgemm's device), got a int of device 1")
        return s

    monkeypatch.setattr(runtime, "_same_device", same_device)
    torch_like = types.SimpleNamespace(cuda_stream=0x5000)
    got = [runtime.as_stream(torch_like) for _ in range(3)]
    assert [g.h for g in got] == [0x5000] * 3 and len({id(g) for g in got}) == 3  # never the same object
    assert checked == [0x5000] * (1 if count == 1 else 3) and len(current) == 3
    # qgemm's own calls (shared=True) take the one wrapper kept for the handle: never one handed out
    own = [runtime.launch_stream(torch_like) for _ in range(2)]
    if count == 1:
        assert own[0] is own[1] and all(own[0] is not g for g in got) and checked == [0x5000]
    else:
        assert own[0] is not own[1] and checked == [0x5000] * 5
    for _ in range(2):
        with pytest.raises(ValueError, match="of device 1"):
            runtime.as_stream(0xBAD)
    assert 0xBAD not in runtime._checked_streams


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
    monkeypatch.delenv("QGEMM_PDL", raising=False)
    opted = []
    mod = object.__new__(runtime.LoadedKernel)
    mod.label, mod.kernels, mod._configs = "t", {"k": "K"}, __import__("threading").local()
    mod._allow_dynamic_smem = lambda entry, shmem: opted.append(shmem)
    for _ in range(3):
        mod.launch("k", (4, 1, 1), (128, 1, 1), 0, (1, 2), pdl=True)
    assert len(made) == 1 and made[0]["programmatic_stream_serialization"] is True and len(launched) == 3
    monkeypatch.setenv("QGEMM_PDL", "0")
    mod.launch("k", (4, 1, 1), (128, 1, 1), 0, (1, 2), pdl=True)
    assert len(made) == 2 and "programmatic_stream_serialization" not in made[1]
    mod.launch("k", (8, 1, 1), (128, 1, 1), 0, (1, 2), pdl=True)
    assert len(made) == 3 and made[2]["grid"] == (8, 1, 1)
    # more dynamic shared memory for the same entry and grid: a new config, and the opt-in asked
    mod.launch("k", (8, 1, 1), (128, 1, 1), 64 << 10, (1, 2))
    mod.launch("k", (8, 1, 1), (128, 1, 1), 100 << 10, (1, 2))
    assert len(made) == 5 and opted == [64 << 10, 100 << 10] and made[4]["shmem_size"] == 100 << 10
    # QGEMM_PDL is read once per launch: switched off between the launch's read and the config's
    # making, the config still matches the key it is filed under
    monkeypatch.delenv("QGEMM_PDL", raising=False)
    reads = iter([True, False])
    monkeypatch.setattr(runtime, "pdl_enabled", lambda: next(reads))
    mod.launch("k", (16, 1, 1), (128, 1, 1), 0, (1, 2), pdl=True)
    assert made[-1].get("programmatic_stream_serialization") is True
    monkeypatch.setattr(runtime, "pdl_enabled", lambda: True)
    # another thread makes its own config (cuda.core's launch rewrites a config's native attributes)
    import threading

    n = len(made)
    th = threading.Thread(target=lambda: mod.launch("k", (16, 1, 1), (128, 1, 1), 0, (1, 2), pdl=True))
    th.start()
    th.join()
    assert len(made) == n + 1
    mod.launch("k", (16, 1, 1), (128, 1, 1), 0, (1, 2), pdl=True)
    assert len(made) == n + 1

    def fail(*a):
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(cuda.core, "launch", fail)
    with pytest.raises(qgemm.CudaError, match=r"launch\(k, grid=\(8, 1, 1\), block=\(128, 1, 1\)\)"):
        mod.launch("k", (8, 1, 1), (128, 1, 1), 0, (1, 2))


def test_kernel_launch_memo_follows_the_configuration(monkeypatch):
    """ops.Kernel.launch keeps (module, geometry) per shape *and* configuration: a tuning change
    (other defines for the same shape) must reach another module, not the first one's."""
    k = qgemm.get("w4a16.skinny")
    monkeypatch.setattr(k, "_launches", {})
    modules = []

    class Mod:
        def __init__(self, d):
            self.d = dict(d)
            modules.append(self)

        def launch(self, entry, grid, block, shmem, args, stream=None, pdl=False):
            self.launched = (grid, block, shmem)
            self.args = args

    monkeypatch.setattr(k, "_module", lambda defines=None: Mod(defines))
    a = types.SimpleNamespace(ptr=0x1000)
    d1 = k.spec.config(8, 4096, 4096, 132)
    d2 = next(c for c in k.spec.candidates(8, 4096, 4096) if c != d1)
    for d in (d1, d1, d2, d2, d1):
        k.launch(a, a, a, 8, 4096, 4096, defines=d)
    assert [m.d for m in modules] == [d1, d2]
    assert modules[1].launched[0] == k.geometry(8, 4096, 4096, d2).grid
    assert modules[0].args[3:] == (8, 4096, 4096) and all(type(v) is np.int32 for v in modules[0].args[3:])
    k.launch(a, a, a, 9, 4096, 4096, defines=d1)  # another shape: its own geometry, its own int32 M N K
    assert len(modules) == 3 and modules[2].args[3:] == (9, 4096, 4096)


def test_kvcache_plan_memo_follows_the_rows(monkeypatch, clean_memos):
    """MustafarRunner.launch's plan_for memo: one plan per (kind, bits, shape, rows, SMs, largest
    step, arch, density); another row count (groups x Lq) is planned again."""
    planned = []
    real = kv.plan_for
    monkeypatch.setattr(kv, "plan_for", lambda *a, **k: planned.append((a, k)) or real(*a, **k))
    monkeypatch.setattr(runtime, "gpu_available", lambda: False)
    kern = qgemm.get("mustafar.key_q2")
    runner = kern.spec.runner
    launched = []

    class Mod:
        def launch(self, entry, grid, block, shmem, args, stream=None, pdl=False):
            launched.append((entry, grid, shmem))

    monkeypatch.setattr(kern, "_module", lambda defines=None: Mod())
    dkv = types.SimpleNamespace(shape=(32, 4096, 128), max_step=600, density=0.3, scaled=False, ptr=lambda part: 0x1000)
    dx = types.SimpleNamespace(ptr=0x2000)
    dout = types.SimpleNamespace(ptr=0x3000, nbytes=0)
    for rows in (4, 4, 8, 4):
        runner.launch(kern, dkv, dx, dout, rows)
    assert [a[3] for a, _ in planned] == [4, 8] and len(launched) == 4
    assert launched[0] == launched[1] and launched[0][1] == real("key", 2, (32, 4096, 128), 4, 132, 600, cc=90,
                                                                    density=0.3).grid


def test_kvcache_launch_keeps_each_kernels_module(monkeypatch, clean_memos):
    """The launch memo keeps the kernel's module beside its plan (no lookup by the sorted #defines
    per call), per kernel: key_q2 and the compact key_q2c share a plan key but not a module; a plan
    passed in explicitly (kv_probe, the bench) still gets its own defines' module."""
    monkeypatch.setattr(runtime, "gpu_available", lambda: False)
    launched, looked_up = [], []

    class Mod:
        def __init__(self, name, defines):
            self.name, self.defines = name, defines

        def launch(self, entry, grid, block, shmem, args, stream=None, pdl=False):
            launched.append((self.name, entry, dict(self.defines)))

    kerns = [qgemm.get("mustafar.key_q2"), qgemm.get("mustafar.key_q2c")]
    for k in kerns:
        monkeypatch.setattr(k, "_module", lambda defines=None, name=k.name: looked_up.append(name) or Mod(name, defines))
    dkv = types.SimpleNamespace(shape=(32, 4096, 128), max_step=600, density=0.3, scaled=False, ptr=lambda part: 0x1000)
    dx, dout = types.SimpleNamespace(ptr=0x2000), types.SimpleNamespace(ptr=0x3000, nbytes=0)
    for _ in range(3):
        for k in kerns:
            k.spec.runner.launch(k, dkv, dx, dout, 4)
    assert looked_up == ["mustafar.key_q2", "mustafar.key_q2c"]  # once each
    assert [n for n, _, _ in launched] == ["mustafar.key_q2", "mustafar.key_q2c"] * 3
    assert [e for _, e, _ in launched] == [k.spec.entry for k in kerns] * 3
    other = kv.plan_for("key", 2, (32, 4096, 128), 8, 132, 600, cc=90, density=0.3)
    kerns[0].spec.runner.launch(kerns[0], dkv, dx, dout, 8, plan_=other)
    assert looked_up[-1] == "mustafar.key_q2" and launched[-1][2] == other.defines
