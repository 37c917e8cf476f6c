"""Every registered kernel on the GPU: fresh random inputs, odd shapes, poisoned outputs.

Marked `gpu`: skipped cleanly on machines without one (CI). tools/gpu_check.sh runs them.
"""

import itertools
import json
import warnings

import numpy as np
import pytest

import qgemm
from qgemm import packing, check, formats as F, registry, runtime
from edge_inputs import tiny_q8_1_blocks

pytestmark = pytest.mark.gpu

MS = [1, 7, 64, 513]
NS = [1, 33, 4096, 4097]  # 4097: a large N that is no multiple of any tile (the issue's odd shapes)
KS = [32, 4096]

GEMMS = [s.name for s in registry.list_kernels() if s.op.kind == "gemm"]
QUANTIZERS = [s.name for s in registry.list_kernels() if s.op.kind == "quantize"]


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", GEMMS)
def test_gemm_matches_references(name, m, n, k):
    spec = registry.spec(name)
    if spec.max_m is not None and m > spec.max_m:
        with pytest.raises(ValueError, match=f"at most M={spec.max_m}"):
            check.validate(qgemm.get(name), (m, n, k))
        return
    r = check.validate(qgemm.get(name), (m, n, k))
    assert r.unwritten == 0, f"seed {r.seed}: {r.unwritten} outputs never written"
    assert r.rel_err <= r.exact_tol, f"seed {r.seed}: rel err {r.rel_err:.3e} vs exact-math reference"
    assert r.nmse <= r.nmse_tol, f"seed {r.seed}: NMSE {r.nmse:.3e} vs float64 truth"
    assert r.passed


@pytest.mark.parametrize("k", KS + [14336])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_quantizer_byte_identical(name, m, k):
    r = check.validate(qgemm.get(name), (m, 1, k))
    assert r.detail["mismatched_blocks"] == 0, f"seed {r.seed}: {r.note}"
    assert r.unwritten == 0
    assert r.passed


def test_quantizer_adversarial_blocks():
    """Zeros, one-hot, exact .5 ties after scaling, negative extremes, tiny and large values."""
    rows = [np.zeros(64, np.float32)]
    one_hot = np.zeros(64, np.float32)
    one_hot[5] = -3.0
    rows.append(one_hot)
    ties = np.tile((np.arange(32, dtype=np.float32) - 16) * 0.5, 2)  # amax 8 -> d = 8/127
    ties[31] = 127.0 / 2  # the second block's amax: d = 0.5, so -63.5 / d = -127 exactly
    rows.append(ties)
    # d = 127 / 127 = 1 exactly: x / d = +-0.5, +-2.5, ... are exact ties, where roundf (ggml, away
    # from zero) and rintf (to even) disagree -- the block above only has ties both round alike
    exact_ties = np.zeros(64, np.float32)
    exact_ties[[0, 32]] = 127.0
    exact_ties[1:9] = [0.5, -0.5, 2.5, -2.5, 4.5, -4.5, 126.5, -126.5]
    exact_ties[33:41] = [1.5, -1.5, 3.5, -3.5, 5.5, -5.5, 63.5, -63.5]
    rows.append(exact_ties)
    rows.append(np.full(64, -7.5, np.float32))
    rows.append(np.linspace(-1e-30, 1e-30, 64, dtype=np.float32))
    rows.append(np.linspace(-1e3, 1e3, 64, dtype=np.float32))  # block sums stay below half's 65504
    x = np.stack(rows)
    got = qgemm.get("quantize.q8_1")(x)
    want = F.quantize_q8_1(x)
    assert got.tobytes() == want.tobytes()


def test_quantizer_rejects_non_finite_and_overflow():
    q = qgemm.get("quantize.q8_1")
    x = np.ones((2, 32), np.float32)
    x[1, 3] = np.inf
    with pytest.raises(ValueError, match="finite"):
        q(x)
    big = np.full((1, 32), 60000.0, np.float32)  # s = 32 * 60000 overflows half
    with pytest.raises(ValueError, match="overflows half"):
        q(big)


def _weight_quantizer_blocks():
    """Rows of 64 values (two blocks each) where ggml's weight quantizers are easy to get wrong."""
    rows = []
    zeros = np.zeros(64, np.float32)
    rows.append(zeros)  # max = +0: Q4_0 d = 0 / -8 = -0.0 (0x8000)
    signed = zeros.copy()
    signed[[0, 32]] = -0.0  # numpy's argmax takes x[0]: d = +0.0
    rows.append(signed)
    # Q4_0: max = -8 -> d = 1, id = 1: x + 8.5 lands on integers (9.0, 8.0, 15.0, 16.0 -> 15, 0.5 -> 0);
    # max = +8 -> d = -1: 8 -> 0.5 -> 0, -7.5 -> 16 -> 15. Q8_0: amax 8, d = 8/127
    b4 = np.zeros(64, np.float32)
    b4[:8] = [-8.0, 0.5, -0.5, 6.5, 7.4, 7.5, -7.9, 0.0]
    b4[32:40] = [8.0, -7.5, 3.25, -3.25, 0.5, -0.5, 7.99, -8.0]  # the first of two equal |x| wins: +8
    rows.append(b4)
    # Q8_0: amax 127 -> d = 1: x * id = +-0.5, +-2.5, +-126.5 are exact ties (roundf: away from zero)
    b8 = np.zeros(64, np.float32)
    b8[[0, 32]] = [127.0, -127.0]
    b8[1:9] = [0.5, -0.5, 2.5, -2.5, 4.5, -4.5, 126.5, -126.5]
    b8[33:41] = [1.5, -1.5, 3.5, -3.5, 5.5, -5.5, 63.5, -63.5]
    rows.append(b8)
    first = np.zeros(64, np.float32)
    first[[3, 7, 40, 41]] = [3.0, -3.0, -5.0, 5.0]  # equal magnitudes: the first one's sign
    rows.append(first)
    rows.append(np.linspace(-1e-38, 1e-38, 64, dtype=np.float32))  # 1 / d overflows: q = 0 (ggml / numpy on x86)
    rows.append(np.linspace(-1e-36, 1e-36, 64, dtype=np.float32))  # subnormal d, finite 1 / d
    rows.append(np.linspace(-5e5, 4e5, 64, dtype=np.float32))  # Q4_0 d = 62500, below half's 65504
    rows.append(np.full(64, -7.5, np.float32))
    return np.stack(rows)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_weight_quantizers_adversarial_blocks(fmt):
    """The weight quantizers byte for byte ggml's (formats.quantize, gguf-checked) on blocks of
    signed zeros, exact ties, equal magnitudes of both signs, 1 / d overflowing, subnormal d and
    d near half's limit, for float32 / float16 / bfloat16 input (the 16-bit values widened); also
    an input at an odd offset (the value-by-value loads) and what is refused after the launch."""
    x = _weight_quantizer_blocks()
    for suffix, a in (("", x), ("_f16", np.clip(x, -6e4, 6e4).astype(np.float16)), ("_bf16", F.f32_to_bf16(x))):
        want = F.quantize(F.to_float32(a), fmt)
        k = qgemm.get(f"quantize.{fmt}{suffix}")
        assert k(a).tobytes() == want.tobytes(), suffix
        raw = qgemm.DeviceArray.empty((a.nbytes + 16,), np.uint8)
        size = a.dtype.itemsize
        view = qgemm.DeviceArray(raw.ptr + size, a.shape, a.dtype, owner=raw)  # one element past 16: no vector loads
        qgemm.DeviceArray.from_host(np.ascontiguousarray(a)).copy_to(view)
        assert k(view).to_host().tobytes() == want.tobytes(), suffix
        if size == 4:  # a float32 array 2 bytes past a boundary: refused before the launch (it would fault)
            with pytest.raises(ValueError, match=f"quantize.{fmt}: X must start on a 4-byte boundary"):
                k(qgemm.DeviceArray(raw.ptr + 2, a.shape, a.dtype, owner=raw))
    q = qgemm.get(f"quantize.{fmt}")
    assert q(x).tobytes() == F.quantize(x, fmt).tobytes()  # the context lives on
    bad = np.ones((2, 64), np.float32)
    bad[1, 40] = np.nan
    with pytest.raises(ValueError, match=f"quantize.{fmt}: input must be finite; found inf or NaN"):
        q(qgemm.DeviceArray.from_host(bad))
    big = np.full((1, 32), 6e5 if fmt == "q4_0" else 9e6, np.float32)  # d = 75000 / 70866: past half
    limit = "524160 \\(d = max / -8\\)" if fmt == "q4_0" else "8321040 \\(d = amax / 127\\)"
    with pytest.raises(ValueError, match=f"quantize.{fmt}: a block's scale d overflows half \\(max 65504\\): some block holds "
                                         f"a value of magnitude >= {limit}; scale the input down"):
        q(qgemm.DeviceArray.from_host(big))
    edge = np.full((1, 32), 524159.0 if fmt == "q4_0" else 8321039.0, np.float32)  # d rounds to 65504: kept
    assert q(edge).tobytes() == F.quantize(edge, fmt).tobytes()
    with pytest.raises(ValueError, match="overflows half"):
        F.quantize(big, fmt)  # the CPU quantizer agrees


def test_call_api_host_roundtrip(rng):
    a = rng.standard_normal((5, 64), dtype=np.float32)
    w_f = rng.standard_normal((9, 64), dtype=np.float32)
    w = qgemm.quantize_q4_0(w_f)
    k = qgemm.get("w4a16.naive")
    c = k(a, w)
    assert c.shape == (5, 9) and c.dtype == np.float32
    np.testing.assert_allclose(c, qgemm.reference.exact_w4a16(a, w), rtol=1e-5, atol=1e-4)
    # raw gguf-style bytes are accepted too
    c2 = k(a, w.view(np.uint8).reshape(9, -1))
    np.testing.assert_array_equal(c, c2)


def test_device_arrays_in_and_out(rng):
    a = rng.standard_normal((7, 96), dtype=np.float32)
    w = rng.standard_normal((33, 96), dtype=np.float32)
    da, dw = qgemm.DeviceArray.from_host(a), qgemm.DeviceArray.from_host(w)
    k = qgemm.get("fp32.tiled")
    dc = k(da, dw)
    assert isinstance(dc, qgemm.DeviceArray) and dc.shape == (7, 33)
    cai = dc.__cuda_array_interface__
    assert cai["typestr"] == "<f4" and cai["shape"] == (7, 33)
    np.testing.assert_allclose(dc.to_host(), a.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)
    out = qgemm.DeviceArray.empty((7, 33), np.float32)
    out.fill_bytes(0xFF)
    assert k(da, dw, out=out) is out
    np.testing.assert_array_equal(out.to_host(), dc.to_host())


def test_out_as_raw_bytes(rng):
    """out= may be the result's raw bytes (uint8 of the same size, as torch / CuPy buffers come):
    written through a float32 view of them (ops.Kernel._out, DeviceArray.reshape(-1))."""
    a = rng.standard_normal((7, 96), dtype=np.float32)
    w = rng.standard_normal((33, 96), dtype=np.float32)
    k = qgemm.get("fp32.tiled")
    raw = qgemm.DeviceArray.empty((7 * 33 * 4,), np.uint8)
    raw.fill_bytes(0xFF)
    assert k(qgemm.DeviceArray.from_host(a), qgemm.DeviceArray.from_host(w), out=raw) is raw
    np.testing.assert_allclose(raw.to_host().view(np.float32).reshape(7, 33), a.astype(np.float64) @ w.T,
                               rtol=1e-5, atol=1e-4)


def test_device_array_copies_and_dlpack_device(rng):
    """copy.deepcopy of a DeviceArray is a new allocation with the data; copy.copy a view; the
    DLPack export accepts its own device as dl_device (the protocol) and refuses another."""
    import copy

    a = rng.standard_normal((5, 7), dtype=np.float32)
    d = qgemm.DeviceArray.from_host(a)
    deep, shallow = copy.deepcopy(d), copy.copy(d)
    assert deep.ptr != d.ptr and shallow.ptr == d.ptr
    np.testing.assert_array_equal(deep.to_host(), a)
    d.free()
    np.testing.assert_array_equal(deep.to_host(), a)  # its own memory
    with pytest.raises(ValueError, match="freed"):
        shallow.ptr
    d2 = qgemm.DeviceArray.from_host(a)
    d2.__dlpack__(dl_device=d2.__dlpack_device__())
    with pytest.raises(BufferError, match="without a copy"):
        d2.__dlpack__(dl_device=(1, 0))


def test_torch_tensors_without_copy(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    a = torch.randn(7, 64, device="cuda")
    w_q = qgemm.quantize_q4_0(rng.standard_normal((33, 64), dtype=np.float32))
    w = torch.from_numpy(w_q.view(np.uint8).reshape(33, -1).copy()).cuda()
    out = torch.full((7, 33), float("nan"), device="cuda")
    res = qgemm.get("w4a16.tiled")(a, w, out=out)
    assert res is out
    torch.cuda.synchronize()
    ref = qgemm.reference.exact_w4a16(a.cpu().numpy(), w_q)
    np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-5, atol=1e-4)
    # the output of a device call wraps in torch without a copy
    dc = qgemm.get("w4a16.tiled")(a, w)
    t = torch.as_tensor(dc, device="cuda")
    assert t.data_ptr() == dc.ptr


