"""float16 and bfloat16 activations on the GPU: every path of qgemm.matmul gives bit for bit what
it gives on the same values as float32 (each 16-bit value is exactly a float32, and every path
widens it exactly: the decode kernels' SK_X variants, the bf16 prologues), on odd shapes, host and
device operands, poisoned outputs; the errors for what a 16-bit type holds and float16 cannot.

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


def same(got, want, p, what):
    """Bit for bit -- unless the plan splits K across CTAs that add into C with atomics, whose
    order (and so the last bits) changes from one launch to the next, float32 x included."""
    kernel = qgemm.get(p.kernel)
    if kernel.geometry(p.m, p.n, p.k, p.defines or kernel.config_for(p.m, p.n, p.k)).zero_output:
        assert reference.relative_error(got, want) <= 1e-6, what
    else:
        assert np.array_equal(got, want), what


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
        same(got, want, p, f"{p.quantizer} + {p.kernel} at M={m}: differs from the float32 path")
        exact = p.reference(x, w)  # the path's exact integer / fp16 math on the CPU
        assert reference.relative_error(got, exact) <= qgemm.spec(p.kernel).op.exact_tol, (m, p.kernel)
        # device x, out= poisoned: every element written, the same bits again
        dx = runtime.DeviceArray.from_host(x)
        assert runtime.dtype_name(dx.dtype) == ("float16" if xd == "f16" else "bfloat16")
        dc = _poisoned(m)
        assert qgemm.matmul(dx, pw if packed else runtime.DeviceArray.from_host(w), out=dc) is dc
        same(dc.to_host(), want, p, f"device x, {p.kernel} at M={m}")
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
        assert np.array_equal(qgemm.matmul(one, pw), qgemm.matmul(F.to_float32(one), pw))


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
            want = qgemm.matmul(x.float(), pw).to_host()
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
