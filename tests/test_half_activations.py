"""float16 and bfloat16 activations without a GPU: the bfloat16 host format, how foreign arrays'
dtypes are read, the plans (which kernel reads which activation type) and their references.

The GPU side (every path bit for bit the float32 path on the same values) is
tests/test_gpu_half_activations.py.
"""

import numpy as np
import pytest

import qgemm
from qgemm import check, dispatch, formats as F, registry, runtime


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


def test_f32_to_bf16_rounds_to_nearest_even():
    # 1 + k * 2^-8 lies k/2 of the way between two bfloat16 neighbours (7 fraction bits: step 2^-7)
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 2.0**-133, 2.0**-134, 3.4e38, 3.3895314e38,
                  np.inf, -np.inf, 0.0, -0.0], np.float32)
    got = _bits(F.f32_to_bf16(x))
    want = [0x3F80,  # exact
            0x3F80,  # the tie between 0x3F80 and 0x3F81 -> even
            0x3F82,  # the tie between 0x3F81 and 0x3F82 -> even
            0x3F81,  # above the tie: up
            0xBF80,  # sign kept, tie to even
            0x0001,  # bfloat16's smallest subnormal, exactly
            0x0000,  # half of it: the tie between 0x0000 and 0x0001 -> even
            0x7F80,  # past the largest finite bfloat16 (3.3895e38) by more than half a step: inf
            0x7F7F,  # the largest finite
            0x7F80, 0xFF80, 0x0000, 0x8000]
    assert got.tolist() == want
    nan = _bits(F.f32_to_bf16(np.array([np.nan, -np.nan], np.float32)))
    assert all((v & 0x7F80) == 0x7F80 and (v & 0x7F) for v in nan.tolist()), "NaN must stay NaN"
    assert nan[0] >> 15 == 0 and nan[1] >> 15 == 1


def test_bf16_widening_is_exact_and_inverts_the_rounding(rng):
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)).astype(np.float32)
    b = F.f32_to_bf16(x)
    assert b.dtype == F.BF16_DTYPE and F.is_bf16(b.dtype)
    w = F.bf16_to_f32(b)
    assert w.dtype == np.float32 and (_bits(w.view(np.uint32) & 0xFFFF)).max() == 0  # low halves zero
    assert np.array_equal(_bits(F.f32_to_bf16(w)), _bits(b))  # bf16 -> f32 -> bf16 is the identity
    # within half a bfloat16 step (2^-8 relative) of the original
    assert np.all(np.abs(w - x) <= np.abs(x) * 2.0**-8)
    assert np.array_equal(F.to_float32(b), w) and F.to_float32(x) is not None
    assert np.array_equal(F.from_float32(x, "bf16").view(np.uint16), b.view(np.uint16))
    assert F.from_float32(x, "f16").dtype == np.float16
    with pytest.raises(ValueError, match="block format"):
        F.from_float32(x, "q4_0")


def test_ml_dtypes_bfloat16_is_the_same_bytes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")  # an optional cross-check: not a dependency of qgemm
    x = (rng.standard_normal(5000) * 1e3).astype(np.float32)
    m = x.astype(ml_dtypes.bfloat16)
    assert F.is_bf16(m.dtype)
    assert np.array_equal(_bits(F.f32_to_bf16(x)), _bits(m))
    assert np.array_equal(F.bf16_to_f32(m), m.astype(np.float32))
    assert F.as_bf16(m).dtype == F.BF16_DTYPE


def test_what_counts_as_bfloat16():
    assert F.is_bf16(np.dtype("V2")) and F.is_bf16(np.dtype("<V2"))
    assert not F.is_bf16(np.dtype("V4")) and not F.is_bf16(np.float16) and not F.is_bf16(np.uint16)
    assert not F.is_bf16(np.dtype([("a", "u1"), ("b", "u1")]))  # a structured 2-byte type is not a number
    with pytest.raises(ValueError, match="expected bfloat16 values"):
        F.as_bf16(np.zeros(3, np.float16))
    assert F.get_format("BF16") is F.BF16 and runtime.dtype_name(F.BF16_DTYPE) == "bfloat16"


