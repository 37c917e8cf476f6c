"""float16 and bfloat16 activations on the GPU: every path of qgemm.matmul computes exactly what it
computes on the same values as float32 (each 16-bit value is exactly a float32, and every path
widens it exactly: the decode kernels' SK_X variants, the bf16 prologues) -- bit for bit where the
two run the same configuration, and a variant run with its float32 kernel's configuration gives
that kernel's bits -- on odd shapes, host and device operands, poisoned outputs; the errors for
what a 16-bit type holds and float16 cannot.

(Each kernel alone against its references: tests/test_gpu_kernels.py, which validates every
registered kernel, the *_f16 / *_bf16 variants and the bf16 prologues included.)
"""

import numpy as np
import pytest

import qgemm
from qgemm import dispatch, formats as F, reference, runtime

pytestmark = pytest.mark.gpu

N, K = 4097, 4128  # no tile divides N; K is 129 blocks of 32


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(7)
    out = {}
    for fmt in ("q4_0", "q8_0"):
        w = F.quantize(rng.standard_normal((N, K), dtype=np.float32), fmt)
        out[fmt] = (w, qgemm.pack_weights(w))
    return out


def _poisoned(m):
    c = runtime.DeviceArray.empty((m, N), np.float32)
    c.fill_bytes(0xFF)  # NaN everywhere: an output never written stays NaN
    return c


def same(got, want, p, packed, what):
    """Bit for bit where the 16-bit plan runs the float32 plan's kernel configuration and does not
    split K across CTAs that add into C with atomics (their order changes from one launch to the
    next, float32 x included); else within float32 summation-order differences. (A variant whose
    own default configuration differs -- registry._x16_config -- sums in another order:
    test_variants_give_their_float32_kernels_bits_in_one_configuration pins the math bit for bit.)"""
    kernel = qgemm.get(p.kernel)
    p32 = dispatch.plan(p.m, p.n, p.k, p.fmt, "f32", packed=packed)
    atomic = kernel.geometry(p.m, p.n, p.k, p.defines or kernel.config_for(p.m, p.n, p.k)).zero_output
    if atomic or p.defines != p32.defines:
        assert reference.relative_error(got, want) <= 1e-6, what
    else:
        assert np.array_equal(got, want), what


@pytest.mark.parametrize("xd", ["f16", "bf16"])
@pytest.mark.parametrize("base", ["w4a8.skinny", "w8a8.skinny", "w4a16.skinny", "w8a16.skinny"])
def test_variants_give_their_float32_kernels_bits_in_one_configuration(base, xd, weights, rng):
    """The variant on 16-bit x and its float32 kernel on the widened values, launched with the same
    defines (the variant's default, and the float32 kernel's): the same bits, poisoned outputs."""
    if runtime.device_info().cc < 80:
        pytest.skip("the skinny kernels need sm_80")
    fmt = "q4_0" if base.startswith("w4") else "q8_0"
    pw = weights[fmt][1]
    k16, k32 = qgemm.get(f"{base}_{xd}"), qgemm.get(base)
    for m in ((1,) if "a8." in base else (2, 9, 16)):
        x = F.from_float32(rng.standard_normal((m, K), dtype=np.float32), F.get_format(xd))
        dx, dx32 = runtime.DeviceArray.from_host(x), runtime.DeviceArray.from_host(F.to_float32(x))
        for d in {tuple(k16.config_for(m, N, K).items()), tuple(k32.config_for(m, N, K).items())}:
            d = dict(d)
            if k32.geometry(m, N, K, d).zero_output:
                continue  # atomics: no two launches are bit-equal
            c16, c32 = _poisoned(m), _poisoned(m)
            k16.launch(dx, pw.packed, c16, m, N, K, defines=d)
            k32.launch(dx32, pw.packed, c32, m, N, K, defines=d)
            a, b = c16.to_host(), c32.to_host()
            assert np.isfinite(a).all() and np.array_equal(a, b), (base, xd, m, d)


