"""qgemm.torch_ops: `torch.ops.qgemm.matmul` and QuantLinear (torch is optional: without it these
tests skip; CI installs no torch). The fake implementation, the handles and the bad inputs need no
GPU; the rest runs the op against qgemm.matmul and under torch.compile on the GPU."""

import gc

import numpy as np
import pytest

import qgemm

torch = pytest.importorskip("torch")
from qgemm import torch_ops  # noqa: E402  (after the skip: it imports torch)
from qgemm.packing import PackedWeights  # noqa: E402

GPU = qgemm.gpu_available() and torch.cuda.is_available()


def _fake_packed(n=300, k=512, fmt="q4_0"):
    """A PackedWeights carrying only its shape: enough for the fake implementation and the handles."""
    return PackedWeights(fmt, n, k, packed=None, blocks=None)


def test_fake_implementation_and_handles():
    """The shape and dtype torch.compile sees (meta tensors run the fake implementation), one
    handle per PackedWeights, and what a caller is told: a K that does not match, a handle whose
    weights are gone (never a read of freed memory), a CPU tensor, something other than
    PackedWeights."""
    pw = _fake_packed()
    h = torch_ops.handle(pw)
    assert torch_ops.handle(pw) == h and torch_ops.handle(_fake_packed()) != h
    for shape in ((4, 512), (2, 3, 512), (512,)):
        y = torch.ops.qgemm.matmul(torch.empty(shape, device="meta", dtype=torch.float16), h)
        assert y.shape == (*shape[:-1], 300) and y.dtype == torch.float32 and y.device.type == "meta"
    with pytest.raises(ValueError, match=r"qgemm::matmul: x must be \[\.\.\., K\] with K = 512 \(the weights' K\), got \(4, 500\)"):
        torch.ops.qgemm.matmul(torch.empty(4, 500, device="meta"), h)
    with pytest.raises(ValueError, match="qgemm::matmul: x must be a CUDA tensor, got one on cpu"):
        torch.ops.qgemm.matmul(torch.ones(4, 512), h)
    del pw
    gc.collect()
    with pytest.raises(ValueError, match=f"qgemm::matmul: handle {h} names no live qgemm.PackedWeights"):
        torch.ops.qgemm.matmul(torch.empty(4, 512, device="meta"), h)
    with pytest.raises(TypeError, match=r"expected qgemm.PackedWeights \(qgemm.pack_weights\(w\)\) or a compressed KV "
                                        r"cache \(qgemm.kvcache.compress_keys / compress_values\), got ndarray"):
        torch_ops.handle(np.zeros((4, 16), qgemm.block_q4_0))
    with pytest.raises(ValueError, match="QuantLinear: fmt='q8_0' but the packed weights are q4_0"):
        torch_ops.QuantLinear(_fake_packed(), fmt="q8_0")
    layer = torch_ops.QuantLinear(_fake_packed(64, 4096, "q8_0"))
    assert (layer.in_features, layer.out_features, layer.fmt) == (4096, 64, "q8_0")
    assert "in_features=4096, out_features=64, fmt=q8_0, bias=False" in repr(layer) and not list(layer.parameters())
    assert layer.bias is None and not layer.state_dict()