def test_torch_fast_path_matches_the_array_interface():
    """runtime._torch_array reads a plain CUDA tensor from its accessors: the DeviceArray must be
    the one torch's own __cuda_array_interface__ gives, for every dtype it takes; what it leaves
    to the general path is refused (or taken) there as before."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from qgemm import runtime

    base = torch.randn(6, 64, device="cuda")
    taken = [base, base[2:], base[1], base.half(), base.bfloat16(), base.double(), base.view(torch.int32),
             (base * 10).to(torch.int8), (base * 10).to(torch.uint8), (base * 10).to(torch.int16),
             (base * 10).to(torch.int64), torch.empty(0, 64, device="cuda"), base[6:], base.view(2, 3, 64)]
    for t in taken:
        fast = runtime._torch_array(t)
        assert fast is not None, (t.dtype, t.shape)
        general = runtime.DeviceArray._from_cai(t, t.__cuda_array_interface__)
        assert (fast._ptr, fast.shape, fast.dtype, fast.readonly) == (general._ptr, general.shape, general.dtype,
                                                                      general.readonly), (t.dtype, t.shape)
    grad = base.clone().requires_grad_()
    left = [base.t(), grad, torch.nn.Parameter(base.clone(), requires_grad=False), base.cpu(),
            base > 0, torch.randn(4, 8, device="cuda", dtype=torch.complex64)]
    for t in left:
        assert runtime._torch_array(t) is None, (type(t).__name__, t.dtype)
    with pytest.raises(ValueError, match="C-contiguous"):
        runtime.as_device_array(base.t())
    with pytest.raises(RuntimeError, match="requires grad"):  # torch's own refusal
        runtime.as_device_array(grad)
    p = runtime.as_device_array(torch.nn.Parameter(base.clone(), requires_grad=False))  # the general path
    assert p.shape == (6, 64) and p.dtype == np.float32
    assert runtime.device_array_or_none(base.cpu()) is None
    # a lazily negated view (the imaginary part of a conjugate) holds -x in memory: refused
    z = torch.randn(8, 64, dtype=torch.complex64, device="cuda")
    neg = z.conj().imag
    assert neg.is_neg()
    with pytest.raises(ValueError, match="negation bit"):
        qgemm.matmul(neg, qgemm.pack_weights(qgemm.quantize_q4_0(np.ones((32, 64), np.float32))))
    with pytest.raises(ValueError, match="conjugation bit"):
        runtime.as_device_array(z.conj())
    if hasattr(torch, "_neg_view"):  # a contiguous negated view: the case the interface exported as it is
        contiguous_neg = torch._neg_view(base)
        assert contiguous_neg.is_contiguous()
        with pytest.raises(ValueError, match="negation bit"):
            runtime.as_device_array(contiguous_neg)
    assert runtime._torch_array(neg.resolve_neg().contiguous()) is not None


def test_cupy_arrays(rng):
    cp = pytest.importorskip("cupy")
    a = cp.asarray(rng.standard_normal((3, 64), dtype=np.float32))
    w = cp.asarray(rng.standard_normal((5, 64), dtype=np.float32))
    c = qgemm.get("fp32.naive")(a, w)
    np.testing.assert_allclose(cp.asarray(c).get(), cp.asnumpy(a).astype(np.float64) @ cp.asnumpy(w).T, rtol=1e-5, atol=1e-4)


def test_bad_input_raises_before_launch(rng):
    k = qgemm.get("w4a16.naive")
    a = rng.standard_normal((4, 64), dtype=np.float32)
    w8 = qgemm.quantize_q8_0(rng.standard_normal((4, 64), dtype=np.float32))
    with pytest.raises(ValueError, match="q4_0"):
        k(a, w8)
    with pytest.raises(ValueError, match="K mismatch"):
        k(rng.standard_normal((4, 96), dtype=np.float32), qgemm.quantize_q4_0(rng.standard_normal((4, 64), dtype=np.float32)))
    with pytest.raises(ValueError, match="both be host"):
        k(qgemm.DeviceArray.from_host(a), qgemm.quantize_q4_0(a))
    with pytest.raises(ValueError, match="multiple of 32"):
        qgemm.get("quantize.q8_1")(rng.standard_normal((2, 40), dtype=np.float32))


def test_pointers_qgemm_cannot_use_are_refused(rng):
    """A __cuda_array_interface__ whose pointer is not CUDA memory (here: a host numpy buffer)
    is a ValueError before any launch -- a kernel given it would fault and end the context."""
    host = np.zeros(64, np.float32)

    class Fake:
        __cuda_array_interface__ = {"shape": (2, 32), "typestr": "<f4", "data": (host.ctypes.data, False), "version": 3}

    with pytest.raises(ValueError, match=r"is not memory that CUDA knows; expected device memory of CUDA device 0"):
        qgemm.get("quantize.q8_1")(Fake())
    with pytest.raises(ValueError, match=r"is not memory that CUDA knows"):
        qgemm.matmul(Fake(), qgemm.DeviceArray.from_host(qgemm.quantize_q4_0(np.ones((8, 32), np.float32)).view(np.uint8)),
                     fmt="q4_0")


_OTHER_DEVICE = """
import sys, numpy as np, torch, qgemm
from qgemm import runtime
print("device", runtime.device_info().ordinal, runtime.device_info().device_count)
rng = np.random.default_rng(int(sys.argv[1]))
wq = qgemm.quantize_q4_0(rng.standard_normal((96, 256), dtype=np.float32))
x = torch.randn(5, 256, device="cuda:1")
w = torch.from_numpy(wq.view(np.uint8).reshape(96, -1).copy()).to("cuda:1")
c = qgemm.matmul(x, w, fmt="q4_0")
t = torch.from_dlpack(c)
assert t.device == torch.device("cuda:1"), t.device
ref = qgemm.plan(5, 96, 256, "q4_0").reference(x.cpu().numpy(), wq)
np.testing.assert_allclose(t.cpu().numpy(), ref, rtol=1e-5, atol=1e-3)
pw = qgemm.pack_weights(wq)
for m in (1, 8, 40):
    xm = rng.standard_normal((m, 256), dtype=np.float32)
    np.testing.assert_allclose(qgemm.matmul(xm, pw), qgemm.plan(m, 96, 256, "q4_0", packed=True).reference(xm, wq), rtol=1e-4, atol=1e-2)
out = torch.full((5, 96), float("nan"), device="cuda:1")
with torch.cuda.device(1):
    s = torch.cuda.Stream()
qgemm.matmul(x, w, fmt="q4_0", out=out, stream=s)
s.synchronize()
np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-5, atol=1e-3)
try:
    qgemm.matmul(x.to("cuda:0"), w, fmt="q4_0")
except ValueError as e:
    print("refused:", e)
print("ok")
"""


def test_another_device(rng):
    """On a machine with two GPUs: torch tensors and streams of device 1 are refused by name under
    the default device 0; with QGEMM_DEVICE=1 (its own process: the device is fixed at first use)
    qgemm runs there -- device tensors, host arrays, packed weights, a caller's stream -- and
    refuses device 0's tensors."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import os
    import subprocess
    import sys

    x1 = torch.randn(3, 64, device="cuda:1")
    w = qgemm.DeviceArray.from_host(qgemm.quantize_q4_0(rng.standard_normal((8, 64), dtype=np.float32)).view(np.uint8))
    with pytest.raises(ValueError, match=r"expected an array on CUDA device 0 \(qgemm's device\), got a Tensor on device 1"):
        qgemm.matmul(x1, w, fmt="q4_0")
    with pytest.raises(ValueError, match=r"expected an array on CUDA device 0 .* on device 1"):
        qgemm.matmul(_DLPackOnly(x1), w, fmt="q4_0")
    with torch.cuda.device(1):
        s1 = torch.cuda.Stream()
    with pytest.raises(ValueError, match=r"stream: expected a stream of CUDA device 0 \(qgemm's device\), got a Stream of device 1"):
        qgemm.matmul(torch.randn(3, 64, device="cuda:0"), w, fmt="q4_0", stream=s1)
    env = dict(os.environ, QGEMM_DEVICE="1")
    r = subprocess.run([sys.executable, "-c", _OTHER_DEVICE, str(int(rng.integers(1 << 30)))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "device 1 2" in r.stdout and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr
    assert "refused: expected an array on CUDA device 1 (qgemm's device), got a Tensor on device 0" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "qgemm", "info"], env=env, capture_output=True, text=True, timeout=120)
    assert "GPU:              device 1 of 2 (QGEMM_DEVICE picks)" in r.stdout, r.stdout + r.stderr


def test_a_device_that_does_not_exist():
    import os
    import subprocess
    import sys

    env = dict(os.environ, QGEMM_DEVICE="99")
    r = subprocess.run([sys.executable, "-m", "qgemm", "info"], env=env, capture_output=True, text=True, timeout=120)
    assert "QGEMM_DEVICE=99 names no device: the driver reports" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "qgemm", "profile", "w4a8.naive", "--shape", "1x32x32"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "QGEMM_DEVICE=99 names no device" in r.stdout + r.stderr, r.stdout + r.stderr


_PER_THREAD_STREAMS = """
import sys, threading, numpy as np, qgemm
from qgemm import dispatch, runtime
assert int(runtime.default_stream().handle) == 2, runtime.default_stream().handle  # CU_STREAM_PER_THREAD
rng = np.random.default_rng(int(sys.argv[1]))
wq = qgemm.quantize_q4_0(rng.standard_normal((256, 512), dtype=np.float32))
dw = qgemm.DeviceArray.from_host(wq)
ref = qgemm.plan(4, 256, 512, "q4_0").reference
xs = [rng.standard_normal((4, 512), dtype=np.float32) * (i + 1) for i in range(8)]
got, errors = {i: [] for i in range(8)}, []

def calls(i):
    try:
        dx = qgemm.DeviceArray.from_host(xs[i])
        for j in range(20):  # device calls (staging + GEMM) and host calls (status read back), interleaved
            got[i].append(qgemm.matmul(dx, dw, fmt="q4_0").to_host() if j % 2 else qgemm.matmul(xs[i], wq))
    except Exception as e:
        errors.append(e)

sys.setswitchinterval(1e-6)
threads = [threading.Thread(target=calls, args=(i,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
for i, outs in got.items():
    for c in outs:
        np.testing.assert_allclose(c, ref(xs[i], wq), rtol=1e-5, atol=1e-3)
assert not any(isinstance(k, tuple) for k in dispatch._queue_locks), list(dispatch._queue_locks)
print("ok", len(threads))
"""