@pytest.mark.parametrize("xd", ["f16", "bf16"])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_every_path_equals_the_float32_path_bit_for_bit(fmt, xd, weights, rng):
    w, pw = weights[fmt]
    seen = set()
    for packed, m in ((True, 1), (True, 2), (True, 7), (True, 13), (True, 16), (True, 33), (True, 300),
                      (False, 1), (False, 5), (False, 64), (False, 300)):
        wt = pw if packed else w
        p = dispatch.plan(m, N, K, fmt, x_dtype=xd, packed=packed)
        seen.add((p.quantizer, p.kernel))
        x = F.from_float32(rng.standard_normal((m, K), dtype=np.float32) * 2, F.get_format(xd))
        x32 = F.to_float32(x)
        got = qgemm.matmul(x, wt)  # host x
        want = qgemm.matmul(x32, wt)
        assert np.isfinite(got).all(), (m, packed, p.kernel)
        same(got, want, p, packed, f"{p.quantizer} + {p.kernel} at M={m}: differs from the float32 path")
        exact = p.reference(x, w)  # the path's exact integer / fp16 math on the CPU
        assert reference.relative_error(got, exact) <= qgemm.spec(p.kernel).op.exact_tol, (m, p.kernel)
        # device x, out= poisoned: every element written, the same bits again
        dx = runtime.DeviceArray.from_host(x)
        assert runtime.dtype_name(dx.dtype) == ("float16" if xd == "f16" else "bfloat16")
        dc = _poisoned(m)
        assert qgemm.matmul(dx, pw if packed else runtime.DeviceArray.from_host(w), out=dc) is dc
        same(dc.to_host(), want, p, packed, f"device x, {p.kernel} at M={m}")
    if runtime.device_info().cc >= 80:  # the decode kernels reading x themselves were among the paths
        assert (None, f"w{fmt[1]}a8.skinny_{xd}") in seen and (None, f"w{fmt[1]}a16.skinny_{xd}") in seen, seen


def test_bfloat16_beyond_half_is_refused_where_float16_cannot_hold_it(weights):
    """bfloat16 reaches 3.4e38; an fp16 tensor-core path cannot take 1e5. The int8 decode kernel
    can (float32 scales), and gives the float32 path's bits."""
    w, pw = weights["q4_0"]
    x = np.full((4, K), 0.5, np.float32)
    x[:, 7] = 1e5
    xb = F.f32_to_bf16(x)
    if runtime.device_info().cc >= 80:  # the fp16 skinny kernel rounds x itself: checked on the host first
        with pytest.raises(ValueError, match="beyond half's range"):
            qgemm.matmul(xb, pw)
    with pytest.raises(ValueError, match="overflow"):  # the prologue (convert.f16k_bf16 / .f16_bf16) flags it
        qgemm.matmul(np.repeat(xb, 100, axis=0), pw)
    if runtime.device_info().cc >= 80:  # (sm_75's Q8_1 prologue: the block sum 1e5 + ... passes half too)
        one = xb[:1]
        got, want = qgemm.matmul(one, pw), qgemm.matmul(F.to_float32(one), pw)
        assert np.isfinite(got).all() and reference.relative_error(got, want) <= 1e-6


def test_device_activations_alignment(weights, rng):
    """The decode kernels load four 16-bit values at a time: 8-byte aligned x is taken, less is
    refused with the boundary named (not a misaligned-address fault that poisons the context)."""
    if runtime.device_info().cc < 80:
        pytest.skip("the skinny kernels need sm_80")
    w, pw = weights["q8_0"]
    x = F.f32_to_bf16(rng.standard_normal((1, K + 4), dtype=np.float32))
    buf = runtime.DeviceArray.from_host(x)
    want = qgemm.matmul(F.to_float32(x[:, 4:]), pw)
    # a view 8 bytes in (4 values): a row of K values
    view = runtime.DeviceArray(buf.ptr + 8, (1, K), F.BF16_DTYPE, owner=buf)
    assert np.array_equal(qgemm.matmul(view, pw).to_host(), want)
    odd = runtime.DeviceArray(buf.ptr + 2, (1, K), F.BF16_DTYPE, owner=buf)
    with pytest.raises(ValueError, match="needs the activations on a 8-byte boundary"):
        qgemm.matmul(odd, pw)