def test_quantlinear_bias_and_from_linear_checked(monkeypatch):
    """A bias is kept as float32 [N] (a buffer, out of state_dict as the weights are); one of the
    wrong length or type, or with a NaN, is refused; from_linear takes an nn.Linear only and, for
    a weight that is not on the GPU, needs torch with CUDA (NoGPUError without any GPU)."""
    layer = torch_ops.QuantLinear(_fake_packed(64, 4096, "q8_0"), bias=torch.arange(64, dtype=torch.float16))
    assert layer.bias.dtype == torch.float32 and torch.equal(layer.bias.cpu(), torch.arange(64, dtype=torch.float32))
    assert "bias=True" in repr(layer) and not layer.state_dict() and not list(layer.parameters())
    for bad in (torch.zeros(63), torch.zeros(1, 64), torch.zeros(64, dtype=torch.int32), torch.full((64,), float("nan"))):
        with pytest.raises(ValueError, match=r"QuantLinear: bias must be 64 finite float values \(out_features\), got "):
            torch_ops.QuantLinear(_fake_packed(64, 4096, "q8_0"), bias=bad)
    with pytest.raises(TypeError, match="QuantLinear.from_linear: expected a torch.nn.Linear, got Conv1d"):
        torch_ops.QuantLinear.from_linear(torch.nn.Conv1d(4, 4, 1))
    # a weight off the GPU and a torch without CUDA: without any GPU NoGPUError, with one a ValueError
    # (stand-ins for both, so that each runs on every machine: CI has no torch, the GPU machine has CUDA)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(qgemm.runtime, "_probe", lambda: (False, "no NVIDIA driver found (a test's stand-in)"))
    with pytest.raises(qgemm.NoGPUError, match="QuantLinear.from_linear needs an NVIDIA GPU.*a test's stand-in"):
        torch_ops.QuantLinear.from_linear(torch.nn.Linear(64, 8))
    monkeypatch.setattr(qgemm.runtime, "_probe", lambda: (True, ""))
    with pytest.raises(ValueError, match="QuantLinear.from_linear: the weight is on cpu and this torch has no CUDA"):
        torch_ops.QuantLinear.from_linear(torch.nn.Linear(64, 8))


def test_attention_fake_implementations_and_handles(rng):
    """The Mustafar operators' shapes and dtypes on meta tensors (scores float16 [R, Lq, S],
    attend float32 [R, Lq, D]), what a wrong input is told, a key cache's handle given to the
    value operator, and copies: a pickled or copied cache gets a handle of its own (the handle
    names one object), the same object keeps its handle."""
    import copy
    import pickle

    from qgemm import kvcache as kv

    cache = rng.standard_normal((2, 100, 64), dtype=np.float32).astype(np.float16)
    ck, cv = kv.compress_keys(kv.prune(cache, 0.7), 2), kv.compress_values(kv.prune(cache, 0.7), 4)
    hk, hv = torch_ops.handle(ck), torch_ops.handle(cv)
    s = torch.ops.qgemm.mustafar_scores(torch.empty(8, 3, 64, device="meta", dtype=torch.float16), hk)
    assert s.shape == (8, 3, 100) and s.dtype == torch.float16
    o = torch.ops.qgemm.mustafar_attend(torch.empty(8, 1, 100, device="meta", dtype=torch.float16), hv)
    assert o.shape == (8, 1, 64) and o.dtype == torch.float32
    with pytest.raises(ValueError, match=r"qgemm::mustafar_scores: expected float16 \[B\*groups, Lq, 64\] for a key cache "
                                         r"of shape \(2, 100, 64\), got torch.float32 \(8, 3, 64\)"):
        torch.ops.qgemm.mustafar_scores(torch.empty(8, 3, 64, device="meta"), hk)
    with pytest.raises(ValueError, match=r"qgemm::mustafar_attend: expected float16 \[B\*groups, Lq, 100\]"):
        torch.ops.qgemm.mustafar_attend(torch.empty(8, 1, 64, device="meta", dtype=torch.float16), hv)
    with pytest.raises(ValueError, match=f"qgemm::mustafar_attend: handle {hk} names a compressed key cache, "
                                         "expected a compressed value cache"):
        torch.ops.qgemm.mustafar_attend(torch.empty(8, 1, 100, device="meta", dtype=torch.float16), hk)
    with pytest.raises(ValueError, match="qgemm::mustafar_scores: the queries must be a CUDA tensor, got one on cpu"):
        torch.ops.qgemm.mustafar_scores(torch.ones(8, 3, 64, dtype=torch.float16), hk)
    assert torch_ops.handle(ck) == hk
    for other in (pickle.loads(pickle.dumps(ck)), copy.copy(ck), copy.deepcopy(ck)):
        assert torch_ops.handle(other) not in (hk, hv)
    assert torch_ops.handle(ck) == hk