class _Tensor:
    """A device array as torch shows one: `dtype` prints as torch's does, the interface's typestr
    is what that torch version reported (shape (0, K): no pointer to check without a GPU)."""

    def __init__(self, torch_dtype: str, typestr: str):
        self.dtype = torch_dtype
        self.__cuda_array_interface__ = {"shape": (0, 64), "typestr": typestr, "data": (0, False), "version": 3}


def test_foreign_bfloat16_in_every_spelling():
    """torch >= 2.6 says '<V2' for bfloat16; torch 2.5 said '<f2', float16's typestr: read as
    float16 that would be a silently wrong answer, so the tensor's own dtype decides."""
    for dtype, typestr, want in (("torch.bfloat16", "<V2", "bfloat16"), ("torch.bfloat16", "<f2", "bfloat16"),
                                 ("torch.float16", "<f2", "float16"), ("torch.float32", "<f4", "float32"),
                                 ("bfloat16", "<f2", "bfloat16")):
        d = runtime.as_device_array(_Tensor(dtype, typestr))
        assert runtime.dtype_name(d.dtype) == want, (dtype, typestr)
        assert (d.dtype == F.BF16_DTYPE) == (want == "bfloat16")


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_plans_for_each_activation_type(fmt):
    """Every path has a prologue (or none) for every activation type, and the decode kernels that
    read x themselves run their variant for it."""
    w = "4" if fmt == "q4_0" else "8"
    for arch in ("sm_75", "sm_80", "sm_90"):
        for packed in (False, True):
            for m in (1, 2, 8, 16, 17, 32, 64, 512):
                plans = {xd: dispatch.plan(m, 4096, 4096, fmt, x_dtype=xd, packed=packed, arch=arch)
                         for xd in ("f32", "f16", "bf16")}
                for xd, p in plans.items():
                    base = plans["f32"]
                    # the same algorithm for every x type: the kernel is the f32 plan's, or its variant
                    assert p.kernel == base.kernel + ("" if base.quantizer or xd == "f32" else f"_{xd}"), (arch, m, p)
                    if p.quantizer is None:
                        assert registry.spec(p.kernel).op.a.name == xd, p
                    else:
                        assert registry.spec(p.quantizer).op.a.name == xd, p
                        assert registry.spec(p.quantizer).op.out is registry.spec(p.kernel).op.a
    assert dispatch.plan(1, 4096, 4096, fmt, x_dtype="bf16", packed=True, arch="sm_90").kernel == f"w{w}a8.skinny_bf16"
    assert dispatch.plan(64, 4096, 4096, fmt, x_dtype="bf16", arch="sm_80").quantizer == "convert.f16_bf16"
    assert dispatch.plan(512, 4096, 4096, fmt, x_dtype="bf16", arch="sm_90").quantizer == "convert.f16k_bf16"
    assert dispatch.plan(1, 4096, 4096, fmt, x_dtype="bf16", arch="sm_80").quantizer == "quantize.q8_1_bf16"
    assert "reads the bfloat16 activations itself" in qgemm.explain(4, 4096, 4096, fmt, x_dtype="bf16", packed=True,
                                                                      arch="sm_90")


@pytest.mark.parametrize("xd", ["f16", "bf16"])
def test_plan_references_equal_the_float32_plans_on_the_same_values(xd, rng):
    """What the GPU must match bit for bit (tests/test_gpu_half_activations.py), stated on the CPU:
    each plan's exact reference on 16-bit x equals the float32 plan's on the widened values."""
    for fmt in ("q4_0", "q8_0"):
        w = F.quantize(rng.standard_normal((40, 128), dtype=np.float32), fmt)
        for m in (1, 5, 20):
            x = F.from_float32(rng.standard_normal((m, 128), dtype=np.float32) * 3, F.get_format(xd))
            for packed, arch in ((True, "sm_90"), (False, "sm_90"), (True, "sm_80"), (False, "sm_75")):
                p16 = dispatch.plan(m, 40, 128, fmt, x_dtype=xd, packed=packed, arch=arch)
                p32 = dispatch.plan(m, 40, 128, fmt, x_dtype="f32", packed=packed, arch=arch)
                assert np.array_equal(p16.reference(x, w), p32.reference(F.to_float32(x), w)), (fmt, m, packed, arch)


