"""The weights' repacking on the GPU (`pack.q4_0` / `pack.q8_0`): byte for byte `packing.pack`,
inside `pack_weights`, inside single kernels given ggml blocks on the device, and per call in
`qgemm.matmul` on ggml blocks.

Marked `gpu`: skipped cleanly on machines without one (CI). tools/gpu_check.sh runs them.
"""

import numpy as np
import pytest

import qgemm
from qgemm import check, packing, formats as F, runtime

pytestmark = pytest.mark.gpu

FMTS = ["q4_0", "q8_0"]


@pytest.mark.parametrize("k", [32, 96, 4096, 4128])
@pytest.mark.parametrize("n", [1, 17, 33, 4097])
@pytest.mark.parametrize("fmt", FMTS)
def test_pack_kernel_byte_identical(fmt, n, k):
    """Odd N (rows padded to 16) and K (blocks padded to 4; K = 4096: whole groups, read by
    8-byte loads -- a real model's case), the output poisoned first."""
    r = check.validate(qgemm.get(f"pack.{fmt}"), (1, n, k))
    assert r.detail["mismatched_chunks"] == 0 and r.unwritten == 0, f"seed {r.seed}: {r.note}"
    assert r.passed and r.max_abs_err == 0.0


@pytest.mark.parametrize("fmt", FMTS)
def test_pack_kernel_call_forms(fmt, rng):
    w = F.quantize(rng.standard_normal((50, 160), dtype=np.float32), fmt)
    k = qgemm.get(f"pack.{fmt}")
    want = packing.pack(w, fmt)
    np.testing.assert_array_equal(k(w), want)  # host in, host out
    np.testing.assert_array_equal(k(np.ascontiguousarray(w).view(np.uint8)), want)  # raw gguf bytes
    dw = qgemm.DeviceArray.from_host(w)
    got = k(dw)
    assert isinstance(got, qgemm.DeviceArray)
    np.testing.assert_array_equal(got.to_host(), want)
    out = qgemm.DeviceArray.empty((want.size,), np.uint8)
    out.fill_bytes(0xFF)
    assert k(dw, out=out) is out
    np.testing.assert_array_equal(out.to_host(), want)
    # blocks that start 2 bytes past a 16-byte boundary (a view into a larger buffer): fine;
    # one byte past: refused before the launch (the scales are read as 16-bit words)
    raw = qgemm.DeviceArray.empty((w.nbytes + 16,), np.uint8)
    for off in (2, 1):
        view = qgemm.DeviceArray(raw.ptr + off, w.shape, w.dtype, owner=raw)
        dw.copy_to(view)
        if off == 2:
            np.testing.assert_array_equal(k(view).to_host(), want)
        else:
            with pytest.raises(ValueError, match="2-byte boundary"):
                k(view)
    bad = w.copy()
    bad["d"][3, 2] = np.nan
    with pytest.raises(ValueError, match="row 3, block 2 has d = nan"):
        k(qgemm.DeviceArray.from_host(bad))
    with pytest.raises(ValueError, match="finite"):
        k(bad)
    with pytest.raises(ValueError, match="takes one operand"):
        k(w, w)
    with pytest.raises(ValueError, match="out must be uint8"):
        k(dw, out=qgemm.DeviceArray.empty((want.size - 16,), np.uint8))
    # an out= 8 bytes past a 16-byte boundary (a slice of a larger buffer): refused before the
    # launch -- 16-byte stores there fault and poison the context -- and the context still works
    big = qgemm.DeviceArray.empty((want.size + 16,), np.uint8)
    with pytest.raises(ValueError, match="16-byte boundary"):
        k(dw, out=qgemm.DeviceArray(big.ptr + 8, (want.size,), np.uint8, owner=big))
    np.testing.assert_array_equal(k(dw).to_host(), want)


def _overflowing(w, fmt, row, blk):
    """Make block (row, blk) one whose d x q passes float16's range."""
    w["d"][row, blk] = 9000.0 if fmt == "q4_0" else 600.0
    w["qs"][row, blk] = 0x00 if fmt == "q4_0" else 127  # q - 8 = -8 (x 9000 = -72000) / q = 127 (x 600 = 76200)