def test_threads_on_the_per_thread_default_stream(rng):
    """With cuda.core's per-thread default stream (CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1,
    its own process): every thread's ops run on a stream of its own under one handle, each with
    its own staging and queue lock (none kept in the shared table): eight threads' device and host
    calls at once all come out right."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM": "1"}
    r = subprocess.run([sys.executable, "-c", _PER_THREAD_STREAMS, str(int(rng.integers(1 << 30)))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok 8" in r.stdout, r.stdout + r.stderr


def test_threads_sharing_a_stream(rng):
    """Threads calling qgemm.matmul at once on the default stream: an op's kernels are queued
    together, so no op reads another's staged activations (M = 4: quantize.q8_1 into the stream's
    staging buffer, then w4a8.gemv) and no host call reads another's overflow flag. The GIL is made
    to switch threads every microsecond, so unguarded launches interleave."""
    import sys
    import threading

    wq = qgemm.quantize_q4_0(rng.standard_normal((256, 512), dtype=np.float32))
    dw = qgemm.DeviceArray.from_host(wq)
    ref = qgemm.plan(4, 256, 512, "q4_0").reference
    xs = [rng.standard_normal((4, 512), dtype=np.float32) * (i + 1) for i in range(6)]
    big = np.full((4, 512), 3e4, np.float32)  # each block's sum s = 9.6e5 overflows Q8_1's half
    got = {i: [] for i in range(len(xs))}
    errors, overflow_flags = [], []

    def device_calls(i):
        dx = qgemm.DeviceArray.from_host(xs[i])
        for _ in range(40):
            got[i].append(qgemm.matmul(dx, dw, fmt="q4_0"))

    def host_calls(i):
        for _ in range(15):
            got[i].append(qgemm.matmul(xs[i], wq))

    def overflowing_calls():
        for _ in range(15):
            try:
                qgemm.matmul(big, wq)
            except ValueError as e:
                overflow_flags.append("overflow" in str(e))

    def guarded(fn, *args):
        def run():
            try:
                fn(*args)
            except Exception as e:  # pragma: no cover - the assertion below names it
                errors.append(e)
        return run

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = ([threading.Thread(target=guarded(device_calls, i)) for i in range(3)]
                   + [threading.Thread(target=guarded(host_calls, i)) for i in range(3, 6)]
                   + [threading.Thread(target=guarded(overflowing_calls)) for _ in range(2)])
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    assert overflow_flags == [True] * 30, "an overflowing host call returned without its error"
    for i, x in enumerate(xs):
        want = ref(x, wq)
        for c in got[i]:
            np.testing.assert_allclose(c if isinstance(c, np.ndarray) else c.to_host(), want, rtol=1e-5, atol=1e-3)


# the refused host call leaves g2 empty, which torch reports as a warning when the capture ends
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
@pytest.mark.parametrize("packed", [False, True])
def test_matmul_in_a_torch_cuda_graph(rng, packed):
    """qgemm.matmul captured by torch.cuda.graph (global capture mode, torch's default) and
    replayed: every replay multiplies what the static inputs hold then -- ggml blocks at M = 4
    (quantize.q8_1 + w4a8.gemv) and 64, packed weights at M = 1, 8 and 64 (on Hopper the
    convert.f16k prologue + wgmma_rs); an output allocated during the capture (out=None) is
    written by the replays; eager calls on another stream between replays stay right; a host call
    inside a capture is refused by name."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    n, k = 96, 512
    wq = qgemm.quantize_q4_0(rng.standard_normal((n, k), dtype=np.float32))
    w = qgemm.pack_weights(wq) if packed else torch.from_numpy(wq.view(np.uint8).copy()).cuda()
    kw = {} if packed else {"fmt": "q4_0"}
    ms = (1, 8, 64) if packed else (4, 64)
    xs = {m: torch.randn(m, k, device="cuda") for m in ms}
    ys = {m: torch.full((m, n), float("nan"), device="cuda") for m in ms}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile and load outside the capture
        for m in ms:
            qgemm.matmul(xs[m], w, out=ys[m], stream=side, **kw)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cs = torch.cuda.current_stream()
        for m in ms:
            qgemm.matmul(xs[m], w, out=ys[m], stream=cs, **kw)
        fresh = qgemm.matmul(xs[ms[0]], w, stream=cs, **kw)  # allocated during the capture
    for _ in range(3):
        new = {m: torch.randn(m, k, device="cuda") for m in ms}
        for m in ms:
            xs[m].copy_(new[m])
            ys[m].fill_(float("nan"))
        g.replay()
        eager = {m: qgemm.matmul(new[m].cpu().numpy(), w if packed else wq) for m in ms}  # between replays
        torch.cuda.synchronize()
        for m in ms:
            want = qgemm.plan(m, n, k, "q4_0", packed=packed).reference(new[m].cpu().numpy(), wq)
            np.testing.assert_allclose(ys[m].cpu().numpy(), want, rtol=1e-5, atol=2e-3)
            np.testing.assert_allclose(eager[m], want, rtol=1e-5, atol=2e-3)
        np.testing.assert_array_equal(torch.as_tensor(fresh, device="cuda").cpu().numpy(), ys[ms[0]].cpu().numpy())
    host_x = new[ms[0]].cpu().numpy()  # (torch refuses a device-to-host copy inside a capture)
    g2 = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="cannot be used while a CUDA graph is being captured"):
        with torch.cuda.graph(g2):
            qgemm.matmul(host_x, w if packed else wq, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()


def test_two_graphs_of_one_stream_replayed_at_once(rng):
    """Two graphs captured on one stream (torch.cuda.graph's default) replayed at the same time on
    two streams: with one staging buffer per stream they shared it, and each op's GEMM could read
    the other's quantized activations. Each capture now has its own."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    m, n, k = 64, 2048, 4096  # ggml blocks: quantize.q8_1 into the staging buffer, then the GEMM
    wq = qgemm.quantize_q8_0(rng.standard_normal((n, k), dtype=np.float32))
    w = torch.from_numpy(wq.view(np.uint8).copy()).cuda()
    xs = [torch.randn(m, k, device="cuda") * (1 + 99 * i) for i in range(2)]
    ys = [torch.empty(m, n, device="cuda") for _ in range(2)]
    for x, y in zip(xs, ys):  # compile and load outside the captures
        qgemm.matmul(x, w, out=y, fmt="q8_0", stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    for g, x, y in zip(graphs, xs, ys):
        with torch.cuda.graph(g):
            for _ in range(4):
                qgemm.matmul(x, w, out=y, fmt="q8_0", stream=torch.cuda.current_stream())
    streams = [torch.cuda.Stream() for _ in range(2)]
    want = [qgemm.plan(m, n, k, "q8_0").reference(x.cpu().numpy(), wq) for x in xs]
    for _ in range(10):
        for y in ys:
            y.fill_(float("nan"))
        torch.cuda.synchronize()
        for g, st in zip(graphs, streams):
            with torch.cuda.stream(st):
                g.replay()
        torch.cuda.synchronize()
        for y, ref in zip(ys, want):
            np.testing.assert_allclose(y.cpu().numpy(), ref, rtol=1e-5, atol=1e-3 * float(np.abs(ref).max()))


def test_matmul_in_a_qgemm_graph(rng):
    """qgemm's own runtime.Graph (what bench, profile, tune and compare-llamacpp replay) around
    qgemm.matmul on ggml blocks (quantize.q8_1 into staging scratch, then the GEMM): every replay
    multiplies what the inputs hold then; two graphs of one stream replayed at once on two streams
    do not share the staging; each graph holds its capture's scratch, and deleting it frees that
    scratch (nothing is left in the capture tables) while eager calls stay right."""
    import gc
    import weakref

    from qgemm import dispatch

    m, n, k = 64, 2048, 4096
    wq = qgemm.quantize_q8_0(rng.standard_normal((n, k), dtype=np.float32))
    w = qgemm.DeviceArray.from_host(wq.view(np.uint8))
    xs = [qgemm.DeviceArray.from_host(np.zeros((m, k), np.float32)) for _ in range(2)]
    ys = [qgemm.DeviceArray.empty((m, n), np.float32) for _ in range(2)]
    stream = runtime.create_stream()
    for x, y in zip(xs, ys):  # compile and load outside the captures
        qgemm.matmul(x, w, out=y, fmt="q8_0", stream=stream)
    runtime.synchronize(stream)

    def recorder(x, y):
        def record():
            for _ in range(4):
                qgemm.matmul(x, w, out=y, fmt="q8_0", stream=stream)
        return record

    tables = (set(runtime._capture_buffers), set(dispatch._graph_buffers))  # earlier torch captures keep theirs
    graphs = [runtime.Graph(recorder(x, y), stream) for x, y in zip(xs, ys)]
    assert all(g._held for g in graphs)  # each took its own staging
    held = [weakref.ref(b) for g in graphs for b in g._held]
    assert not {b.ptr for b in graphs[0]._held} & {b.ptr for b in graphs[1]._held}
    assert (set(runtime._capture_buffers), set(dispatch._graph_buffers)) == tables  # handed to the graphs
    side = [runtime.create_stream() for _ in range(2)]
    for i in range(4):
        hx = [rng.standard_normal((m, k), dtype=np.float32) * (1 + 99 * j) for j in range(2)]
        for x, h, y in zip(xs, hx, ys):
            x.copy_from_host(h)
            y.fill_bytes(0xFF, stream=stream)  # NaN: every element must be written by the replay
        runtime.synchronize(stream)
        for graph, st in zip(graphs, side):
            graph.stream = st if i % 2 else stream  # replayed at once on two streams, then in turn on one
            graph.launch()
        for st in side + [stream]:
            runtime.synchronize(st)
        for h, y in zip(hx, ys):
            want = qgemm.plan(m, n, k, "q8_0").reference(h, wq)
            np.testing.assert_allclose(y.to_host(), want, rtol=1e-5, atol=1e-3 * float(np.abs(want).max()))
    del graphs, graph
    gc.collect()
    assert all(r() is None for r in held)  # freed with their graphs
    h = rng.standard_normal((m, k), dtype=np.float32)
    np.testing.assert_allclose(qgemm.matmul(h, wq), qgemm.plan(m, n, k, "q8_0").reference(h, wq), rtol=1e-5, atol=1e-3)


def test_cuda_error_names_the_call():
    with pytest.raises(qgemm.CudaError, match="cuMemAlloc"):
        qgemm.DeviceArray.empty((1 << 50,), np.uint8)


def test_profile_reports_sane_numbers():
    from qgemm import bench

    p = bench.profile(qgemm.get("fp32.tiled"), (64, 256, 256), warmup=2, iters=5)
    assert 0 < p.min_us <= p.median_us <= p.max_us
    assert p.tflops > 0 and p.bytes == 64 * 256 * 4 + 256 * 256 * 4 + 64 * 256 * 4
    assert 0 < p.roofline_pct <= 100


# ------------------------------------------------------------------------------------------
# The two bugs of the debugging story (docs: debugging): a wrong int/byte index and a wrong
# nibble pairing. Both must fail these tests loudly.

W4A8 = [s.name for s in registry.list_kernels(op="w4a8")]
W8A8 = [s.name for s in registry.list_kernels(op="w8a8")]


def hand_case_blocks():
    """The story's 1x1x32 case: A q_a = -16..15 with d_a = 0.5, s_a = -8; W d_w = 0.25 with stored
    nibbles q_w[i] = ((i + 1) // 2) & 0xF (0, 1, 1, 2, 2, ..., 15, 15, 0)."""
    a = np.zeros((1, 1), F.block_q8_1)
    a["d"], a["s"] = 0.5, -8.0
    q_a = np.arange(-16, 16)
    a["qs"][0, 0] = q_a
    q_w = np.array([((i + 1) // 2) & 0xF for i in range(32)])
    w = np.zeros((1, 1), F.block_q4_0)
    w["d"] = 0.25
    w["qs"][0, 0] = (q_w[:16] | (q_w[16:] << 4)).astype(np.uint8)  # element j low, j+16 high
    return a, w, q_a, q_w


@pytest.mark.parametrize("name", W4A8)
def test_w4a8_hand_computed_141(name):
    a, w, q_a, q_w = hand_case_blocks()
    sumi = int(sum(int(x) * int(y) for x, y in zip(q_a, q_w)))
    expected = 0.25 * (0.5 * sumi - 8 * (-8.0))
    assert sumi == 1000 and expected == 141.0
    c = qgemm.get(name)(a, w)
    assert c.shape == (1, 1) and c[0, 0] == 141.0, f"{name} gave {c[0, 0]} for the hand case (expected 141)"


def one_hot_q8_1(values):
    """32 Q8_1 rows (one block each): row p has a single non-zero q at position p."""
    a = np.zeros((32, 1), F.block_q8_1)
    a["d"] = 0.03125
    for p in range(32):
        a["qs"][p, 0, p] = values[p]
        a["s"][p, 0] = values[p] * 0.03125
    return a


def _rows_in_chunks(name, a, w):
    """Decode kernels take at most max_m rows: feed them the A rows a chunk at a time."""
    k = qgemm.get(name)
    step = k.spec.max_m or len(a)
    return np.concatenate([k(np.ascontiguousarray(a[i:i + step]), w) for i in range(0, len(a), step)])


@pytest.mark.parametrize("name", W4A8)
def test_w4a8_one_hot_positions(name, rng):
    """Row p of A is one-hot at element p; row p of W has stored nibble 15 at element p and 0
    elsewhere. C must equal the reference for all 32 x 32 pairs (plus dense random rows), so a
    wrong int index or a wrong nibble pairing shows up as an exact, located mismatch."""
    vals = rng.integers(1, 127, 32) * rng.choice([-1, 1], 32)
    a = np.concatenate([one_hot_q8_1(vals), F.quantize_q8_1(rng.standard_normal((3, 32), dtype=np.float32))])
    w = np.zeros((32, 1), F.block_q4_0)
    w["d"] = 0.0625
    for p in range(32):
        nib = np.zeros(32, np.uint8)
        nib[p] = 15
        w["qs"][p, 0] = nib[:16] | (nib[16:] << 4)
    w = np.concatenate([w, F.quantize_q4_0(rng.standard_normal((5, 32), dtype=np.float32))])
    c = _rows_in_chunks(name, a, w)
    ref = qgemm.reference.exact_w4a8(a, w)
    # float32 rounding is relative to the terms d_w d_a sumi and 8 d_w s, not to their difference,
    # which the random rows can bring near zero (a rare 1e-6 miss on fresh inputs); a wrong index
    # or nibble pairing is off by a whole term
    qa, qw = np.abs(a["qs"][:, 0].astype(np.float64)), np.abs(F.unpack_q4_0(w).astype(np.float64))
    terms = np.abs(w["d"][:, 0].astype(np.float64))[None, :] * (
        np.abs(a["d"][:, 0].astype(np.float64))[:, None] * (qa @ qw.T) + 8 * np.abs(a["s"][:, 0].astype(np.float64))[:, None])
    bad = np.argwhere(np.abs(c - ref) > 1e-6 * (1 + terms))
    assert bad.size == 0, f"{name}: first mismatches (A row, W row): {bad[:5].tolist()}, got {c[tuple(bad[0])]} want {ref[tuple(bad[0])]}"


@pytest.mark.parametrize("name", W8A8)
def test_w8a8_one_hot_positions(name, rng):
    vals = rng.integers(1, 127, 32) * rng.choice([-1, 1], 32)
    a = np.concatenate([one_hot_q8_1(vals), F.quantize_q8_1(rng.standard_normal((3, 64), dtype=np.float32))[:, :1]])
    w = np.zeros((32, 1), F.block_q8_0)
    w["d"] = 0.0625
    for p in range(32):
        w["qs"][p, 0, p] = -(p + 1)
    c = _rows_in_chunks(name, a, w)
    ref = qgemm.reference.exact_w8a8(a, w)
    bad = np.argwhere(~np.isclose(c, ref, rtol=1e-6, atol=1e-6))
    assert bad.size == 0, f"{name}: first mismatches (A row, W row): {bad[:5].tolist()}"


@pytest.mark.parametrize("name", W4A8 + W8A8)
def test_wrong_weight_format_names_the_expected_one(name, rng):
    a = F.quantize_q8_1(rng.standard_normal((2, 64), dtype=np.float32))
    wrong = F.quantize_q8_0 if qgemm.get(name).op.w.name == "q4_0" else F.quantize_q4_0
    with pytest.raises(ValueError, match=qgemm.get(name).op.w.name):
        qgemm.get(name)(a, wrong(rng.standard_normal((3, 64), dtype=np.float32)))
    with pytest.raises(ValueError, match="q8_1"):
        qgemm.get(name)(rng.standard_normal((2, 64), dtype=np.float32), wrong(rng.standard_normal((3, 64), dtype=np.float32)))


@pytest.mark.parametrize("name", ["fp32.naive", "fp32.tiled"])
def test_fp32_kernels_take_any_k(name):
    """The FP32 rung has no blocks: any K (its stagers zero-fill past K), through check.validate
    and the CLI (whose K check once refused K = 33 for it)."""
    for shape in ((7, 9, 33), (65, 70, 1001), (1, 1, 1)):
        r = check.validate(qgemm.get(name), shape)
        assert r.passed, r
    from typer.testing import CliRunner

    from qgemm.cli import app

    res = CliRunner().invoke(app, ["validate", name, "--shape", "7x9x33"])
    assert res.exit_code == 0 and "PASS" in res.output, res.output


def test_vec_dp4a_misaligned_fallback(rng):
    """K = 96 (3 blocks: rows not 16-byte aligned) and K = 4128 (tail stage) use the fallback."""
    for k in (96, 4128):
        r = check.validate(qgemm.get("w4a8.vec_dp4a"), (33, 65, k))
        assert r.passed, r



# ------------------------------------------------------------------------------------------
# production path: qgemm.matmul, split-K, tuning

@pytest.mark.parametrize("k", [32, 4096])
@pytest.mark.parametrize("n", [1, 33, 4097])
@pytest.mark.parametrize("m", [1, 7, 33, 513])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_matmul_matches_references(fmt, m, n, k, rng):
    x = rng.standard_normal((m, k), dtype=np.float32)
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    w = F.quantize(w_f, fmt)
    c = qgemm.matmul(x, w)
    p = qgemm.plan(m, n, k, fmt)
    r = check.compare("matmul", p.op, (m, n, k), 0, c, p.reference(x, w), qgemm.reference.truth(x, w_f), x, w_f)
    assert r.passed, (p.kernel, r)


def test_matmul_f16_and_override(rng):
    x = rng.standard_normal((40, 256), dtype=np.float32).astype(np.float16)
    w = qgemm.quantize_q4_0(rng.standard_normal((70, 256), dtype=np.float32))
    for path in (None, "w4a8.tiled_dp4a", "w4a8.dp4a", "w4a8.mma", "w4a16.mma"):
        p = qgemm.plan(40, 70, 256, "q4_0", x_dtype="f16", path=path)
        np.testing.assert_allclose(qgemm.matmul(x, w, path=path), p.reference(x, w), rtol=1e-5, atol=1e-3, err_msg=str(path))


def test_matmul_device_tensors_torch(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    wq = qgemm.quantize_q8_0(rng.standard_normal((96, 512), dtype=np.float32))
    w = torch.from_numpy(wq.view(np.uint8).reshape(96, -1).copy()).cuda()
    for m in (3, 300):
        x = torch.randn(m, 512, device="cuda")
        out = torch.full((m, 96), float("nan"), device="cuda")
        assert qgemm.matmul(x, w, fmt="q8_0", out=out) is out
        torch.cuda.synchronize()
        exact = qgemm.plan(m, 96, 512, "q8_0").reference(x.cpu().numpy(), wq)
        np.testing.assert_allclose(out.cpu().numpy(), exact, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_matmul_leading_dimensions(fmt, rng):
    """x [..., K] runs as one GEMM of M = the product of its leading dimensions and returns
    [..., N], host and device (torch), with out= of that shape; 1-D x returns [N]."""
    n, k = 70, 256
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    wq = F.quantize(w_f, fmt)
    pw = qgemm.pack_weights(wq)
    for lead in ((3, 5, 7), (2, 300), (1,), ()):
        x = rng.standard_normal(lead + (k,), dtype=np.float32)
        m = int(np.prod(lead))
        exact = qgemm.plan(m, n, k, fmt).reference(x.reshape(m, k), wq).reshape(lead + (n,))
        c = qgemm.matmul(x, wq)
        assert c.shape == lead + (n,) and c.dtype == np.float32, lead
        np.testing.assert_allclose(c, exact, rtol=1e-5, atol=1e-3, err_msg=str(lead))
        p = qgemm.plan(m, n, k, fmt, packed=True)  # the packed paths (skinny, wgmma_rs), host in and out
        cp = qgemm.matmul(x, pw)
        assert cp.shape == lead + (n,), lead
        x2 = x.reshape(m, k)
        r = check.compare("matmul", p.op, (m, n, k), 0, cp.reshape(m, n), p.reference(x2, wq), qgemm.reference.truth(x2, w_f), x2, w_f)
        assert r.passed, (lead, p.kernel, r)
        dx, dw = qgemm.DeviceArray.from_host(x), qgemm.DeviceArray.from_host(wq)
        dc = qgemm.matmul(dx, dw)
        assert dc.shape == lead + (n,), lead
        np.testing.assert_allclose(dc.to_host(), exact, rtol=1e-5, atol=1e-3, err_msg=str(lead))
        out = qgemm.DeviceArray.empty(lead + (n,), np.float32)
        out.fill_bytes(0xFF)  # NaN: every element must be written
        assert qgemm.matmul(dx, dw, out=out) is out
        np.testing.assert_allclose(out.to_host(), exact, rtol=1e-5, atol=1e-3, err_msg=str(lead))
        with pytest.raises(ValueError, match="out must be float32"):
            qgemm.matmul(dx, dw, out=qgemm.DeviceArray.empty((m, n + 1), np.float32))
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    x = torch.randn(2, 9, k, device="cuda")
    w = torch.from_numpy(wq.view(np.uint8).reshape(n, -1).copy()).cuda()
    out = torch.full((2, 9, n), float("nan"), device="cuda")
    assert qgemm.matmul(x, w, fmt=fmt, out=out) is out
    torch.cuda.synchronize()
    exact = qgemm.plan(18, n, k, fmt).reference(x.cpu().numpy().reshape(18, k), wq).reshape(2, 9, n)
    np.testing.assert_allclose(out.cpu().numpy(), exact, rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match=r"out must be float32 \(2, 9, 70\)"):
        qgemm.matmul(x, w, fmt=fmt, out=torch.empty(18, n, device="cuda"))


@pytest.mark.parametrize("split", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("name", ["w4a8.mma", "w8a8.mma"])
def test_mma_configurations(name, split, rng):
    k = qgemm.get(name)
    for (m, n, kk) in ((70, 200, 1024), (33, 129, 96)):
        inp = check.make_inputs(k.op, m, n, kk, rng)
        exact = k.op.exact(inp.a, inp.w)
        for d in ({"MMA_BM": 64, "MMA_BN": 64, "MMA_WARPS_M": 2, "MMA_WARPS_N": 2, "MMA_STAGES": 3, "MMA_SPLITK": split},
                  {"MMA_BM": 32, "MMA_BN": 128, "MMA_WARPS_M": 2, "MMA_WARPS_N": 4, "MMA_STAGES": 4, "MMA_SPLITK": split}):
            da, dw = qgemm.DeviceArray.from_host(inp.a), qgemm.DeviceArray.from_host(inp.w)
            dc = qgemm.DeviceArray.empty((m, n), np.float32)
            dc.fill_bytes(0xFF)
            k.launch(da, dw, dc, m, n, kk, defines=d)
            out = dc.to_host()
            assert not np.isnan(out).any(), d
            np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-3, err_msg=str(d))


def test_tune_stores_and_matmul_uses_it(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from qgemm import tuning
    from qgemm.cli import app

    monkeypatch.setenv("QGEMM_CACHE_DIR", str(tmp_path))
    tuning.forget_cache()
    r = CliRunner().invoke(app, ["tune", "w4a8.gemv", "--shape", "3x1024x1024", "--iters", "3"])
    assert r.exit_code == 0, r.output
    assert "stored for w4a8.gemv" in r.output
    # the untuned default is timed beside the candidates and the summary compares the winner with it
    default = registry.spec("w4a8.gemv").config(3, 1024, 1024, runtime.device_info().sm_count)
    row = " ".join(f"{a}={b}" for a, b in default.items())
    assert any(line.startswith(row) and line.endswith("ok (default)") for line in r.output.splitlines()), r.output
    assert "the untuned default is the fastest" in r.output or f"default: {row}  " in r.output, r.output
    p = qgemm.plan(4, 1024, 1024, "q4_0")
    assert p.kernel == "w4a8.gemv" and p.source == "tuned"
    # a default outside the candidate list is timed too: with the candidates' K splits cut to 1, 2,
    # 4, 8 (as before they had the grid-sized ones), a 132-SM GPU's default here splits K 3 ways,
    # which no candidate then does
    monkeypatch.setattr(registry, "_tune_splits", lambda ctas, k: [1, 2, 4, 8])
    mma = registry.spec("w4a16.mma")
    default = mma.config(513, 1024, 8192, runtime.device_info().sm_count)
    only = ",".join(f"{a}={b}" for a, b in default.items() if a != "MMA_SPLITK")
    r = CliRunner().invoke(app, ["tune", "w4a16.mma", "--shape", "513x1024x8192", "--iters", "3", "--dry-run", "--only", only,
                                 "--json", str(tmp_path / "tune.json")])
    assert r.exit_code == 0, r.output
    row = " ".join(f"{a}={b}" for a, b in default.items())
    assert any(line.startswith(row) and line.endswith("ok (default)") for line in r.output.splitlines()), r.output
    # --json (session 54): every configuration the table shows, with its time and check, the default
    # (first, flagged) and the best, which is the fastest correct one
    got = json.loads((tmp_path / "tune.json").read_text())
    table = [line for line in r.output.splitlines() if line.startswith("MMA_")]
    assert got["kernel"] == "w4a16.mma" and got["shape"] == [513, 1024, 8192] and got["iters"] == 3
    # ("command" is the process's own command line: pytest's here, under CliRunner)
    assert got["environment"]["sm_count"] == runtime.device_info().sm_count and got["command"]
    assert len(got["candidates"]) == len(table) >= 2 and got["default"] == default
    assert got["candidates"][0]["default"] and got["candidates"][0]["config"] == default
    assert not any(c["default"] for c in got["candidates"][1:])
    ok = [c for c in got["candidates"] if c["check"] == "ok"]
    assert got["best_us"] == min(c["us"] for c in ok) and got["best"] in [c["config"] for c in ok]
    assert got["default_us"] == got["candidates"][0]["us"]
    tuning.path().write_text("garbage")
    tuning.forget_cache()
    with pytest.warns(RuntimeWarning):
        assert qgemm.plan(4, 1024, 1024, "q4_0").source == "default"
    tuning.forget_cache()


# ------------------------------------------------------------------------------------------
# DLPack in and out, caller streams

class _DLPackOnly:
    """Exposes only DLPack (no __cuda_array_interface__), to force that path."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, **kw):
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


def test_dlpack_inputs_outputs_and_streams(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    wq = qgemm.quantize_q4_0(rng.standard_normal((64, 256), dtype=np.float32))
    w = torch.from_numpy(wq.view(np.uint8).reshape(64, -1).copy()).cuda()
    x = torch.randn(5, 256, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        c = qgemm.matmul(_DLPackOnly(x), _DLPackOnly(w), fmt="q4_0", stream=torch.cuda.current_stream())
    s.synchronize()
    t = torch.from_dlpack(c)  # qgemm's result, wrapped without a copy
    assert t.data_ptr() == c.ptr and t.shape == (5, 64)
    np.testing.assert_allclose(t.cpu().numpy(), qgemm.plan(5, 64, 256, "q4_0").reference(x.cpu().numpy(), wq), rtol=1e-5, atol=1e-3)
    q = qgemm.get("quantize.q8_1")(_DLPackOnly(x))
    assert q.bytes_view().to_host().tobytes() == F.quantize_q8_1(x.cpu().numpy()).tobytes()
    with pytest.raises(BufferError, match="bytes_view"):
        torch.from_dlpack(q)
    with pytest.raises(ValueError, match="host array|both be host"):
        qgemm.matmul(x.cpu(), w, fmt="q4_0")


def test_cupy_dlpack_roundtrip(rng):
    cp = pytest.importorskip("cupy")
    x = cp.asarray(rng.standard_normal((4, 128), dtype=np.float32))
    w = cp.asarray(rng.standard_normal((8, 128), dtype=np.float32))
    c = qgemm.get("fp32.tiled")(_DLPackOnly(x), _DLPackOnly(w))
    y = cp.from_dlpack(c)
    np.testing.assert_allclose(cp.asnumpy(y), cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w).T, rtol=1e-5, atol=1e-4)


def test_validate_and_profile_on_gguf_weights(tmp_path):
    gguf = pytest.importorskip("gguf")
    from typer.testing import CliRunner

    from qgemm.cli import app

    rng = np.random.default_rng()
    path = tmp_path / "tiny.gguf"
    wr = gguf.GGUFWriter(str(path), "llama")
    for name, t, fmt in (("blk.0.ffn_down.weight", gguf.GGMLQuantizationType.Q4_0, "q4_0"),
                         ("blk.0.attn_q.weight", gguf.GGMLQuantizationType.Q8_0, "q8_0")):
        q = gguf.quants.quantize(rng.standard_normal((96, 512), dtype=np.float32), t)
        wr.add_tensor(name, q, raw_dtype=t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    r = CliRunner().invoke(app, ["validate", "w4a8.mma", "w4a16.mma", "w4a8.gemv", "--gguf", str(path),
                                 "--tensor", "blk.0.ffn_down.weight", "--m", "33"])
    assert r.exit_code == 0, r.output
    assert r.output.count("PASS") == 3 and "33x96x512" in r.output
    r = CliRunner().invoke(app, ["validate", "w8a8.mma", "--gguf", str(path), "--tensor", "blk.0.ffn_down.weight"])
    # refused before anything runs (cli._precheck): a usage error, as every input error of validate
    assert r.exit_code == 2 and "takes q8_0 weights; the GGUF tensor is q4_0" in r.output and "PASS" not in r.output
    r = CliRunner().invoke(app, ["profile", "w8a16.mma", "--gguf", str(path), "--tensor", "blk.0.attn_q.weight", "--m", "64",
                                 "--iters", "3", "--no-peers"])
    assert r.exit_code == 0 and "w8a16.mma" in r.output, r.output


def test_bench_cli_writes_what_it_shows(tmp_path, monkeypatch):
    """`qgemm bench` end to end on a small sweep, both suites: exit 0, the JSON's rows the ones
    asked for, with positive times, and the markdown file the table printed (session 47 moved the
    printing before the writing, so a failed write still shows the sweep)."""
    import json

    from typer.testing import CliRunner

    from qgemm import kvcache_bench
    from qgemm.cli import app

    out = tmp_path / "gemm"
    r = CliRunner().invoke(app, ["bench", "--m", "1,33", "--k", "4096", "--hot-only", "--no-peers", "--iters", "3",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "bench.json").read_text())
    assert sorted((row["fmt"], row["M"], row["N"], row["K"]) for row in data["rows"]) == \
        [("q4_0", 1, 4096, 4096), ("q4_0", 33, 4096, 4096), ("q8_0", 1, 4096, 4096), ("q8_0", 33, 4096, 4096)]
    assert all(row["matmul_us"] > 0 and row["kernel_us"] > 0 and not row["cold"] for row in data["rows"])
    assert (out / "bench.md").read_text().strip() in r.output
    # --n: another width (a multiple of nothing), with the torch peers
    out = tmp_path / "gemm-n"
    r = CliRunner().invoke(app, ["bench", "--m", "8", "--n", "1000", "--k", "4096", "--hot-only", "--iters", "3",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "bench.json").read_text())
    assert sorted((row["fmt"], row["M"], row["N"]) for row in data["rows"]) == [("q4_0", 8, 1000), ("q8_0", 8, 1000)]
    assert all(row["matmul_us"] > 0 and "torch_fp16_us" in row for row in data["rows"]), data["rows"]
    assert "| q4_0 | 8 | 1000 | 4096 |" in r.output
    real = kvcache_bench.suite  # the quick kvcache sweep cut to one S and two layouts
    monkeypatch.setattr(kvcache_bench, "suite", lambda **kw: real(**{**kw, "ss": (1024,), "layouts": kvcache_bench.LAYOUTS[1:3]}))
    out = tmp_path / "kv"
    r = CliRunner().invoke(app, ["bench", "--suite", "kvcache", "--quick", "--iters", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "kvcache.json").read_text())
    assert data["rows"] and {row["S"] for row in data["rows"]} == {1024}, data["rows"][:2]
    assert (out / "kvcache.md").read_text().strip() in r.output
    # the copy measured before and after the sweep, each row's share taken of the higher one
    before, after = data["copy_bandwidth_runs_gbps"]
    assert min(before, after) > 0 and data["copy_bandwidth_gbps"] == max(before, after)
    for row in data["rows"]:
        assert row["pct_copy"] == pytest.approx(100 * row["compressed_bytes"] / row["us"] / 1e3 / max(before, after))
    assert f"the higher of {before:.0f} before the sweep and {after:.0f} after it" in r.output


# ------------------------------------------------------------------------------------------
# skinny kernels (tokens on the MMA's N side, weights in the skinny layout) and packed matmul

SKINNY = ["w4a16.skinny", "w8a16.skinny"]


@pytest.mark.parametrize("name", SKINNY)
def test_skinny_every_candidate_configuration(name, rng):
    """Every configuration `qgemm tune` may pick, on shapes that are multiples of nothing: N not a
    multiple of 16, K of 5 and 129 blocks (groups of 4 padded), M across the 8-token fragments;
    and 2x100x4128, 7 tiles, where the candidates split K up to 8 ways (uneven parts)."""
    _every_candidate(qgemm.get(name), ((1, 33, 160), (9, 4097, 4128), (57, 47, 32), (2, 100, 4128)), rng)


def test_static_and_dynamic_shared_memory_past_48k(rng):
    """w4a16.skinny at M = 1 stages the activations in dynamic shared memory beside 8 KB of static
    (its reduction buffer): at K = 22016 the two together pass 48 KB while the dynamic part alone
    does not, so the launch must still opt in to more dynamic shared memory (it failed with
    CUDA_ERROR_INVALID_VALUE before). Without a K split: the default splits K 8 ways at this narrow
    N, which stages an eighth of the activations per CTA."""
    k = qgemm.get("w4a16.skinny")
    m, n, kk = 1, 64, 22016
    d = {**k.spec.config(m, n, kk, 132), "SK_GSPLIT": 1}
    assert k.spec.config(m, n, kk, 132)["SK_GSPLIT"] == 8
    dynamic = k.geometry(m, n, kk, d).shmem
    static = k.compile(defines=d).resources[k.spec.entry].smem_static
    assert dynamic <= 48 * 1024 < dynamic + static, (dynamic, static)
    inp = check.make_inputs(k.op, m, n, kk, rng)
    dc = qgemm.DeviceArray.empty((m, n), np.float32)
    dc.fill_bytes(0xFF)
    k.launch(k.upload_activations(inp.a), k.upload_weights(inp.w), dc, m, n, kk, defines=d)
    assert qgemm.reference.relative_error(dc.to_host(), k.op.exact(inp.a, inp.w)) <= 1e-5


SKINNY_I8 = ["w4a8.skinny", "w8a8.skinny"]


@pytest.mark.parametrize("name", SKINNY_I8)
def test_skinny_i8_every_candidate_configuration(name, rng):
    """The int8 decode kernels: every tunable configuration at 1, 3 and 8 tokens (SK_MQ 1, 4, 8),
    N not a multiple of 16, K of 5 and 129 blocks (a padded last group) and a long K split
    across CTAs; fresh inputs, poisoned outputs, exact-math reference (their own quantizer)."""
    _every_candidate(qgemm.get(name), ((1, 33, 160), (3, 47, 32), (8, 4097, 4128), (1, 100, 14336)), rng)


@pytest.mark.parametrize("name", SKINNY_I8)
def test_skinny_i8_activation_edges(name, rng):
    """Blocks the quantizer must not trip on: all zeros (d = 0), values below 2^-118 (q = 0 rather
    than 127 / amax = inf), exact ties (x * 127 / amax = k + 0.5: rounded to even), huge values (no half
    range to overflow: d stays float32); the kernel must match the exact reference bit for bit
    up to float summation order, and the result must be finite."""
    k = qgemm.get(name)
    fmt = k.op.w.name
    m, n, kk = 2, 64, 256
    x = rng.standard_normal((m, kk), dtype=np.float32)
    x[0, :32] = 0.0
    x[0, 32:64] = 1e-38
    x[1, :32] = np.arange(32, dtype=np.float32) - 15.5
    # amax 63.5: 127 / amax = 2 exactly, so x * 2 = k + 0.5 are exact ties, rounded to even (rint),
    # which rounding half away from zero would get wrong (row 0: row 1's 1e30 block would drown it)
    x[0, 64:96] = 0.0
    x[0, 64:73] = [63.5, 1.25, -1.25, 2.25, -2.25, 0.25, -0.25, 30.75, -30.75]
    x[1, 64:96] *= 1e30
    w = F.quantize(rng.standard_normal((n, kk), dtype=np.float32), fmt)
    out = k(x, w)
    ref = k.op.exact(x, w)
    assert np.isfinite(out).all()
    # row by row: row 1's 1e30 block would hide any error of row 0 in one relative error
    for r in range(m):
        assert qgemm.reference.relative_error(out[r], ref[r]) <= 1e-5, r
    # and through qgemm.matmul (path override: the default plan may pick the fp16 kernel)
    c = qgemm.matmul(x, qgemm.pack_weights(w), path=name)
    for r in range(m):
        assert qgemm.reference.relative_error(c[r], ref[r]) <= 1e-5, r


def test_skinny_i8_rejects_more_than_8_tokens(rng):
    w = qgemm.quantize_q8_0(rng.standard_normal((64, 256), dtype=np.float32))
    with pytest.raises(ValueError, match="M <= 8"):
        qgemm.matmul(rng.standard_normal((9, 256), dtype=np.float32), qgemm.pack_weights(w), path="w8a8.skinny")


SKINNY_Q8_1 = ["w4a8.skinny_q8_1", "w8a8.skinny_q8_1"]


@pytest.mark.parametrize("name", SKINNY_Q8_1)
def test_skinny_q8_1_every_candidate_configuration(name, rng):
    """The int8 small-batch kernels on Q8_1 activations: every tunable configuration at 1-32 tokens
    (one, two and four 8-token tiles, rows past M clamped), N not a multiple of 16, K of 1, 5 and
    129 blocks (a padded last group) and a long K split across CTAs; fresh inputs, poisoned outputs,
    llama.cpp's per-block math as the exact reference (exact_w4a8 / exact_w8a8)."""
    _every_candidate(qgemm.get(name), ((1, 33, 160), (3, 47, 32), (8, 4097, 4128), (13, 100, 14336), (32, 33, 160),
                                       (27, 257, 1024)), rng)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_skinny_q8_1_through_matmul(fmt, rng):
    """qgemm.matmul with path= the Q8_1 kernel: quantize.q8_1 (PDL) then the kernel, float32 and
    float16 activations, against the plan's exact reference and float64 truth; more than 32
    tokens is refused before anything launches."""
    name = SKINNY_Q8_1[fmt == "q8_0"]
    n, k = 300, 1056
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    w = F.quantize(w_f, fmt)
    pw = qgemm.pack_weights(w)
    for m in (2, 9, 32):
        x = rng.standard_normal((m, k), dtype=np.float32)
        for xx in (x, x.astype(np.float16)):
            p = qgemm.plan(m, n, k, fmt, "f32" if xx.dtype == np.float32 else "f16", path=name, packed=True)
            assert p.kernel == name and p.quantizer.startswith("quantize.q8_1"), p
            c = qgemm.matmul(xx, pw, path=name)
            r = check.compare("matmul", p.op, (m, n, k), 0, c, p.reference(xx, w), qgemm.reference.truth(xx, w_f), xx, w_f)
            assert r.passed, (m, xx.dtype, r)
    with pytest.raises(ValueError, match="M <= 32"):
        qgemm.matmul(rng.standard_normal((33, k), dtype=np.float32), pw, path=name)


def test_skinny_q8_1_one_quantization_two_matrices(rng):
    """What the Q8_1 kernels are for: x quantized once on the GPU (quantize.q8_1, device in and out),
    then multiplied by a Q4_0 and a Q8_0 matrix, each kernel called on the device arrays."""
    k = 1056
    x = rng.standard_normal((8, k), dtype=np.float32)
    dq = qgemm.get("quantize.q8_1")(qgemm.DeviceArray.from_host(x))
    assert dq.to_host().tobytes() == F.quantize_q8_1(x).tobytes()
    for name in SKINNY_Q8_1:
        k_obj = qgemm.get(name)
        w = F.quantize(rng.standard_normal((300, k), dtype=np.float32), k_obj.op.w.name)
        c = k_obj(dq, qgemm.pack_weights(w)).to_host()
        assert qgemm.reference.relative_error(c, k_obj.op.exact(F.quantize_q8_1(x), w)) <= 1e-5, name


def _every_candidate(k, shapes, rng):
    """Each configuration `qgemm tune` may pick, on fresh inputs per shape, poisoned output."""
    for (m, n, kk) in shapes:
        inp = check.make_inputs(k.op, m, n, kk, rng)
        exact = k.op.exact(inp.a, inp.w)
        da, dw = k.upload_activations(inp.a), k.upload_weights(inp.w)
        dc = qgemm.DeviceArray.empty((m, n), np.float32)
        for d in k.spec.candidates(m, n, kk):
            dc.fill_bytes(0xFF)
            k.launch(da, dw, dc, m, n, kk, defines=d)
            out = dc.to_host()
            assert not np.isnan(out).any(), (m, n, kk, d)
            r = qgemm.reference.relative_error(out, exact)
            assert r <= 1e-5, (m, n, kk, d, r)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("m", [1, 2, 8, 17, 32, 33, 129])
def test_matmul_packed_weights(fmt, m, rng):
    n, k = 4097, 4128
    x = rng.standard_normal((m, k), dtype=np.float32)
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    w = F.quantize(w_f, fmt)
    pw = qgemm.pack_weights(w)
    assert pw.fmt == fmt and pw.shape == w.shape and pw.pack_seconds > 0
    p = qgemm.plan(m, n, k, fmt, packed=True)
    hopper = qgemm.runtime.device_info().cc == 90
    wgmma = hopper and m >= qgemm.dispatch.WGMMA_MIN_M
    assert (".wgmma_rs" in p.kernel) == wgmma, p
    assert p.kernel.endswith(".skinny") == (m <= qgemm.dispatch.SKINNY_MAX_M and not wgmma), p
    c = qgemm.matmul(x, pw)  # host x: result on the host
    r = check.compare("matmul", p.op, (m, n, k), 0, c, p.reference(x, w), qgemm.reference.truth(x, w_f), x, w_f)
    assert r.passed, (p.kernel, r)
    dx = qgemm.DeviceArray.from_host(x)
    out = qgemm.DeviceArray.empty((m, n), np.float32)
    out.fill_bytes(0xFF)
    assert qgemm.matmul(dx, pw, out=out) is out
    # same kernels on the device path (split-K atomics may add in another order: not bitwise)
    np.testing.assert_allclose(out.to_host(), c, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_matmul_defaults_that_fill_the_gpu(fmt, rng):
    """Session 52's defaults, each where it fires: the prefill kernel with one MMA warpgroup where
    the 128 x 128 grid fills at most half the SMs (129x2050x4128: split 2) or spills into a short
    second wave (545x4100x4128), a 2-way K split where it spills at a long K (768x4100x8224, Q8_0 on
    its 256-token tiles); up to 32 tokens two MMA warpgroups split 5 where 64-row tiles fill the
    GPU's CTA slots badly (31x6150x4128, and at a long K for Q4_0); Q4_0's decode kernel at 2-8
    tokens of a long K with two tiles x 4 warps split 4 (5x4100x8224); session 53's K split by
    the waves it makes at a long K, 4 ways over a grid of 99 CTAs (301x4100x14368) and 3 over 81
    (1100x1030x14368), K's 449 blocks shared unevenly; session 54's: 3 ways at K = 6176
    (1100x1030x6176), two warpgroups split 3 over few tiles at K = 5152 (101x5130x5152), 64-token
    tiles below one wave (301x3080x7200); session 56's decode rules: narrow weights with a deeper
    split, Q4_0 8 warps (3x500x4128), Q8_0 two tiles per CTA (5x1000x4128), Q4_0 four tiles x 4
    warps at 9-16 tokens of a long K (16x2000x14368), and Q8_0 at 9-16 tokens whose 8-warp grid
    spills a wave: 4 warps, split 2 (13x4700x3616, where Q4_0 runs 4 warps split 3 since session
    61) or not (16x10250x8224); at one token of wide weights Q4_0's int8 kernel with 4 warps, Q8_0's with
    two tiles per CTA (1x6150x4128); session 57's at 2-8 tokens where the grid passes two CTAs
    per SM: Q4_0 8 warps, Q8_0 one accumulator set (4x6150x4128), and split 2 where one tile per
    CTA fills at most one CTA per SM (5x2050x4128). M, N and K multiples of no tile,
    packed weights and ggml blocks, fresh inputs, poisoned outputs, against the plan's exact math
    and float64 truth."""
    hopper = qgemm.runtime.device_info().cc == 90
    seen = set()
    for (m, n, k) in ((129, 2050, 4128), (545, 4100, 4128), (768, 4100, 8224), (31, 6150, 4128), (31, 6150, 8224),
                      (5, 4100, 8224), (301, 4100, 14368), (1100, 1030, 14368), (1100, 1030, 6176), (101, 5130, 5152),
                      (301, 3080, 7200), (3, 500, 4128), (5, 1000, 4128), (16, 2000, 14368), (13, 4700, 3616),
                      (16, 10250, 8224), (1, 6150, 4128), (4, 6150, 4128), (5, 2050, 4128)):
        w_f = rng.standard_normal((n, k), dtype=np.float32)
        w = F.quantize(w_f, fmt)
        x = rng.standard_normal((m, k), dtype=np.float32)
        for packed in (True, False):
            p = qgemm.plan(m, n, k, fmt, packed=packed)
            if p.kernel.endswith(".wgmma_rs"):
                seen.add((m, k, p.defines["RS_BN"], p.defines["RS_WGS"], p.defines["RS_SPLITK"]))
            if p.kernel.endswith(".skinny"):
                seen.add((m, k, p.defines["SK_R"], p.defines["SK_WARPS"], p.defines["SK_GSPLIT"], p.defines.get("SK_ACC", 0)))
            out = qgemm.DeviceArray.empty((m, n), np.float32)
            out.fill_bytes(0xFF)
            qgemm.matmul(qgemm.DeviceArray.from_host(x), qgemm.pack_weights(w) if packed else qgemm.DeviceArray.from_host(w), out=out)
            r = check.compare("matmul", p.op, (m, n, k), 0, out.to_host(), p.reference(x, w),
                              qgemm.reference.truth(x, w_f), x, w_f)
            assert r.passed, (p.kernel, p.defines, r)
    if hopper:
        assert {(129, 4128, 128, 1, 2), (545, 4128, 128, 1, 1), (31, 4128, 64, 2, 5)} <= seen, seen
        q4 = fmt == "q4_0"
        assert (768, 8224, 128, 2, 2) in seen if q4 else (768, 8224, 256, 1, 2) in seen, seen
        assert (31, 8224, 64, 2, 5) in seen if q4 else (31, 8224, 64, 1, 2) in seen, seen
        assert (5, 8224, 2, 4, 4, 2) in seen if q4 else (5, 8224, 2, 8, 2, 1) in seen, seen
        assert {(301, 14368, 128, 2, 4), (1100, 14368, 128, 2, 3)} <= seen, seen
        assert {(1100, 6176, 128, 2, 3), (101, 5152, 128, 2, 3), (301, 7200, 64, 2, 1)} <= seen, seen
        if q4:
            assert {(3, 4128, 1, 8, 8, 1), (16, 14368, 4, 4, 4, 1), (13, 3616, 2, 4, 3, 1), (1, 4128, 1, 4, 1, 0)} <= seen, seen
        else:
            assert {(5, 4128, 2, 8, 8, 1), (13, 3616, 2, 4, 2, 1), (16, 8224, 2, 4, 1, 1), (1, 4128, 2, 8, 1, 0)} <= seen, seen
        assert (4, 4128, 1, 8, 1, 1) in seen and (5, 4128, 1, 16 if q4 else 8, 2, 1 if q4 else 2) in seen, seen


def _packed_decode_default_runs_right(fmt, m, n, k, xd, want, rng):
    """qgemm.matmul at (m, n, k) on packed `fmt` weights and x of type `xd` (fresh inputs, a poisoned
    output), against the plan's exact math and float64 truth; on a 132-SM Hopper, where the decode
    rules were measured, the plan's #defines named in `want` first (None: not set)."""
    info = runtime.device_info()
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    w = F.quantize(w_f, fmt)
    x = rng.standard_normal((m, k), dtype=np.float32)
    if xd != "f32":
        x = F.from_float32(x, F.get_format(xd))
    x32 = x if xd == "f32" else F.to_float32(x)
    p = qgemm.plan(m, n, k, fmt, x_dtype=xd, packed=True)
    if info.cc == 90 and info.sm_count == 132:
        assert {key: p.defines.get(key) for key in want} == want, p
    out = qgemm.DeviceArray.empty((m, n), np.float32)
    out.fill_bytes(0xFF)
    qgemm.matmul(qgemm.DeviceArray.from_host(x), qgemm.pack_weights(w), out=out)
    r = check.compare("matmul", p.op, (m, n, k), 0, out.to_host(), p.reference(x, w),
                      qgemm.reference.truth(x32, w_f), x32, w_f)
    assert r.passed, (p.kernel, p.defines, r)


def _two_tile_decode_defaults_run_right(fmt, cases, rng):
    """`_packed_decode_default_runs_right` over `cases` {(m, n, k, x type): (SK_WARPS, SK_GSPLIT[,
    SK_ACC])}: the decode kernel's two-tile CTAs at 9-16 tokens (one accumulator set unless named)."""
    if runtime.device_info().cc < 80:
        pytest.skip("the skinny kernels need sm_80")
    for (m, n, k, xd), (warps, split, *acc) in cases.items():
        want = {"SK_R": 2, "SK_MT": 2, "SK_WARPS": warps, "SK_UNROLL": 1, "SK_ACC": acc[0] if acc else 1, "SK_GSPLIT": split}
        _packed_decode_default_runs_right(fmt, m, n, k, xd, want, rng)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("xd", ["f32", "f16", "bf16"])
def test_decode_defaults_on_wide_weights(fmt, xd, rng):
    """Session 58's decode rules at 2-8 tokens on weights wider than session 57's windows, where
    they fire on a 132-SM Hopper: 4-warp CTAs whose grid fills one wave -- Q4_0 one tile per CTA
    (3x13530x4128: 846 tiles), two (5x17000x3616: 1063) or four (7x22010x4128: 1376), Q8_0 two
    (2x13530x4128, 8x16890x3616: 1056 tiles; float16 x not staged in shared memory there) -- and
    the float32 Q8_0 kernel's lighter CTA at 5-8 tokens past four tiles per SM (6x11010x4128; the
    16-bit variants keep two load groups and two accumulator sets). N and K multiples of no tile,
    fresh inputs, poisoned outputs, against the plan's exact math and float64 truth."""
    info = runtime.device_info()
    if info.cc < 80:
        pytest.skip("the skinny kernels need sm_80")
    q4 = fmt == "q4_0"
    cases = ({(3, 13530, 4128): (1, 4, 1, 1), (5, 17000, 3616): (2, 4, 1, 1), (7, 22010, 4128): (4, 4, 1, 1)} if q4 else
             {(2, 13530, 4128): (2, 4, 1, 1), (8, 16890, 3616): (2, 4, 1, 1),
              (6, 11010, 4128): (1, 8, 1, 1) if xd == "f32" else (1, 8, 2, 2)})
    for (m, n, k), want in cases.items():
        want = {**dict(zip(("SK_R", "SK_WARPS", "SK_UNROLL", "SK_ACC"), want)), "SK_XSMEM": 0, "SK_GSPLIT": 1}
        _packed_decode_default_runs_right(fmt, m, n, k, xd, want, rng)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_decode_ladder_defaults_on_wide_weights(fmt, rng):
    """Session 59's decode defaults on wide weights below K = 8192, where they fire on a 132-SM
    Hopper, one activation type each. The 2-8-token ladder: Q4_0 one tile of two load groups
    (3x9000x4128: 563 tiles), the same compiled for six CTAs per SM (6x11010x4128: 689; float16 x),
    one group from 75% of its wave (8x12700x3616: 794; bfloat16 x) and 8 warps past the ladder
    (2x25400x4128: 1588); Q8_0 one tile of two groups and two sets (4x7000x4128: 438; 8x8000x3616:
    500, bfloat16 x), the two-tile rung from 75% (5x12660x4128: 792 tiles, 396 CTAs) and float16 x
    at two tokens keeping its staged 8-warp CTA (2x7000x4128). At 9-16 tokens Q4_0's two-tile CTA of
    4 warps (13x11010x4128: 689 tiles, float16 x). N and K multiples of no tile, fresh
    inputs, poisoned outputs, against the plan's exact math and float64 truth."""
    info = runtime.device_info()
    if info.cc < 80:
        pytest.skip("the skinny kernels need sm_80")
    # (m, n, k, x type): (SK_R, SK_WARPS, SK_UNROLL, SK_ACC, SK_XSMEM, SK_MINB)
    cases = ({(3, 9000, 4128, "f32"): (1, 4, 2, 1, 0, None), (6, 11010, 4128, "f16"): (1, 4, 2, 1, 0, 6),
              (8, 12700, 3616, "bf16"): (1, 4, 1, 1, 0, None), (2, 25400, 4128, "f32"): (1, 8, 1, 1, 0, None),
              (13, 11010, 4128, "f16"): (2, 4, 1, 1, 0, None)}
             if fmt == "q4_0" else
             {(4, 7000, 4128, "f32"): (1, 4, 2, 2, 0, None), (8, 8000, 3616, "bf16"): (1, 4, 2, 2, 0, None),
              (5, 12660, 4128, "f32"): (2, 4, 1, 1, 0, None), (2, 7000, 4128, "f16"): (1, 8, 1, 1, 1, None)})
    for (m, n, k, xd), want in cases.items():
        want = {**dict(zip(("SK_R", "SK_WARPS", "SK_UNROLL", "SK_ACC", "SK_XSMEM", "SK_MINB"), want)), "SK_GSPLIT": 1}
        _packed_decode_default_runs_right(fmt, m, n, k, xd, want, rng)


def test_decode_q4_0_long_k_splits(rng):
    """Session 60's Q4_0 default at 9-16 tokens of a long K, where it fires on a 132-SM Hopper:
    two-tile CTAs of 4 warps with the K split that makes the fewest waves per unit of a warp's work
    -- split 3 (14x5000x14368: 157 CTAs unsplit; 16x5100x8224: 160; 11x10230x8224: 320), 2
    (13x7000x8224: 219) and none (9x14300x8224: 447) -- over the three activation types; 8 warps
    unsplit where they cost less (12x20000x8224: 625). N and K multiples of no tile (K = 8224: 257
    blocks, the last group of four holding one), fresh inputs, poisoned outputs, against the plan's
    exact math and float64 truth."""
    _two_tile_decode_defaults_run_right("q4_0", {
        (14, 5000, 14368, "f16"): (4, 3), (16, 5100, 8224, "f32"): (4, 3), (11, 10230, 8224, "bf16"): (4, 3),
        (13, 7000, 8224, "f32"): (4, 2), (9, 14300, 8224, "f16"): (4, 1), (12, 20000, 8224, "f32"): (8, 1)}, rng)


def test_decode_q4_0_short_k_splits(rng):
    """Session 61's Q4_0 defaults at 9-16 tokens below K = 8192, where they fire on a 132-SM Hopper:
    two-tile CTAs of 4 warps split 3 where the 8-warp grid passes the SMs and costs more
    (14x5000x4128: 157 CTAs unsplit; 16x4300x3104: 135, K just past the rule's 3072; 11x9000x5152:
    282; 9x10950x4128: 343, the last before session 59's 4 warps unsplit), split 4 within the SMs
    where that grid fills at most 91% of its slots (12x2200x4128: 69 CTAs; 10x3000x3104: 94;
    16x3500x3616: 110) -- over the three activation types; 8 warps unsplit at a tie (13x6000x4128:
    188), at a short K (15x5000x2080) and within the SMs past that share, with two accumulator sets
    (16x3900x4128: 122). N and K multiples of no tile, fresh inputs, poisoned outputs, against the
    plan's exact math and float64 truth."""
    _two_tile_decode_defaults_run_right("q4_0", {
        (14, 5000, 4128, "f16"): (4, 3), (16, 4300, 3104, "f32"): (4, 3), (11, 9000, 5152, "bf16"): (4, 3),
        (9, 10950, 4128, "f32"): (4, 3), (13, 6000, 4128, "f32"): (8, 1), (15, 5000, 2080, "f16"): (8, 1),
        (12, 2200, 4128, "f32"): (4, 4), (10, 3000, 3104, "bf16"): (4, 4), (16, 3500, 3616, "f16"): (4, 4),
        (16, 3900, 4128, "f32"): (8, 1, 2)}, rng)


def test_decode_q8_0_split_on_four_warps(rng):
    """Session 61's Q8_0 default at 9-16 tokens from K = 6144, where it fires on a 132-SM Hopper:
    two-tile CTAs of 4 warps (three per SM) in place of the 8-warp grid unsplit -- split 4
    (16x2600x8224: 82 CTAs), 3 (14x4100x14368: 129; 9x3500x18976: 110; 11x8000x6176: 250, K just
    past the rule's 6144) -- over the three activation types; session 56's 4 warps split 2 where
    they were (13x6100x8224: 191) and 8 warps unsplit below K = 6144 (15x4100x6112). N and K
    multiples of no tile, fresh inputs, poisoned outputs, against the plan's exact math and float64
    truth."""
    _two_tile_decode_defaults_run_right("q8_0", {
        (14, 4100, 14368, "f16"): (4, 3), (16, 2600, 8224, "f32"): (4, 4), (11, 8000, 6176, "bf16"): (4, 3),
        (9, 3500, 18976, "f32"): (4, 3), (13, 6100, 8224, "f32"): (4, 2), (15, 4100, 6112, "f16"): (8, 1)}, rng)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("x_dtype", [np.float32, np.float16])
def test_matmul_narrow_weights_split_k(fmt, x_dtype, rng):
    """Decode and small batches on narrow weights (N <= 2048: grouped-query attention's k / v
    projections), where the default splits K across CTAs to fill the GPU (up to 8 ways; the
    16-bit-activation variants by rules of their own; Q4_0 at one token two tiles x 16 warps), and
    the ggml-blocks GEMV there with 8 warps: every token count the decode kernels take, N and K
    multiples of nothing, fresh inputs, poisoned outputs, against the plan's exact math and
    float64 truth."""
    hopper = qgemm.runtime.device_info().cc == 90
    seen = set()
    for (n, k) in ((500, 4128), (1000, 14368), (2000, 4128)):
        w_f = rng.standard_normal((n, k), dtype=np.float32)
        w = F.quantize(w_f, fmt)
        pw = qgemm.pack_weights(w)
        for m, packed in itertools.product((1, 2, 3, 8, 9, 16), (True, False)):
            p = qgemm.plan(m, n, k, fmt, packed=packed, x_dtype=x_dtype)
            if not p.kernel.split(".")[1].startswith(("skinny", "gemv")):
                continue
            seen.add(p.defines.get("SK_GSPLIT", f"{p.defines.get('GEMV_WARPS')} warps"))
            x = rng.standard_normal((m, k), dtype=np.float32).astype(x_dtype)
            out = qgemm.DeviceArray.empty((m, n), np.float32)
            out.fill_bytes(0xFF)
            qgemm.matmul(qgemm.DeviceArray.from_host(x), pw if packed else qgemm.DeviceArray.from_host(w), out=out)
            c = out.to_host()
            r = check.compare("matmul", p.op, (m, n, k), 0, c, p.reference(x, w), qgemm.reference.truth(x.astype(np.float32), w_f),
                              x, w_f)
            assert r.passed, (p.kernel, p.defines, r)
    if hopper:  # the decode kernels run up to 16 tokens there; the split took 2, 4 and 8
        assert {2, 4, 8, "8 warps"} <= seen, seen


def test_skinny_needs_packed_weights_and_its_activation_type(rng):
    w = qgemm.quantize_q4_0(rng.standard_normal((64, 256), dtype=np.float32))
    x = rng.standard_normal((4, 256), dtype=np.float32)
    pw = qgemm.pack_weights(w)
    # path= a skinny kernel with ggml blocks: repacked on the GPU on every call
    p = qgemm.plan(4, 64, 256, "q4_0", path="w4a16.skinny")
    assert p.repack == "pack.q4_0" and p.packed
    np.testing.assert_array_equal(qgemm.matmul(x, w, path="w4a16.skinny"), qgemm.matmul(x, pw, path="w4a16.skinny"))
    with pytest.raises(ValueError, match="reads float32 activations itself, got float16 \\(its float16 variant is w4a16.skinny_f16\\)"):
        qgemm.matmul(x.astype(np.float16), pw, path="w4a16.skinny")
    with pytest.raises(ValueError, match="q8_0"):
        qgemm.get("w8a16.skinny")(qgemm.DeviceArray.from_host(x), pw)
    # the kernel object itself takes ggml blocks (it packs them) and PackedWeights alike
    k = qgemm.get("w4a16.skinny")
    np.testing.assert_array_equal(k(x, w), k(qgemm.DeviceArray.from_host(x), pw).to_host())
    # fp16 activations with packed weights: the variant reading them (tests/test_gpu_half_activations.py)
    c16 = qgemm.matmul(x.astype(np.float16), pw)
    p16 = qgemm.plan(4, 64, 256, "q4_0", "f16", packed=True)
    assert p16.kernel == "w4a16.skinny_f16" and c16.shape == (4, 64)
    assert qgemm.reference.relative_error(c16, p16.reference(x.astype(np.float16), w)) <= 1e-5


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_kperm16_activation_paths(fmt, rng):
    """The wgmma_rs kernels read their activations in the kperm16 layout. Every way in must put
    them there: qgemm.matmul with float32 x (convert.f16k) and with float16 x (convert.f16k_f16),
    host and device; the kernel object with host fp16 (permuted on the host) and with device fp16
    -- including a buffer that starts 2 bytes off a 16-byte boundary (permuted on the GPU)."""
    w_ = "4" if fmt == "q4_0" else "8"
    m, n, k = 40, 300, 4128
    x = rng.standard_normal((m, k), dtype=np.float32)
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    w = F.quantize(w_f, fmt)
    pw = qgemm.pack_weights(w)
    name = f"w{w_}a16.wgmma_rs"
    # the prologue kernels alone: K a multiple of 16 (not 32), a warp only partly running (18
    # threads), byte for byte against the CPU layout; any other K is refused
    x48 = rng.standard_normal((3, 48), dtype=np.float32)
    np.testing.assert_array_equal(qgemm.get("convert.f16k")(x48), packing.kperm16(x48.astype(np.float16)))
    np.testing.assert_array_equal(qgemm.get("convert.f16k_f16")(x48.astype(np.float16)), packing.kperm16(x48.astype(np.float16)))
    raw48 = qgemm.DeviceArray.empty((3 * 48 + 8,), np.float16)
    out48 = qgemm.DeviceArray(raw48.ptr + 2, (3, 48), np.float16, owner=raw48)  # an out= only 2-byte aligned
    qgemm.get("convert.f16k")(qgemm.DeviceArray.from_host(x48), out=out48)
    np.testing.assert_array_equal(out48.to_host(), packing.kperm16(x48.astype(np.float16)))
    with pytest.raises(ValueError, match="multiple of 16"):
        qgemm.get("convert.f16k")(rng.standard_normal((2, 40), dtype=np.float32))
    kern = qgemm.get(name)
    if qgemm.runtime.device_info().cc != 90:
        with pytest.raises(qgemm.UnsupportedArchError, match="sm_90"):
            kern(x.astype(np.float16), w)
        return
    exact = kern.op.exact(x.astype(np.float16), w)
    for xx in (x, x.astype(np.float16)):
        p = qgemm.plan(m, n, k, fmt, "f32" if xx.dtype == np.float32 else "f16", packed=True)
        assert p.kernel == name and p.quantizer == ("convert.f16k" if xx.dtype == np.float32 else "convert.f16k_f16"), p
        for c in (qgemm.matmul(xx, pw), qgemm.matmul(qgemm.DeviceArray.from_host(xx), pw).to_host()):
            assert qgemm.reference.relative_error(c, p.reference(xx, w)) <= 1e-5
            assert qgemm.reference.relative_error(c, exact) <= 1e-5
    x16 = x.astype(np.float16)
    assert qgemm.reference.relative_error(kern(x16, w), exact) <= 1e-5
    raw = qgemm.DeviceArray.empty((m * k + 8,), np.float16)
    off = qgemm.DeviceArray(raw.ptr + 2, (m, k), np.float16, owner=raw)  # 2 bytes past the allocation's alignment
    assert off.ptr % 16 == 2
    off.copy_from_host(x16)
    assert qgemm.reference.relative_error(kern(off, pw).to_host(), exact) <= 1e-5


WGMMA = ["w4a16.wgmma", "w8a16.wgmma", "w4a16.wgmma_rs", "w8a16.wgmma_rs"]


@pytest.mark.parametrize("name", WGMMA)
def test_wgmma_configurations(name, rng):
    """Every configuration (stages, split-K, warp specialization) on shapes that are multiples of
    nothing: M and N across partial 128-tiles, K with a partial last group (K = 4128: 129 blocks)
    and a single block; and N = 1000 (a multiple of 4 but not of 64: wgmma_rs's split-K end adds
    4 columns per vector reduction there, the odd N take its scalar path); and 200x1500x4128, whose
    24 tiles of 128 weight rows get the 5-way K split that fills 132 SMs (33 stages of 128 K: uneven
    parts)."""
    k = qgemm.get(name)
    if qgemm.runtime.device_info().cc != 90:
        with pytest.raises(qgemm.UnsupportedArchError, match="sm_90"):
            k._module()
        return
    _every_candidate(k, ((129, 4097, 4128), (7, 33, 32), (300, 257, 1024), (65, 1000, 2080), (200, 1500, 4128)), rng)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_wgmma_rs_evict_first_weights(fmt, rng):
    """RS_WEF changes only the L2 policy of the weight copies: with and without it the kernel's
    output is the same to the bit, on a shape that is a multiple of nothing; and qgemm.matmul
    turns it on where qgemm.registry._rs_wef says (Q8_0 at 385x4097x4128: 16 MB of activations and
    output, 34 MB with the weights) and gets the exact reference's answer there."""
    name = f"w{'4' if fmt == 'q4_0' else '8'}a16.wgmma_rs"
    k = qgemm.get(name)
    if qgemm.runtime.device_info().cc != 90:
        with pytest.raises(qgemm.UnsupportedArchError, match="sm_90"):
            k._module()
        return
    m, n, kk = 385, 4097, 4128
    inp = check.make_inputs(k.op, m, n, kk, rng)
    exact = k.op.exact(inp.a, inp.w)
    da, dw = k.upload_activations(inp.a), k.upload_weights(inp.w)
    dc = qgemm.DeviceArray.empty((m, n), np.float32)
    outs = []
    for wef in (0, 1):
        dc.fill_bytes(0xFF)
        k.launch(da, dw, dc, m, n, kk, defines={**k.spec.config(m, n, kk, 132), "RS_WEF": wef})
        outs.append(dc.to_host())
        assert qgemm.reference.relative_error(outs[-1], exact) <= 1e-5, wef
    np.testing.assert_array_equal(outs[0], outs[1])
    x = rng.standard_normal((m, kk), dtype=np.float32)
    w = F.quantize(rng.standard_normal((n, kk), dtype=np.float32), fmt)
    p = qgemm.plan(m, n, kk, fmt, packed=True)
    assert p.kernel == name and p.defines["RS_WEF"] == (1 if fmt == "q8_0" else 0), p
    c = qgemm.matmul(x, qgemm.pack_weights(w))
    assert qgemm.reference.relative_error(c, p.reference(x, w)) <= 1e-5


def _pdl_chain(x, ws, n, monkeypatch, pdl_launches, fmts=None):
    """x through the weights ws by qgemm.matmul, ping-pong between two device buffers (each op reads
    the previous one's output and overwrites what the op before it read; the second buffer starts
    NaN-poisoned): once one op at a time with PDL off, once queued without a sync with PDL on.
    fmts: the weights' formats where they are raw device blocks. -> (want, got) on the host."""
    m = x.shape[0]

    def chain(sync_each: bool):
        a = qgemm.DeviceArray.from_host(x)
        b = qgemm.DeviceArray.empty((m, n), np.float32)
        b.fill_bytes(0xFF)  # NaN: an op that reads its input too early sees these
        for i, w in enumerate(ws):
            qgemm.matmul(a, w, fmt=None if fmts is None else fmts[i], out=b)
            if sync_each:
                qgemm.runtime.synchronize()
            a, b = b, a
        return a.to_host()

    monkeypatch.setenv("QGEMM_PDL", "0")
    want = chain(sync_each=True)
    monkeypatch.setenv("QGEMM_PDL", "1")
    del pdl_launches[:]  # the PDL-off chain's launches do not count
    got = chain(sync_each=False)
    assert np.isfinite(want).all() and np.abs(want).mean() > 0.1
    # the PDL-off chain itself against float64 ground truth through the dequantized weights, at the
    # activations' quantization level (a chain in which no kernel wrote anything returns x)
    y = x.astype(np.float64)
    for i, w in enumerate(ws):
        blocks = (w.blocks if isinstance(w, qgemm.PackedWeights) else w).to_host()
        y = qgemm.reference.truth(y, F.dequantize(blocks, w.fmt if fmts is None else fmts[i]))
    assert qgemm.reference.relative_error(want, y) <= 0.05, qgemm.reference.relative_error(want, y)
    pdl_launches.check()
    return want, got


@pytest.mark.parametrize("m", [1, 8, 33, 300])
def test_matmul_chain_with_programmatic_dependent_launch(m, rng, monkeypatch, pdl_launches):
    """A chain of ops queued without a sync, each reading the previous one's output and writing
    the buffer the op before it read (ping-pong): with programmatic dependent launch (sm_90) a
    kernel starts while the previous one finishes, so a missing or misplaced pdl_wait() shows up
    here as stale, NaN-poisoned or overwritten inputs. Checked against the same chain run one op at
    a time with PDL off. The weights alternate Q4_0 / Q8_0, so different kernels follow each other."""
    n = k = 2048
    ws = []
    for i in range(6):
        w_f = rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k))  # keeps |y| ~ |x|
        ws.append(qgemm.pack_weights(F.quantize(w_f, "q4_0" if i % 2 == 0 else "q8_0")))
    x = rng.standard_normal((m, k), dtype=np.float32)
    want, got = _pdl_chain(x, ws, n, monkeypatch, pdl_launches)
    plans = [qgemm.plan(m, n, k, pw.fmt, packed=True) for pw in ws[:2]]
    split_k = any(registry.get(p.kernel).geometry(m, n, k, p.defines or registry.get(p.kernel).config_for(m, n, k)).zero_output
                  for p in plans)
    if not split_k:  # the same kernels on the same inputs: bit for bit
        np.testing.assert_array_equal(got, want)
    else:
        # split-K adds its partial sums with atomics in any order (~1e-7), which flips the fp16
        # rounding of a few of the next op's activations (one ulp, ~5e-4 of that value): ~1e-4 after
        # six ops. A race reads NaN poison or another op's values: O(1).
        assert np.isfinite(got).all() and qgemm.reference.relative_error(got, want) <= 2e-3


def test_split_skinny_chain_zeroes_with_a_kernel(rng, monkeypatch, pdl_launches):
    """The skinny kernels split K across CTAs from 2 tokens at K >= 8192 (SK_GSPLIT=2): C is zeroed
    by their module's qgemm_zero_output, PDL-launched, which releases the GEMM at entry. In a
    ping-pong chain the zero kernel of op i clears the buffer op i-1 reads, and op i's atomics add
    into it: a zero kernel that did not wait for op i-1 starves it of its input (zeros), a GEMM
    that did not wait for the zero kernel adds into stale values. Against the chain run one op at
    a time with PDL off (atomics in any order: a few fp16 roundings of the next input differ);
    2 and 16 tokens (one and two 8-token MMA tiles)."""
    n = k = 8192
    ws = []
    for i in range(4):
        w_f = rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k))
        ws.append(qgemm.pack_weights(F.quantize(w_f, "q4_0" if i % 2 == 0 else "q8_0")))
    entries = []
    real = qgemm.runtime.LoadedKernel.launch

    def spy(self, entry, *args, **kw):
        entries.append(entry)
        return real(self, entry, *args, **kw)

    monkeypatch.setattr(qgemm.runtime.LoadedKernel, "launch", spy)
    for m in (2, 16):
        splits = 0
        for pw in ws:
            p = qgemm.plan(m, n, k, pw.fmt, packed=True)
            if ".skinny" not in p.kernel:
                pytest.skip(f"{p.kernel} runs {m}x{n}x{k} on this GPU, not a skinny kernel")
            assert p.quantizer is None, p
            splits += p.defines["SK_GSPLIT"] > 1
        assert splits >= len(ws) // 2, m  # Q4_0 splits at both token counts, Q8_0 at 2 tokens only
        del entries[:]
        want, got = _pdl_chain(rng.standard_normal((m, k), dtype=np.float32), ws, n, monkeypatch, pdl_launches)
        assert entries.count(qgemm.ops.ZERO_ENTRY) == 2 * splits, entries  # each split op of both chains
        assert np.isfinite(got).all() and qgemm.reference.relative_error(got, want) <= 2e-3, m


@pytest.mark.parametrize("name", ["w4a8.gemv", "w8a8.gemv"])
def test_gemv_defaults_every_token_count(name, rng):
    """The blocks-path GEMV's default configuration at every M it takes (8 or 16 warps, 4 or 8
    iterations in flight, 128- or 512-block chunks, early loads: qgemm.registry._gemv_config) on an
    odd N, with one chunk and with several (K = 16416: 513 blocks, a last chunk of one block at
    512 per chunk), poisoned output, against the exact reference."""
    k_obj = qgemm.get(name)
    for kk in (4128, 16416):
        w = F.quantize(rng.standard_normal((4097, kk), dtype=np.float32), k_obj.op.w.name)
        dw = k_obj.upload_weights(w)
        for m in range(1, 9):
            a = F.quantize_q8_1(rng.standard_normal((m, kk), dtype=np.float32))
            dc = qgemm.DeviceArray.empty((m, 4097), np.float32)
            dc.fill_bytes(0xFF)
            k_obj.launch(k_obj.upload_activations(a), dw, dc, m, 4097, kk)
            out = dc.to_host()
            assert not np.isnan(out).any(), (m, kk)
            assert qgemm.reference.relative_error(out, k_obj.op.exact(a, w)) <= 1e-5, (m, kk, k_obj.config_for(m, 4097, kk))


@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_gemv_chain_with_programmatic_dependent_launch(m, rng, monkeypatch, pdl_launches):
    """The decode path on ggml blocks (quantize.q8_1 + w4a8/w8a8.gemv) in a ping-pong chain queued
    without a sync: up to 4 tokens the GEMV is launched with PDL (GEMV_PDL) and requests its first
    weights before waiting for the quantizer (GEMV_EARLY), so a wait placed after the staging
    would read stale or NaN-poisoned activations. Bit for bit the chain run one op at a time with
    PDL off."""
    n = k = 2048
    fmts = ["q4_0" if i % 2 == 0 else "q8_0" for i in range(6)]
    ws = [qgemm.DeviceArray.from_host(F.quantize(rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)), f))
          for f in fmts]  # / sqrt(k) keeps |y| ~ |x| along the chain
    for fmt in fmts[:2]:
        p = qgemm.plan(m, n, k, fmt)
        assert p.kernel.endswith(".gemv") and p.quantizer == "quantize.q8_1", p
        assert p.defines["GEMV_PDL"] == p.defines["GEMV_EARLY"] == (1 if m <= 4 else 0), p.defines
    want, got = _pdl_chain(rng.standard_normal((m, k), dtype=np.float32), ws, n, monkeypatch, pdl_launches, fmts)
    np.testing.assert_array_equal(got, want)


def test_matmul_overflow_and_two_streams(rng):
    """A host call whose activations overflow the path's GPU format raises (float16 prologue: a
    value beyond 65504; Q8_1: a block sum); ops queued on two streams at once, each with its own
    staging buffer, both come out right."""
    n, k = 300, 256
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    w = F.quantize(w_f, "q4_0")
    for m in (4, 40):  # quantize.q8_1 + GEMV / convert.f16 + fp16 tensor cores
        x = rng.standard_normal((m, k), dtype=np.float32)
        x[m // 2, :32] = 60000.0 if m <= qgemm.dispatch.GEMV_MAX_M else 1e6
        with pytest.raises(ValueError, match="overflow"):
            qgemm.matmul(x, w)
    pw = qgemm.pack_weights(w)
    # packed weights: the skinny kernel (M = 4) rounds x to float16 itself, with no prologue to flag it
    x = rng.standard_normal((4, k), dtype=np.float32)
    x[1, 7] = 65519.0  # rounds to 65504: fine
    assert np.isfinite(qgemm.matmul(x, pw)).all()
    x[1, 7] = -65520.0  # rounds to -inf
    if qgemm.plan(4, n, k, "q4_0", packed=True).quantizer is None:  # the skinny kernel (sm_80+)
        with pytest.raises(ValueError, match="overflow.*w4a16.skinny rounds them to float16"):
            qgemm.matmul(x, pw)
    # one token: the int8 kernel quantizes x with a float32 scale per block: no half range to overflow
    x1 = rng.standard_normal((1, k), dtype=np.float32)
    x1[0, :32] *= 1e6
    p1 = qgemm.plan(1, n, k, "q4_0", packed=True)
    c1 = qgemm.matmul(x1, pw)
    assert np.isfinite(c1).all() and qgemm.reference.relative_error(c1, p1.reference(x1, w)) <= 1e-5
    m = 600
    s1, s2 = qgemm.runtime.create_stream(), qgemm.runtime.create_stream()
    xs = [rng.standard_normal((m, k), dtype=np.float32) for _ in range(4)]
    dxs = [qgemm.DeviceArray.from_host(x) for x in xs]
    outs = [qgemm.matmul(dx, pw, stream=(s1, s2)[i % 2]) for i, dx in enumerate(dxs)]
    qgemm.runtime.synchronize(s1)
    qgemm.runtime.synchronize(s2)
    p = qgemm.plan(m, n, k, "q4_0", packed=True)
    for x, o in zip(xs, outs):
        np.testing.assert_allclose(o.to_host(), qgemm.matmul(x, pw), rtol=1e-5, atol=1e-4)
        assert qgemm.reference.relative_error(o.to_host(), p.reference(x, w)) <= 1e-5


def test_tutorial_gpu_parts_run():
    """`qgemm tutorial 4 5` on a GPU: every W4A8 rung checked and both ladders timed, and Step 5's
    comparison with llama.cpp's figures -- the DP4A rung and qgemm.matmul, with a ratio and the GEMM
    kernel matmul ran, on every shipped shape of >= 64 tokens (the CPU halves are tested without a GPU)."""
    from typer.testing import CliRunner

    from qgemm.cli import app

    r = CliRunner().invoke(app, ["tutorial", "4", "5", "--shape", "64x256x512"])
    assert r.exit_code == 0, r.output
    assert "w4a8.vec_dp4a" in r.output and "w8a8.tiled_dp4a" in r.output and "llama.cpp" in r.output, r.output
    assert "w4a8.gemv" not in r.output
    from qgemm import tutorial

    shapes = {f"{f['M']}x{f['N']}x{f['K']}" for f in tutorial.llamacpp_figures("h200" if "H200" in qgemm.runtime.device_info().name
                                                                             else "h100") if f["M"] >= 64}
    rows = [ln.split() for ln in r.output.splitlines() if ln.split()[:1] in (["q4_0"], ["q8_0"])]
    assert shapes and {row[1] for row in rows} == shapes, r.output
    for row in rows:  # type, shape, llama.cpp, Step 4, (rung + quantize), matmul, ratio, kernel
        llama, step4, op, ratio = float(row[2]), float(row[3]), float(row[-3]), float(row[-2].rstrip("x"))
        assert 0 < op and 0 < step4 and abs(ratio - llama / op) <= 0.01 * ratio + 0.01, row
        assert row[-1] in qgemm.registry.REGISTRY, row


def test_quantize_q8_1_subnormal_blocks(rng):
    """A block whose amax is subnormal gets codes 0 from the kernel, as from formats.quantize_q8_1
    and llama.cpp's flush-to-zero build (IEEE's x / d wrapped the code's sign below ~1e-40, and
    d = 0 below ~8.9e-44 made it +-inf); from FLT_MIN up the codes are within +-127, byte for byte
    the reference's. The tiny blocks sit between ordinary ones, in rows of several lengths."""
    tiny = tiny_q8_1_blocks(rng, 1016)  # 1024 blocks
    for k in (64, 1024, 4096):
        x = rng.standard_normal((1024 * 32 // (k // 2), k)).astype(np.float32)
        x.reshape(-1, 2, 32)[:, 1] = tiny  # every other block tiny
        got = qgemm.get("quantize.q8_1")(x)
        assert got.tobytes() == F.quantize_q8_1(x).tobytes(), k
        qs = got["qs"].reshape(-1, 2, 32)[:, 1]
        normal = np.abs(tiny).max(axis=1) >= np.finfo(np.float32).tiny
        assert not qs[~normal].any() and (np.abs(qs[normal].astype(int)).max(axis=1) == 127).all()


def test_quantize_q8_1_says_which_bound_a_block_passes():
    """Finite values whose float32 block sum overflows were reported as "input must be finite" (the
    kernel's status bit 0 took a non-finite sum for a non-finite value); the sum overflows half as
    well, which is what formats.quantize_q8_1 says, and now the kernel too. A NaN or inf value is
    still bit 0, on either quantizer."""
    x = np.zeros((2, 64), np.float32)
    x[1, 32:] = 3e38  # finite; their sum is not
    for call in (qgemm.get("quantize.q8_1"), F.quantize_q8_1):
        with pytest.raises(ValueError, match="overflows half"), warnings.catch_warnings():
            warnings.simplefilter("error")  # (numpy's overflow warning of the sum, once)
            call(x)
    for bad in (np.nan, -np.inf):
        x[1, 40] = bad
        for call in (qgemm.get("quantize.q8_1"), F.quantize_q8_1):
            with pytest.raises(ValueError, match="finite"):
                call(x)


INT8_PATHS = {fmt: [s.name for s in registry.list_kernels(family=fam) if s.op.w.name == fmt]
              for fmt, fam in (("q4_0", "w4a8"), ("q8_0", "w8a8"))}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_non_finite_device_activations_reach_their_row(rng, fmt, bad):
    """Device activations are not checked (that would need a synchronization), so a NaN must at least
    come out as one. The int8 paths' quantizers (quantize.q8_1 before w8a8.gemv, the skinny int8
    kernels' own) took a block's amax with fmaxf, which drops a NaN: its code became 0 and the row a
    finite, wrong result (session 70's kernel audit). Every int8 path, packed and not, at 1-8 tokens
    and beyond, and the default plan: the row is non-finite everywhere, the other rows correct."""
    n, k = 48, 256
    w = F.quantize(rng.standard_normal((n, k)).astype(np.float32), fmt)
    dw, pw = qgemm.DeviceArray.from_host(w), qgemm.pack_weights(w)
    ran = set()
    for m, path in [(m, None) for m in (1, 3, 8)] + [(3, p) for p in INT8_PATHS[fmt]]:
        x = rng.standard_normal((m, k)).astype(np.float32)
        bad_row = m // 2
        x[bad_row, 37] = bad
        ok = [r for r in range(m) if r != bad_row]
        for weights in (dw, pw):
            try:
                p = qgemm.plan(m, n, k, fmt, path=path, packed=weights is pw)
            except (qgemm.UnsupportedArchError, ValueError):  # an older GPU; a path for 16-bit x only
                continue
            ran.add(p.kernel)
            c = qgemm.matmul(qgemm.DeviceArray.from_host(x), weights, path=path).to_host()
            what = f"{p.quantizer} + {p.kernel}, M={m}"
            assert not np.isfinite(c[bad_row]).any(), f"{what}: {int(np.isfinite(c[bad_row]).sum())} finite outputs"
            if ok:
                clean = x.copy()
                clean[bad_row] = 0.0
                ref = p.reference(clean, w)[ok]
                assert qgemm.reference.relative_error(c[ok], ref) <= 1e-3, what
    assert len(ran) >= 8 or runtime.device_info().cc < 80, ran
    for name in INT8_PATHS[fmt]:  # the kernels alone, on device operands
        kern = qgemm.get(name)
        if kern.op.a != F.F32:
            continue
        x = rng.standard_normal((2, k)).astype(np.float32)
        x[1, 100] = bad
        try:
            c = kern(qgemm.DeviceArray.from_host(x), dw).to_host()
        except qgemm.UnsupportedArchError:
            continue
        assert not np.isfinite(c[1]).any() and np.isfinite(c[0]).all(), name


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_kernel_calls_refuse_packed_weights_beyond_half(rng, fmt):
    """pack_weights finds a block whose d x q overflows half (PackedWeights.f16_overflow); matmul
    refused the fp16 paths for it, but a kernel called alone took the packed weights unchecked and
    returned inf / NaN in that row (session 70's kernel audit). Now every fp16 tensor-core kernel
    refuses them as it refuses such host blocks, and the int8 kernels take them."""
    n, k = 16, 64
    w = F.quantize(rng.standard_normal((n, k)).astype(np.float32), fmt)
    w["d"][3, 1] = np.float16(9000.0 if fmt == "q4_0" else 600.0)
    if fmt == "q4_0":
        w["qs"][3, 1, 0] = 0x00  # d x (0 - 8) = -72000
    else:
        w["qs"][3, 1, 0] = -128  # 600 x -128 = -76800
    pw = qgemm.pack_weights(w)
    assert pw.f16_overflow is not None and pw.f16_overflow[:2] == (3, 1)
    x = rng.standard_normal((4, k)).astype(np.float32)
    fam = {"q4_0": "w4a16", "q8_0": "w8a16"}[fmt]
    hmma = [s.name for s in registry.list_kernels(family=fam) if s.op.unit == "hmma"]
    assert len(hmma) >= 4, hmma
    for name in hmma:
        kern = qgemm.get(name)
        xa = F.f32_to_bf16(x) if kern.op.a == F.BF16 else x.astype(kern.op.a.dtype)
        with pytest.raises(ValueError, match=rf"{name}: W row 3, block 1 .*beyond float16's range"):
            kern(qgemm.DeviceArray.from_host(xa), pw)
    i8 = qgemm.get({"q4_0": "w4a8.skinny", "q8_0": "w8a8.skinny"}[fmt])
    c = i8(qgemm.DeviceArray.from_host(x), pw).to_host()
    assert qgemm.reference.relative_error(c, i8.op.exact(x, w)) <= i8.op.exact_tol


def test_weights_beyond_half_take_the_int8_paths(rng):
    """Q8_0 weights with |d x q| past 65504: refused by the fp16 tensor-core paths (they would be inf
    there), computed by the int8 ones, packed or not."""
    n, k = 96, 256
    w_f = rng.standard_normal((n, k)).astype(np.float32)
    w_f[5, 70] = 80000.0  # row 5, block 2: d = 630
    w = F.quantize_q8_0(w_f)
    assert F.f16_dequant_overflow(w, "q8_0") == (5, 2, float(w["d"][5, 2]))
    pw = qgemm.pack_weights(w)
    assert pw.f16_overflow == (5, 2, float(w["d"][5, 2]))
    x = rng.standard_normal((64, k)).astype(np.float32)
    with pytest.raises(ValueError, match="dequantizes the weights to float16"):
        qgemm.matmul(x, w)  # w8a16.mma
    with pytest.raises(ValueError, match="dequantizes the weights to float16"):
        qgemm.matmul(x, pw)  # w8a16.wgmma_rs on sm_90, w8a16.skinny / .mma elsewhere
    for xs, ww, path in ((x, w, "w8a8.mma"), (x[:3], w, None), (x[:1], pw, None)):
        p = qgemm.plan(xs.shape[0], n, k, "q8_0", path=path, packed=ww is pw)
        assert p.op.unit != "hmma", p
        c = qgemm.matmul(xs, ww, path=path)
        assert np.isfinite(c).all(), p.kernel
        r = check.compare("matmul", p.op, (xs.shape[0], n, k), 0, c, p.reference(xs, w),
                          qgemm.reference.truth(xs, w_f), xs, w_f)
        # the exact-math reference only: against the unquantized truth the 80000 outlier's block
        # (every other weight of it rounded to 0) is quantization error past the op's NMSE bound
        assert r.unwritten == 0 and r.rel_err <= r.exact_tol, (p.kernel, r)
        # compare() divides by the products' energy, which the outlier's row dominates (~4e11 against
        # ~1.6e6): the other 95 columns are checked on their own, or they could be 0.3% off and pass
        rest = np.arange(n) != 5
        r = check.compare("matmul", p.op, (xs.shape[0], n - 1, k), 0, c[:, rest], p.reference(xs, w)[:, rest],
                          qgemm.reference.truth(xs, w_f[rest]), xs, w_f[rest])
        assert r.unwritten == 0 and r.rel_err <= r.exact_tol, (p.kernel, "without the outlier's column", r)


def test_occupancy_table_matches_the_driver():
    """qgemm/occupancy.py's CTAs per SM, computed from the architecture's documented limits and the
    compiled registers and shared memory, equal the driver's answer (cuda.core's
    `Kernel.occupancy.max_active_blocks_per_multiprocessor`) for the configurations session 58's
    decode rules count on (4-warp CTAs of one, two or four tiles; Q8_0's one-group CTA; the 16- and
    8-warp defaults), the int8 one-token kernel and the prefill kernels' defaults."""
    import math
    from qgemm import occupancy

    info = runtime.device_info()
    if info.cc not in occupancy.LIMITS:
        pytest.skip(f"no limits table for sm_{info.cc}")
    cases = [("w4a16.skinny", (8, 14336, 4096), {}), ("w4a16.skinny", (8, 14336, 4096), {"SK_WARPS": 16}),
             ("w4a16.skinny", (8, 18944, 4096), {}), ("w4a16.skinny", (8, 22016, 4096), {}),
             ("w8a16.skinny", (8, 14336, 4096), {}), ("w8a16.skinny", (8, 11008, 4096), {}),
             ("w8a16.skinny", (2, 11008, 4096), {}), ("w4a16.skinny_f16", (5, 18944, 3584), {}),
             ("w4a8.skinny", (1, 4096, 4096), {}), ("w4a16.wgmma_rs", (512, 4096, 4096), {}),
             ("w8a16.wgmma_rs", (512, 4096, 14336), {}), ("w4a8.mma", (512, 4096, 4096), {}),
             ("w4a16.mma", (512, 4096, 4096), {})]
    checked = 0
    for name, shape, extra in cases:
        k = registry.get(name)
        if not k.spec.runs_on(info.cc):
            continue
        d = {**k.config_for(*shape), **extra}
        g = k.geometry(*shape, d)
        threads = math.prod(g.block)
        r = k.compile(None, d).resources[k.spec.entry]
        mod = k._module(d)
        mod._allow_dynamic_smem(k.spec.entry, g.shmem)  # as a launch does: beyond 48 KB a kernel opts in
        driver = mod.kernels[k.spec.entry].occupancy.max_active_blocks_per_multiprocessor(threads, g.shmem)
        ours = occupancy.of_launch(info.cc, g, r)
        assert ours.ctas_per_sm == driver, (name, shape, d, r.registers, threads, g.shmem, ours, driver)
        checked += 1
    assert checked >= 8