gpu = pytest.mark.skipif(not GPU, reason="needs a GPU and torch with CUDA")


def _weights(fmt, n, k, rng):
    w = rng.standard_normal((n, k), dtype=np.float32)
    return qgemm.quantize_q4_0(w) if fmt == "q4_0" else qgemm.quantize_q8_0(w)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_op_is_qgemm_matmul(fmt, rng):
    """The operator gives qgemm.matmul's result bit for bit (the same plan and kernels) for
    float32 / float16 / bfloat16 x, token counts of the decode and prefill paths, leading
    dimensions and a non-contiguous x, on torch's current stream (a side stream included). (These
    plans split K at most two ways, and two partial sums add into the zeroed output to the same
    float in either order.)"""
    n, k = 300, 1024
    w = _weights(fmt, n, k, rng)
    pw = qgemm.pack_weights(w)
    layer = torch_ops.QuantLinear(w)  # packs its own copy
    for m in (1, 7, 33, 513):
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            x = torch.randn(m, k, device="cuda").to(dt)
            want = torch.from_dlpack(qgemm.matmul(x, pw)).clone()
            for got in (torch_ops.matmul(x, pw), layer(x)):
                assert got.shape == (m, n) and got.dtype == torch.float32
                assert torch.equal(got, want), (fmt, m, dt)
    x = torch.randn(2, 3, k, device="cuda")
    assert torch.equal(layer(x), torch.from_dlpack(qgemm.matmul(x, pw)))
    xt = torch.randn(k, 5, device="cuda").t()  # [5, K], not contiguous
    assert torch.equal(layer(xt), torch.from_dlpack(qgemm.matmul(xt.contiguous(), pw)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = layer(x)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, torch.from_dlpack(qgemm.matmul(x, pw)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_quantlinear_from_linear(fmt):
    """QuantLinear.from_linear: an nn.Linear of float32 / float16 / bfloat16 weights, on the GPU
    or the CPU, with and without a bias, gives the layer of ggml's blocks of those weights (as
    float32) bit for bit, plus the bias in float32; compiled with fullgraph too."""
    torch.manual_seed(0)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for device in ("cuda", "cpu"):
            for bias in (True, False):
                lin = torch.nn.Linear(256, 40, bias=bias).to(device=device, dtype=dt)
                layer = torch_ops.QuantLinear.from_linear(lin, fmt)
                w32 = lin.weight.detach().float().cpu().numpy()
                pw = qgemm.pack_weights(qgemm.quantize(w32, fmt))
                assert layer.weights.blocks.to_host().tobytes() == pw.blocks.to_host().tobytes(), (dt, device)
                x = torch.randn(7, 256, device="cuda")
                want = torch_ops.matmul(x, pw)
                if bias:
                    want = want + lin.bias.detach().float().to("cuda")
                assert torch.equal(layer(x), want), (dt, device, bias)
                assert (layer.in_features, layer.out_features, layer.fmt) == (256, 40, fmt)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))


@pytest.mark.gpu
@gpu
def test_opcheck():
    """torch.library.opcheck: the schema, the fake implementation against the real one, and the op
    under dynamo and AOT dispatch."""
    rng = np.random.default_rng(3)
    pw = qgemm.pack_weights(_weights("q4_0", 96, 256, rng))
    for x in (torch.randn(5, 256, device="cuda"), torch.randn(2, 3, 256, device="cuda", dtype=torch.float16)):
        torch.library.opcheck(torch.ops.qgemm.matmul.default, (x, torch_ops.handle(pw)))


@pytest.mark.gpu
@gpu
def test_torch_compile_fullgraph_and_cuda_graphs(rng):
    """A two-layer model compiles whole (`fullgraph=True`, which fails on a direct qgemm.matmul
    call) and under torch's CUDA graphs, each giving the eager model's result bit for bit on fresh
    inputs, and so does a function calling torch_ops.matmul on weights given their handle first.
    (AOT-eager and cudagraphs backends: the op is what is checked, not inductor's code.)"""
    k, hidden = 512, 256

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch_ops.QuantLinear(_weights("q4_0", hidden, k, rng))
            self.down = torch_ops.QuantLinear(_weights("q8_0", k, hidden, rng))

        def forward(self, x):
            return self.down(torch.relu(self.up(x)).half())

    model = Model()
    pw = qgemm.pack_weights(_weights("q8_0", hidden, k, rng))
    torch_ops.handle(pw)

    def plain(x):  # torch_ops.matmul on weights held outside a module
        return torch_ops.matmul(x, pw) * 2

    for backend in ("aot_eager", "cudagraphs"):
        torch._dynamo.reset()
        fast, fast_plain = (torch.compile(f, backend=backend, fullgraph=True) for f in (model, plain))
        for m in (4, 4, 9):
            x = torch.randn(m, k, device="cuda")
            assert torch.equal(fast(x).clone(), model(x)), (backend, m)
            assert torch.equal(fast_plain(x).clone(), plain(x)), (backend, m)


@pytest.mark.gpu
@gpu
def test_attention_ops_are_kvcache_calls_and_compile(rng):
    """scores / attend as operators: kvcache.scores' result bit for bit (the key kernels add no
    partial sums across lanes), attend's within float32 rounding (the value kernels add their
    partial sums with atomics, in any order); opcheck; and one attention step -- scores, softmax,
    attend -- compiled with fullgraph=True, as eager."""
    from qgemm import kvcache as kv

    b, s, d, groups = 4, 1000, 128, 4
    k = rng.standard_normal((b, s, d), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((b, s, d), dtype=np.float32).astype(np.float16)
    ck, cv = kv.compress_keys(kv.prune(k, 0.7), 2), kv.compress_values(kv.prune(v, 0.7), 4)
    ck.to_device(), cv.to_device()
    q = (torch.randn(b * groups, 1, d, device="cuda") / d**0.5).half()
    p = torch.softmax(torch.randn(b * groups, 1, s, device="cuda"), -1).half()
    assert torch.equal(torch_ops.scores(q, ck), torch.from_dlpack(kv.scores(q, ck)))
    torch.testing.assert_close(torch_ops.attend(p, cv), torch.from_dlpack(kv.attend(p, cv)), rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.qgemm.mustafar_scores.default, (q, torch_ops.handle(ck)))
    torch.library.opcheck(torch.ops.qgemm.mustafar_attend.default, (p, torch_ops.handle(cv)),
                          test_utils=("test_schema", "test_faketensor"))  # (atomics: no bitwise replays)

    def step(q):
        return torch_ops.attend(torch.softmax(torch_ops.scores(q, ck).float(), -1).half(), cv)

    torch._dynamo.reset()
    fast = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fast(q), step(q), rtol=1e-5, atol=1e-6)


def test_what_the_session_69_torch_audit_found():
    """Each failed before (CPU torch, no GPU needed): a compiled function called with a second
    weights object (its handle a SymInt in the fake), a deep copy computing with the original's
    weights, fakes accepting what the operator refuses, raw torch errors for host tensors and
    biases, and a bias rounded by .to(bfloat16)."""
    import copy

    p1, p2 = _fake_packed(64, 256), _fake_packed(128, 256)
    torch_ops.handle(p1), torch_ops.handle(p2)
    x = torch.empty(4, 256, device="meta")
    for dynamic in (False, True):
        f = torch.compile(lambda x, pw: torch_ops.matmul(x, pw), backend="aot_eager", dynamic=dynamic)
        assert f(x, p1).shape == (4, 64) and f(x, p2).shape == (4, 128)
    a = torch_ops.QuantLinear(_fake_packed(64, 256))
    d = copy.deepcopy(a)
    assert d.weights is not a.weights and d.handle != a.handle and d.handle == torch_ops.handle(d.weights)
    del a
    gc.collect()
    assert d(torch.empty(2, 256, device="meta")).shape == (2, 64)  # its own weights, not the freed original's
    h = torch_ops.handle(p1)
    for bad, said in ((torch.empty(4, 256, dtype=torch.int32, device="meta"), "must be float32, float16 or bfloat16"),
                      (torch.empty(0, 256, device="meta"), r"no rows \(M = 0\)")):
        with pytest.raises(ValueError, match=said):
            torch.ops.qgemm.matmul(bad, h)
    ck = qgemm.kvcache.compress_keys(np.ones((2, 64, 64), np.float16), 2)
    for rows, lq in ((3, 1), (0, 1), (4, 0)):
        with pytest.raises(ValueError, match="a positive multiple of B"):
            torch.ops.qgemm.mustafar_scores(torch.empty(rows, lq, 64, dtype=torch.float16, device="meta"), torch_ops.handle(ck))
    for bias, said in (("abc", "got str"), (torch.empty(64, device="meta"), "got a meta tensor")):
        with pytest.raises(ValueError, match="QuantLinear: bias must be 64 finite float values.*" + said):
            torch_ops.QuantLinear(_fake_packed(64, 256), bias=bias)
    m = torch_ops.QuantLinear(_fake_packed(64, 256), bias=torch.full((64,), 1.001))
    for to in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()):
        to(m)
        assert m.bias.dtype == torch.float32 and float(m.bias[0]) == float(np.float32(1.001))
    # host tensors: read as numpy (bfloat16, requiring grad), a meta tensor refused by name
    from qgemm import runtime

    b = runtime.host_array(torch.tensor([1.0, -2.5], dtype=torch.bfloat16), "t", "x")
    assert b.dtype == qgemm.formats.BF16_DTYPE and list(qgemm.formats.bf16_to_f32(b)) == [1.0, -2.5]
    w = torch.nn.Linear(64, 4).weight
    assert np.array_equal(runtime.host_array(w, "t", "w"), w.detach().numpy())
    blocks = np.zeros((4, 2), qgemm.block_q4_0)
    with pytest.raises(ValueError, match="matmul: x is a meta tensor, which holds no values"):
        qgemm.matmul(torch.ones(2, 64, device="meta"), blocks)
    if not qgemm.gpu_available():  # past the host checks: only the GPU is missing
        for call in (lambda: qgemm.matmul(torch.ones(2, 64, dtype=torch.bfloat16), blocks),
                     lambda: qgemm.pack_weights(torch.nn.Linear(64, 8).weight, "q4_0"),
                     lambda: qgemm.pack_weights(torch.ones(8, 64, dtype=torch.bfloat16), "q4_0")):
            with pytest.raises(qgemm.NoGPUError):
                call()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU and torch with CUDA")
def test_inputs_that_require_grad_and_host_bfloat16_on_the_gpu(rng):
    """A QuantLinear after a layer with parameters, outside torch.no_grad(): the operator's input
    requires grad (torch refused its array interface); host bfloat16 and grad-requiring weights
    to pack_weights / matmul."""
    w = rng.standard_normal((64, 256), dtype=np.float32)
    lin = torch.nn.Linear(256, 64).cuda()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    q = torch_ops.QuantLinear.from_linear(lin, "q8_0")
    pre = torch.nn.Linear(256, 256).cuda()
    x = pre(torch.randn(3, 256, device="cuda"))
    assert x.requires_grad
    y = q(x)
    ref = torch_ops.QuantLinear.from_linear(lin, "q8_0")(x.detach())
    assert torch.equal(y.detach(), ref)
    pw = qgemm.pack_weights(lin.weight.cpu(), "q8_0")  # a host tensor that requires grad
    xb = torch.randn(3, 256).to(torch.bfloat16)
    out = qgemm.matmul(xb, pw)  # host bfloat16 activations
    want = qgemm.matmul(qgemm.formats.f32_to_bf16(xb.float().numpy()), pw)
    assert np.array_equal(out, want)