def test_variant_kernels_are_their_float32_kernels_with_sk_x():
    for base in ("w4a16.skinny", "w8a16.skinny", "w4a8.skinny", "w8a8.skinny"):
        s = registry.spec(base)
        assert s.op.a is F.F32 and "SK_X" not in s.defines
        for xd, sk_x, fmt in (("f16", 1, F.F16), ("bf16", 2, F.BF16)):
            v = registry.spec(f"{base}_{xd}")
            assert (v.source, v.entry, v.candidates, v.max_m, v.weight_layout, v.pdl) == \
                (s.source, s.entry, s.candidates, s.max_m, s.weight_layout, s.pdl)
            # the default configuration is the float32 kernel's but where a Q4_0 variant measured
            # faster with another (registry._x16_config)
            for m in range(1, (s.max_m or 8) + 1):
                for k in (4096, 14336):
                    own, var = s.config(m, 4096, k, 132), v.config(m, 4096, k, 132)
                    assert var in s.candidates(m, 4096, k), (v.name, m, k)
                    if own == var:
                        continue
                    if s.name == "w4a16.skinny":
                        assert 9 <= m <= 16 and k == 4096 and var == {**own, "SK_UNROLL": 2, "SK_ACC": 1}, (m, k, var)
                    elif s.name == "w8a16.skinny":
                        assert m == 2 and k == 4096 and var == {**own, "SK_XSMEM": 1, "SK_UNROLL": 1, "SK_ACC": 1}, (m, k, var)
                    else:
                        assert s.name == "w4a8.skinny" and m == 1 and var["SK_R"] == 2 and var["SK_WARPS"] == 16, (m, k, var)
            assert v.defines == {"SK_X": sk_x} and v.op.a is fmt and v.op.w is s.op.w
            assert v.op.exact is s.op.exact  # the reference widens 16-bit x itself
    for name, src in (("quantize.q8_1_bf16", "quantize/q8_1_bf16.cu"), ("convert.f16_bf16", "convert/bf16_to_f16.cu"),
                      ("convert.f16k_bf16", "convert/bf16_to_f16.cu")):
        s = registry.spec(name)
        assert s.source == src and s.op.a is F.BF16 and s.pdl


def test_make_inputs_for_bfloat16_kernels(rng):
    op = registry.spec("w4a8.skinny_bf16").op
    inp = check.make_inputs(op, 3, 40, 64, rng)
    assert inp.a.dtype == F.BF16_DTYPE and inp.a_float.dtype == np.float32
    # the truth keeps the float32 originals; the kernel gets them rounded to bfloat16
    assert np.array_equal(F.bf16_to_f32(inp.a), F.bf16_to_f32(F.f32_to_bf16(inp.a_float)))
    assert not np.array_equal(F.bf16_to_f32(inp.a), inp.a_float)
    q = check.make_inputs(registry.spec("quantize.q8_1_bf16").op, 3, 1, 64, rng)
    assert q.a.dtype == F.BF16_DTYPE and np.array_equal(q.a_float, F.bf16_to_f32(q.a))