@pytest.mark.parametrize("fmt", FMTS)
def test_pack_weights_on_the_gpu(fmt, rng):
    w = F.quantize(rng.standard_normal((33, 4128), dtype=np.float32), fmt)
    want = packing.pack(w, fmt)
    for src in (w, qgemm.DeviceArray.from_host(w)):
        pw = qgemm.pack_weights(src)
        np.testing.assert_array_equal(pw.packed.to_host(), want)
        assert pw.f16_overflow is None and pw.pack_seconds > 0
    # overflowing blocks: pack_weights names the first in row-major order, as the host check does
    big = w.copy()
    _overflowing(big, fmt, 20, 7)
    _overflowing(big, fmt, 5, 100)
    expect = F.f16_dequant_overflow(big, fmt)
    assert expect is not None and expect[:2] == (5, 100)
    for src in (big, qgemm.DeviceArray.from_host(big)):
        assert qgemm.pack_weights(src).f16_overflow == expect
    # a d that could overflow with a large q, but whose q are all 0: not flagged (the exact test)
    near = w.copy()
    near["d"][2, 3] = 9000.0 if fmt == "q4_0" else 600.0
    near["qs"][2, 3] = 0x88 if fmt == "q4_0" else 0
    assert F.f16_dequant_overflow(near, fmt) is None
    assert qgemm.pack_weights(qgemm.DeviceArray.from_host(near)).f16_overflow is None
    # matmul refuses the fp16 paths for packed weights that overflow (as for host ones)
    x = rng.standard_normal((40, 4128), dtype=np.float32)
    with pytest.raises(ValueError, match="row 5, block 100"):
        qgemm.matmul(qgemm.DeviceArray.from_host(x), qgemm.pack_weights(qgemm.DeviceArray.from_host(big)))
    bad = w.copy()
    bad["d"][4, 9] = np.inf
    with pytest.raises(ValueError, match="row 4, block 9 has d = inf"):
        qgemm.pack_weights(qgemm.DeviceArray.from_host(bad))


@pytest.mark.parametrize("fmt", FMTS)
def test_pack_weights_quantizes_float_weights(fmt, rng):
    """Float weights (float32, float16, bfloat16, float64 on the host; host or device) quantized
    by pack_weights on the GPU: the blocks are formats.quantize's of the values as float32 byte
    for byte, the packed layout is theirs, and matmul gives the result of the blocks packed
    themselves. What cannot be quantized is refused by name."""
    wf = rng.standard_normal((37, 4128), dtype=np.float32) * 0.02
    x = qgemm.DeviceArray.from_host(rng.standard_normal((9, 4128), dtype=np.float32))
    for a in (wf, wf.astype(np.float64), wf.astype(np.float16), F.f32_to_bf16(wf)):
        blocks = F.quantize(F.to_float32(a.astype(np.float32) if a.dtype == np.float64 else a), fmt)
        ref = qgemm.pack_weights(blocks)
        want = qgemm.matmul(x, ref).to_host()
        for src in (a, qgemm.DeviceArray.from_host(a.astype(np.float32) if a.dtype == np.float64 else a)):
            pw = qgemm.pack_weights(src, fmt.upper())
            assert (pw.fmt, pw.n, pw.k) == (fmt, 37, 4128) and pw.pack_seconds > 0
            assert pw.blocks.to_host().tobytes() == blocks.tobytes(), a.dtype
            np.testing.assert_array_equal(pw.packed.to_host(), ref.packed.to_host())
            # (the same plan; its K split adds partial sums with atomics, in any order: to float32 rounding)
            np.testing.assert_allclose(qgemm.matmul(x, pw).to_host(), want, rtol=1e-5, atol=1e-5)
    bad = wf.copy()
    bad[30, 4000] = np.inf
    with pytest.raises(ValueError, match=f"^pack_weights: quantizing the float weights: quantize.{fmt}: input must be finite"):
        qgemm.pack_weights(qgemm.DeviceArray.from_host(bad), fmt)
    with pytest.raises(ValueError, match="^pack_weights: input must be finite; found inf at index \\(30, 4000\\)"):
        qgemm.pack_weights(bad, fmt)  # host weights: said before the upload
    with pytest.raises(ValueError, match="^pack_weights: quantizing the float weights: .*overflows half"):
        qgemm.pack_weights(np.full((2, 64), 1e7, np.float32), fmt)
    with pytest.raises(ValueError, match=r"^pack_weights: float weights on the device must be float32, float16 or bfloat16, "
                                         r"got float64 \(37, 4128\)"):
        qgemm.pack_weights(qgemm.DeviceArray.from_host(wf.astype(np.float64)), fmt)
    with pytest.raises(ValueError, match=r"^matmul: weights must be Q4_0 or Q8_0 blocks \[N, K/32\], got float16 \(37, 4128\); "
                                         "float weights are quantized once"):
        qgemm.matmul(x, qgemm.DeviceArray.from_host(wf.astype(np.float16)), fmt)


def test_kernel_with_device_blocks_repacks_on_the_gpu(rng):
    """A kernel with the skinny layout given ggml blocks on the device repacks them on the GPU."""
    for name, fmt, m in (("w4a16.skinny", "q4_0", 5), ("w8a8.skinny", "q8_0", 1), ("w8a16.skinny", "q8_0", 3)):
        w = F.quantize(rng.standard_normal((70, 256), dtype=np.float32), fmt)
        x = rng.standard_normal((m, 256), dtype=np.float32)
        k = qgemm.get(name)
        got = k(qgemm.DeviceArray.from_host(x), qgemm.DeviceArray.from_host(w)).to_host()
        np.testing.assert_array_equal(got, k(x, w))  # host blocks: packed on the host