def test_torch_half_and_bfloat16_tensors(weights, rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    w, pw = weights["q4_0"]
    for m in (1, 9, 300):
        x32 = torch.randn(m, K, device="cuda")
        for dt in (torch.float16, torch.bfloat16):
            x = x32.to(dt)
            # the same values as a host array of that type (bfloat16: its bits as qgemm's '|V2'): the same path
            host = x.view(torch.int16).cpu().numpy().view(np.float16 if dt is torch.float16 else F.BF16_DTYPE)
            want = qgemm.matmul(host, pw)
            assert reference.relative_error(want, qgemm.matmul(x.float(), pw).to_host()) <= 1e-6
            out = torch.full((m, N), float("nan"), device="cuda")
            assert qgemm.matmul(x, pw, out=out) is out
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), torch.from_numpy(want)), (m, dt)
            # the same bytes handed over the way torch 2.5 did: typestr '<f2' for bfloat16
            if dt is torch.bfloat16:
                class Torch25:
                    dtype = x.dtype
                    __cuda_array_interface__ = dict(x.__cuda_array_interface__, typestr="<f2")
                assert np.array_equal(qgemm.matmul(Torch25(), pw).to_host(), want)


@pytest.mark.parametrize("xd", ["f16", "bf16"])
def test_q4_0_variants_on_wide_weights(xd, rng):
    """Session 57's choices for the Q4_0 variants on wide weights (registry._x16_config), where
    they fire: one token with two tiles x 8 warps (1x6150x4128: 193 CTAs, 1.46 waves of the
    16-warp grid), not yet at 1x4700x4128 (148 CTAs); 13 tokens with float32's configuration
    (13x6150x4128: 193 CTAs of two tiles). Fresh inputs, N and K multiples of no tile, poisoned
    outputs, against the plan's exact math and float64 truth, and the float32 path on the same
    values (bit for bit where the two plans launch the same configuration)."""
    if runtime.device_info().cc < 80:
        pytest.skip("the skinny kernels need sm_80")
    from qgemm import check
    k = 4128
    for m, n in ((1, 6150), (1, 4700), (13, 6150)):
        w_f = rng.standard_normal((n, k), dtype=np.float32)
        w = F.quantize(w_f, "q4_0")
        pw = qgemm.pack_weights(w)
        x = F.from_float32(rng.standard_normal((m, k), dtype=np.float32), F.get_format(xd))
        x32 = F.to_float32(x)
        p = dispatch.plan(m, n, k, "q4_0", x_dtype=xd, packed=True)
        if runtime.device_info().cc == 90 and runtime.device_info().sm_count == 132:
            want_warps = {(1, 6150): 8, (1, 4700): 16, (13, 6150): 8}[(m, n)]
            assert p.defines["SK_WARPS"] == want_warps, p
            if m == 13:
                assert p.defines == dispatch.plan(m, n, k, "q4_0", x_dtype="f32", packed=True).defines, p
        out = runtime.DeviceArray.empty((m, n), np.float32)
        out.fill_bytes(0xFF)
        qgemm.matmul(runtime.DeviceArray.from_host(x), pw, out=out)
        got = out.to_host()
        r = check.compare("matmul", p.op, (m, n, k), 0, got, p.reference(x, w),
                          reference.truth(x32, w_f), x32, w_f)
        assert r.passed, (p.kernel, p.defines, r)
        same(got, qgemm.matmul(x32, pw), p, True, f"{p.kernel} at {m}x{n}x{k}")