def test_half_activations_refused_before_any_gpu(rng):
    w = qgemm.quantize_q4_0(rng.standard_normal((8, 64), dtype=np.float32))
    x = F.f32_to_bf16(np.ones((2, 64), np.float32))
    x.view(np.uint16)[1, 5] = 0x7FC0  # a bfloat16 NaN
    with pytest.raises(ValueError, match="activations must be finite"):
        qgemm.matmul(x, w)
    with pytest.raises(ValueError, match=r"float32, float16 or bfloat16 \[..., K\], got an opaque 4-byte type"):
        qgemm.matmul(np.zeros((2, 64), "V4"), w)
    with pytest.raises(ValueError, match=r"got a 2-byte structured type \[\('a', '\|u1'\), \('b', '\|u1'\)\]"):
        qgemm.matmul(np.zeros((2, 64), [("a", "u1"), ("b", "u1")]), w)  # 2 bytes, but no bfloat16
    with pytest.raises(ValueError, match="K mismatch: x has K=32"):
        qgemm.matmul(F.f32_to_bf16(np.ones((2, 32), np.float32)), w)
    k = qgemm.get("w4a8.skinny_bf16")
    with pytest.raises(ValueError, match=r"w4a8.skinny_bf16: A must be bfloat16 \[rows, K\], got float32 \(2, 64\)"):
        k(np.ones((2, 64), np.float32), w)
    with pytest.raises(ValueError, match="w4a8.skinny_bf16: A must be finite"):
        k(x, w)
    with pytest.raises(ValueError, match="quantize.q8_1_bf16 takes one operand \\(the bfloat16 activations\\), got two"):
        qgemm.get("quantize.q8_1_bf16")(x, w)
    if not runtime.gpu_available():
        with pytest.raises(qgemm.NoGPUError):
            qgemm.matmul(F.f32_to_bf16(np.ones((2, 64), np.float32)), w)


def test_cli_explain_takes_the_activation_type():
    from typer.testing import CliRunner

    from qgemm.cli import app

    r = CliRunner().invoke(app, ["explain", "--shape", "1x4096x4096", "--packed", "--arch", "sm_90", "--x-dtype", "bf16"])
    assert r.exit_code == 0 and "w4a8.skinny_bf16" in r.output and "reads the bfloat16 activations itself" in r.output
    r = CliRunner().invoke(app, ["explain", "--shape", "512x4096x4096", "--arch", "sm_90", "--f16"])
    assert r.exit_code == 0 and "convert.f16k_f16" in r.output
    r = CliRunner().invoke(app, ["explain", "--f16", "--x-dtype", "bf16"])
    assert r.exit_code != 0 and "disagree" in r.output
    r = CliRunner().invoke(app, ["explain", "--x-dtype", "fp8"])
    assert r.exit_code != 0 and "x_dtype must be 'f32', 'f16' or 'bf16'" in r.output


@pytest.mark.parametrize("xd", ["f16", "bf16"])
def test_q4_0_variants_on_wide_weights_keep_their_grid_in_waves(xd):
    """Session 57 (registry._x16_config): where a Q4_0 variant's own choice would run its grid in
    waves of one CTA per SM, it does not take it. At one token, two tiles x 8 warps (two CTAs per
    SM) once the 16-warp grid passes 1.25 waves; at 9-16 tokens, float32's configuration (one load
    group, 126 registers) once the grid of two-group CTAs (174 registers) passes the SMs."""
    one, many = registry.spec(f"w4a8.skinny_{xd}"), registry.spec(f"w4a16.skinny_{xd}")
    f32_many = registry.spec("w4a16.skinny")
    wide = {"SK_R": 2, "SK_WARPS": 8, "SK_UNROLL": 1, "SK_MINB": 2, "SK_PRIME": 1}
    for n, k in ((5632, 4096), (6144, 4096), (14336, 4096), (28672, 3584), (8192, 8192), (14336, 14336)):
        d = one.config(1, n, k, 132)  # 176-896 CTAs of two tiles: 1.33-6.8 waves of 132
        assert {key: d[key] for key in wide} == wide, (n, k, d)
        assert d in one.candidates(1, n, k), (n, k)
    for n in (4096, 4608, 5120):  # 128-160 CTAs: within 1.25 waves the 16 warps stay
        assert one.config(1, n, 4096, 132)["SK_WARPS"] == 16, n
    assert one.config(1, 6144, 4096, 264)["SK_WARPS"] == 16  # the waves follow the SM count
    for m in (9, 12, 16):
        for n, k in ((4608, 4096), (6144, 4096), (14336, 4096), (18944, 3584)):
            assert many.config(m, n, k, 132) == f32_many.config(m, n, k, 132), (m, n, k)
            assert many.config(m, n, k, 132)["SK_UNROLL"] == 1
        d = many.config(m, 4096, 4096, 132)  # 128 CTAs, one wave: two groups in flight
        assert d["SK_UNROLL"] == 2 and d["SK_ACC"] == 1 and d != f32_many.config(m, 4096, 4096, 132), m