def _hopper():
    return runtime.device_info().cc == 90


@pytest.mark.parametrize("where", ["first", "513"])
@pytest.mark.parametrize("fmt", FMTS)
def test_matmul_repacks_ggml_blocks_per_call(fmt, where, rng):
    if not _hopper():
        pytest.skip("the per-call repacking is the default on sm_90 only")
    m = qgemm.dispatch.REPACK_MIN_M[fmt] if where == "first" else 513
    n, k = 4097, 4128
    if where == "first":  # below the rule: the kernels that read blocks
        assert qgemm.plan(m - 1, n, k, fmt).repack is None
    x = rng.standard_normal((m, k), dtype=np.float32)
    w_f = rng.standard_normal((n, k), dtype=np.float32)
    w = F.quantize(w_f, fmt)
    p = qgemm.plan(m, n, k, fmt)
    assert p.repack == f"pack.{fmt}" and p.packed and p.kernel.endswith(".wgmma_rs"), p
    assert "repacked per call" in str(p) and f"0. pack.{fmt}" in str(p)
    dx, dw = qgemm.DeviceArray.from_host(x), qgemm.DeviceArray.from_host(w)
    out = qgemm.DeviceArray.empty((m, n), np.float32)
    out.fill_bytes(0xFF)
    assert qgemm.matmul(dx, dw, out=out) is out
    c = out.to_host()
    r = check.compare("matmul", p.op, (m, n, k), 0, c, p.reference(x, w), qgemm.reference.truth(x, w_f), x, w_f)
    assert r.passed, r
    # the same kernel on pack_weights' copy, and on host blocks (split-K atomics may add in
    # another order: not bitwise)
    np.testing.assert_allclose(qgemm.matmul(dx, qgemm.pack_weights(w)).to_host(), c, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(qgemm.matmul(x, w), c, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", FMTS)
def test_repacking_ops_queued_back_to_back(fmt, rng):
    """Ops on three weight matrices, queued six deep without a sync: each op's repacking writes
    the stream's one scratch copy, which the op before reads (stream order keeps them apart: no
    programmatic dependent launch there), and each GEMM reads the copy its own repacking wrote."""
    if not _hopper():
        pytest.skip("the per-call repacking is the default on sm_90 only")
    m, n, k = qgemm.dispatch.REPACK_MIN_M[fmt], 1024, 4096
    x = qgemm.DeviceArray.from_host(rng.standard_normal((m, k), dtype=np.float32))
    ws = [F.quantize(rng.standard_normal((n, k), dtype=np.float32) * (i + 1), fmt) for i in range(3)]
    refs = [qgemm.matmul(x, qgemm.pack_weights(w)).to_host() for w in ws]
    dws = [qgemm.DeviceArray.from_host(w) for w in ws]
    assert qgemm.plan(m, n, k, fmt).repack
    outs = [qgemm.matmul(x, dws[i % 3]) for i in range(6)]
    for i, o in enumerate(outs):
        np.testing.assert_allclose(o.to_host(), refs[i % 3], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", FMTS)
def test_repacking_op_in_a_cuda_graph(fmt, rng):
    """A captured op on ggml blocks repacks them on every replay: new weight values in the same
    buffer give the new product."""
    if not _hopper():
        pytest.skip("the per-call repacking is the default on sm_90 only")
    m, n, k = qgemm.dispatch.REPACK_MIN_M[fmt] + 3, 300, 4128
    assert qgemm.plan(m, n, k, fmt).repack
    x = qgemm.DeviceArray.from_host(rng.standard_normal((m, k), dtype=np.float32))
    w1, w2 = (F.quantize(rng.standard_normal((n, k), dtype=np.float32), fmt) for _ in range(2))
    dw = qgemm.DeviceArray.from_host(w1)
    out = qgemm.DeviceArray.empty((m, n), np.float32)
    stream = runtime.create_stream()
    qgemm.matmul(x, dw, out=out, stream=stream)  # compiled and loaded before the capture
    runtime.synchronize(stream)
    g = runtime.Graph(lambda: qgemm.matmul(x, dw, out=out, stream=stream), stream)
    for w in (w1, w2, w1):
        qgemm.DeviceArray.from_host(w).copy_to(dw)
        out.fill_bytes(0xFF)
        runtime.synchronize()
        g.launch()
        runtime.synchronize(stream)
        want = qgemm.matmul(x, qgemm.pack_weights(w)).to_host()
        np.testing.assert_allclose(out.to_host(), want, rtol=1e-5, atol=1e-4)
