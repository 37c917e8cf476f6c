"""CPU tests of qgemm.formats: block layouts, quantizers and dequantizers (gguf.quants is the oracle
for Q4_0 / Q8_0), the Q8_1 activation quantizer, input validation and raw-byte views."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from qgemm import formats as F
from edge_inputs import tiny_q8_1_blocks

gguf = pytest.importorskip("gguf")
GQ = gguf.GGMLQuantizationType

OURS_Q = {"q4_0": F.quantize_q4_0, "q8_0": F.quantize_q8_0}
OURS_DQ = {"q4_0": F.dequantize_q4_0, "q8_0": F.dequantize_q8_0}
GGUF_T = {"q4_0": GQ.Q4_0, "q8_0": GQ.Q8_0}
F32 = np.float32
NEAR_HALF = np.nextafter(F32(0.5), F32(0))  # 0.49999997f, the largest float32 below 0.5


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**63))


def raw(blocks: np.ndarray) -> np.ndarray:
    """Structured blocks [rows, nb] -> raw bytes [rows, nb*itemsize] (gguf's layout)."""
    rows = blocks.shape[0] if blocks.ndim > 1 else 1
    return np.ascontiguousarray(blocks).view(np.uint8).reshape(rows, -1)


def roundf_ref(v: np.ndarray) -> np.ndarray:
    """Correct C roundf (half away from zero) in float64: v - trunc(v) is exact, no x+0.5 rounding."""
    v = np.asarray(v, dtype=np.float64)
    t = np.trunc(v)
    return t + np.sign(v) * (np.abs(v - t) >= 0.5)


# --------------------------------------------------------------------------------------------
# layouts


def test_block_dtype_layouts():
    assert F.block_q4_0.itemsize == 18
    assert F.block_q8_0.itemsize == 34
    assert F.block_q8_1.itemsize == 36
    assert F.block_q4_0.names == ("d", "qs")
    assert F.block_q8_0.names == ("d", "qs")
    assert F.block_q8_1.names == ("d", "s", "qs")
    off = lambda dt, name: dt.fields[name][1]  # noqa: E731
    assert off(F.block_q4_0, "d") == 0 and off(F.block_q4_0, "qs") == 2
    assert off(F.block_q8_0, "d") == 0 and off(F.block_q8_0, "qs") == 2
    assert off(F.block_q8_1, "d") == 0 and off(F.block_q8_1, "s") == 2 and off(F.block_q8_1, "qs") == 4
    # field types: little-endian half scales, uint8 nibble pairs / int8 quants
    assert F.block_q4_0.fields["d"][0] == np.dtype("<f2")
    assert F.block_q4_0.fields["qs"][0] == np.dtype(("u1", (16,)))
    assert F.block_q8_0.fields["qs"][0] == np.dtype(("i1", (32,)))
    assert F.block_q8_1.fields["s"][0] == np.dtype("<f2")
    assert F.block_q8_1.fields["qs"][0] == np.dtype(("i1", (32,)))
    for name, itemsize in (("q4_0", 18), ("q8_0", 34), ("q8_1", 36)):
        fmt = F.get_format(name)
        assert fmt.nbytes(3, 64) == 3 * 2 * itemsize
        assert fmt.bits_per_value() == 8.0 * itemsize / 32


# --------------------------------------------------------------------------------------------
# byte-identity with gguf.quants


def adversarial_cases() -> dict[str, np.ndarray]:
    cases: dict[str, np.ndarray] = {}
    cases["zeros"] = np.zeros((3, 64), F32)

    positions = [0, 1, 7, 15, 16, 17, 30, 31]
    onehot = np.zeros((2 * len(positions), 32), F32)
    for i, p in enumerate(positions):
        onehot[2 * i, p] = 1.75
        onehot[2 * i + 1, p] = -3.0
    cases["one_hot"] = onehot.reshape(4, -1)  # several blocks per row

    base = np.linspace(-1.0, 1.0, 32, dtype=F32)
    neg = base.copy()
    neg[5] = -3.0
    pos = base.copy()
    pos[20] = 3.0
    neg_first = base.copy()
    neg_first[0] = -5.0
    pos_last = base.copy()
    pos_last[31] = 5.0
    cases["extremes"] = np.stack([neg, pos, neg_first, pos_last])

    # exact .5 ties after scaling. Q8_0: amax 127 -> d = 1, id = 1 so x*id = k + 0.5 exactly;
    # amax 63.5 -> id = 2, quarter steps become half steps. Q4_0: max -8 -> d = 1 (and 8 -> -1)
    # so x*id + 8.5 lands exactly on integers.
    t1 = np.concatenate([[127.0], np.arange(-15.5, 15.0, 1.0)]).astype(F32)  # 1 + 31 values
    t2 = np.concatenate([[-63.5], np.arange(-3.75, 4.0, 0.25)[:31]]).astype(F32)
    t3 = np.concatenate([[-8.0], np.arange(-7.5, 8.0, 0.5)[:31]]).astype(F32)
    t4 = np.concatenate([[8.0], np.arange(-7.5, 8.0, 0.5)[:31]]).astype(F32)
    t5 = np.concatenate([[127.0], -np.arange(0.5, 31.0, 1.0)]).astype(F32)
    cases["ties"] = np.stack([t1, t2, t3, t4, t5])
    assert cases["ties"].shape == (5, 32)
    assert (np.abs(cases["ties"]).argmax(axis=1) == 0).all()

    rng = np.random.default_rng(1234)
    cases["tiny"] = (rng.standard_normal((2, 96)) * 1e-30).astype(F32)
    cases["large"] = (rng.standard_normal((2, 96)) * 1e4).astype(F32)

    # equal magnitudes with mixed signs: argmax ties, the first occurrence must win
    m1 = np.zeros(32, F32)
    m1[[3, 9, 27]] = [-2.0, 2.0, -2.0]
    m2 = np.zeros(32, F32)
    m2[[3, 9, 27]] = [2.0, -2.0, 2.0]
    m3 = np.where(np.arange(32) % 2 == 0, F32(1.5), F32(-1.5)).astype(F32)
    m4 = -m3
    cases["mixed_sign_ties"] = np.stack([m1, m2, m3, m4])

    # values (k + 0.5) * d in float32: x * (1/d) (ggml's Q8_0) and x / d (the CUDA Q8_1 kernel)
    # land on different sides of k + 0.5 for some of them
    rows = []
    for amax in (1.0, 3.0, -0.7):
        d = F32(abs(amax)) / F32(127)
        vals = (np.arange(1, 32) + 0.5).astype(F32) * d
        rows.append(np.concatenate([[amax], vals]).astype(F32))
    cases["recip_vs_div"] = np.stack(rows)
    return cases


ADVERSARIAL = adversarial_cases()


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_quantize_matches_gguf_adversarial(fmt, case):
    x = ADVERSARIAL[case]
    ours = OURS_Q[fmt](x)
    assert ours.dtype == F.get_format(fmt).dtype
    assert ours.shape == (x.shape[0], x.shape[1] // 32)
    ref = gguf.quants.quantize(x, GGUF_T[fmt])
    got = raw(ours)
    assert got.shape == ref.shape
    bad = np.argwhere(got != ref)
    assert bad.size == 0, f"{fmt}/{case}: bytes differ from gguf at {bad[:8].tolist()}"
    # dequantization agrees exactly too, from either representation
    deq_ref = gguf.quants.dequantize(ref, GGUF_T[fmt])
    assert np.array_equal(OURS_DQ[fmt](ours), deq_ref), f"{fmt}/{case}"
    assert np.array_equal(OURS_DQ[fmt](ref), deq_ref), f"{fmt}/{case} (raw bytes)"


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("shape,scale", [((4, 256), 1.0), ((3, 4096), 1.0), ((2, 512), 37.5), ((5, 64), 1e-3)])
def test_quantize_matches_gguf_random(fmt, shape, scale):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * scale).astype(F32)
    x[0, :32] = rng.uniform(-scale, scale, 32)  # a non-Gaussian block too
    ours = OURS_Q[fmt](x)
    ref = gguf.quants.quantize(x, GGUF_T[fmt])
    got = raw(ours)
    bad = np.argwhere(got != ref)
    assert bad.size == 0, f"{fmt} seed={seed}: bytes differ from gguf at {bad[:8].tolist()}"
    deq_ref = gguf.quants.dequantize(ref, GGUF_T[fmt])
    assert np.array_equal(OURS_DQ[fmt](ours), deq_ref), f"{fmt} seed={seed}"
    assert OURS_DQ[fmt](ours).dtype == np.float32


def test_argmax_tie_first_occurrence_sets_q4_0_sign():
    x = ADVERSARIAL["mixed_sign_ties"]
    q = F.quantize_q4_0(x)
    d = q["d"].astype(np.float32)[:, 0]
    # first of the largest |x| decides: -2 -> d = 0.25, +2 -> d = -0.25, +1.5 -> d = -0.1875
    assert d.tolist() == [0.25, -0.25, -0.1875, 0.1875]
    # that first value maps to stored nibble 0 (i.e. -8)
    nib = F.unpack_q4_0(q)
    assert nib[0, 3] == 0 and nib[1, 3] == 0 and nib[2, 0] == 0 and nib[3, 0] == 0


def test_q8_0_ties_round_half_away_from_zero():
    x = ADVERSARIAL["ties"][[0, 4]]  # d = 1: values k + 0.5
    q = F.quantize_q8_0(x)
    assert q["d"].astype(np.float32).tolist() == [[1.0], [1.0]]
    expected = roundf_ref(x)
    assert np.array_equal(q["qs"].reshape(2, 32).astype(np.float64), expected)
    assert q["qs"][0, 0, 1] == -16  # -15.5 -> -16
    assert q["qs"][0, 0, 17] == 1  # 0.5 -> 1 (np.round would give 0)
    assert q["qs"][0, 0, 18] == 2  # 1.5 -> 2
    assert q["qs"][0, 0, 19] == 3  # 2.5 -> 3 (np.round would give 2)


def test_reciprocal_vs_division_rounding():
    """Q8_0 multiplies by the reciprocal (ggml's CPU reference); Q8_1 divides (the CUDA kernel)."""
    x = ADVERSARIAL["recip_vs_div"]
    amax = np.abs(x).max(axis=1)
    d = (amax / F32(127)).astype(F32)
    inv_d = (F32(1) / d).astype(F32)
    by_mul = (x * inv_d[:, None]).astype(F32)
    by_div = (x / d[:, None]).astype(F32)
    assert not (np.abs(by_mul) == NEAR_HALF).any() and not (np.abs(by_div) == NEAR_HALF).any()
    q_mul, q_div = roundf_ref(by_mul), roundf_ref(by_div)
    assert (q_mul != q_div).sum() >= 3  # the case really tells the two apart
    assert np.array_equal(F.quantize_q8_0(x)["qs"].reshape(x.shape).astype(np.float64), q_mul)
    assert np.array_equal(F.quantize_q8_1(x)["qs"].reshape(x.shape).astype(np.float64), q_div)


# Regression: an earlier formats._roundf computed floor(|x| + 0.5) in float32, where
# 0.49999997f + 0.5f rounds to 1.0f, so 0.49999997 was quantized to 1 instead of C roundf's 0.


def _near_half_block() -> np.ndarray:
    x = np.zeros((1, 32), F32)
    x[0, 0] = 127.0  # d = 1, id = 1: x*id == x exactly
    x[0, 1] = NEAR_HALF
    x[0, 2] = -NEAR_HALF
    x[0, 3] = 0.5
    return x


def test_q8_0_near_half_matches_gguf():
    x = _near_half_block()
    ref = gguf.quants.quantize(x, GQ.Q8_0)
    got = raw(F.quantize_q8_0(x))
    assert np.array_equal(got, ref), f"ours {got[0, 2:6]} vs gguf {ref[0, 2:6]}"


def test_q8_1_near_half_matches_roundf():
    x = _near_half_block()
    q = F.quantize_q8_1(x)
    assert q["qs"][0, 0, :4].tolist() == [127, 0, 0, 1]


# --------------------------------------------------------------------------------------------
# Q4_0 nibble layout


def test_q4_0_nibble_layout():
    blk = np.zeros((1, 1), F.block_q4_0)
    blk["d"] = np.float16(0.5)
    low = np.arange(16, dtype=np.uint8)  # elements 0..15
    high = (15 - np.arange(16)).astype(np.uint8)  # elements 16..31
    blk["qs"][0, 0] = low | (high << 4)
    nib = F.unpack_q4_0(blk)
    assert nib.shape == (1, 32)
    assert nib[0, :16].tolist() == low.tolist()
    assert nib[0, 16:].tolist() == high.tolist()
    for j in range(16):  # element j <- low nibble of qs[j], element j+16 <- high nibble of qs[j]
        assert nib[0, j] == blk["qs"][0, 0, j] & 0x0F
        assert nib[0, j + 16] == blk["qs"][0, 0, j] >> 4
    x = F.dequantize_q4_0(blk)
    assert x.shape == (1, 32)
    expected = 0.5 * (np.concatenate([low, high]).astype(np.float32) - 8)
    assert np.array_equal(x[0], expected)
    # a single distinctive nibble in each half
    blk["qs"][0, 0] = 0x88  # all elements 0 (nibble 8)
    blk["qs"][0, 0, 5] = 0x8F  # element 5 -> 15, element 21 -> 8
    blk["qs"][0, 0, 9] = 0x08 | (0x1 << 4)  # element 9 -> 8, element 25 -> 1
    x = F.dequantize_q4_0(blk)[0]
    nz = np.flatnonzero(x)
    assert nz.tolist() == [5, 25]
    assert x[5] == 0.5 * 7 and x[25] == 0.5 * -7
    # the quantizer writes the same layout
    v = np.zeros((1, 32), F32)
    v[0, 0] = -8.0  # d = 1
    v[0, 3] = 7.0  # element 3 -> nibble 15 (low nibble of qs[3])
    v[0, 19] = -3.0  # element 19 -> nibble 5 (high nibble of qs[3])
    q = F.quantize_q4_0(v)
    assert q["d"][0, 0] == 1.0
    assert q["qs"][0, 0, 3] == (15 | (5 << 4))
    assert q["qs"][0, 0, 0] == (0 | (8 << 4))


# --------------------------------------------------------------------------------------------
# Q8_1


def butterfly_lane_sums(blocks: np.ndarray) -> np.ndarray:
    """Simulate __shfl_xor_sync butterflies on 32 lanes: returns every lane's final value [nb, 32]."""
    v = np.asarray(blocks, dtype=np.float32).copy()
    lanes = np.arange(32)
    for offset in (16, 8, 4, 2, 1):
        v = (v + v[:, lanes ^ offset]).astype(np.float32)  # sum += __shfl_xor_sync(sum, offset)
        assert v.dtype == np.float32
    return v


def test_warp_sum_32_is_the_butterfly():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    # wide dynamic range so that the summation order changes the float32 result
    x = (rng.standard_normal((4096, 32)) * np.exp(rng.uniform(-8, 8, (4096, 32)))).astype(F32)
    lanes = butterfly_lane_sums(x)
    ws = F.warp_sum_32(x)
    assert ws.dtype == np.float32 and ws.shape == (4096,)
    assert np.array_equal(ws.view(np.uint32), lanes[:, 0].view(np.uint32)), f"seed={seed}"
    # every lane ends with the same bits
    assert np.array_equal(lanes.view(np.uint32), np.repeat(lanes[:, :1], 32, axis=1).view(np.uint32)), f"seed={seed}"
    # and the order matters: a sequential sum differs somewhere (so this test can tell them apart)
    seq = np.zeros(4096, F32)
    for i in range(32):
        seq = (seq + x[:, i]).astype(F32)
    assert not np.array_equal(seq, ws), f"seed={seed}"


def test_quantize_q8_1_fields():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 256)) * rng.uniform(0.01, 20, (6, 1))).astype(F32)
    x[1, :32] = 0.0  # an all-zero block
    q = F.quantize_q8_1(x)
    assert q.dtype == F.block_q8_1 and q.shape == (6, 8)
    blocks = x.reshape(-1, 32)
    qb = q.reshape(-1)
    amax = np.abs(blocks).max(axis=1)
    d32 = (amax / F32(127)).astype(F32)
    # d: amax / 127 in float32, stored as half
    assert np.array_equal(qb["d"].view(np.uint16), d32.astype(np.float16).view(np.uint16)), f"seed={seed}"
    # q: roundf(x / d) with the float32 d (a true division), 0 for an all-zero block
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (blocks / d32[:, None]).astype(F32)
    expected_q = np.where(amax[:, None] == 0, 0, roundf_ref(ratio))
    assert np.array_equal(qb["qs"].astype(np.float64), expected_q), f"seed={seed}"
    assert np.abs(qb["qs"]).max() == 127
    # s: sum of the ORIGINAL values, stored as half; bit-exactly the butterfly sum, and within
    # half rounding (+ float32 summation error) of the float64 sum
    assert np.array_equal(qb["s"].view(np.uint16), F.warp_sum_32(blocks).astype(np.float16).view(np.uint16))
    s64 = blocks.astype(np.float64).sum(axis=1)
    s_half = qb["s"].astype(np.float64)
    half_ulp = np.spacing(np.abs(s64).astype(np.float16)).astype(np.float64)
    tol = 0.5 * half_ulp + 64 * np.finfo(F32).eps * np.abs(blocks).astype(np.float64).sum(axis=1)
    err = np.abs(s_half - s64)
    assert (err <= tol).all(), f"seed={seed}: worst s error {err.max()} vs tol {tol[err.argmax()]}"
    assert qb["s"][8] == 0 and qb["d"][8] == 0 and (qb["qs"][8] == 0).all()  # the zero block


def test_q8_1_s_is_sum_of_original_values_not_of_dequantized():
    x = np.full((1, 32), 0.4, F32)
    x[0, 0] = 127.0  # d = 1, every 0.4 quantizes to 0
    q = F.quantize_q8_1(x)
    assert q["d"][0, 0] == 1.0
    assert q["qs"][0, 0, 1:].tolist() == [0] * 31
    s = float(q["s"][0, 0])
    assert abs(s - (127 + 31 * 0.4)) <= 0.125, s  # 139.4 (half spacing at 128..256 is 0.125)
    assert abs(s - 127.0) > 10  # sum(q * d) would be 127


def test_q8_1_ties_round_half_away_from_zero():
    x = ADVERSARIAL["ties"][[0, 4]]
    q = F.quantize_q8_1(x)
    assert np.array_equal(q["qs"].reshape(2, 32).astype(np.float64), roundf_ref(x))
    assert q["qs"][0, 0, 19] == 3 and q["qs"][1, 0, 3] == -3  # 2.5 -> 3, -2.5 -> -3


def test_q8_1_subnormal_blocks_flushed_normal_ones_never_wrap(rng):
    """A block whose amax is subnormal is all codes 0 (llama.cpp's flush-to-zero build gives that;
    IEEE's x / d passed 127.5 there, and the int8 conversion flipped the code's sign). From FLT_MIN
    up every code is roundf(x / d), within +-127 and of x's sign, the amax's code +-127."""
    x = tiny_q8_1_blocks(rng)
    q = F.quantize_q8_1(x).reshape(-1)
    amax = np.abs(x).max(axis=1)
    normal = amax >= np.finfo(F32).tiny
    assert 100 < normal.sum() < len(x) - 100  # both sides of FLT_MIN are exercised
    assert not q["qs"][~normal].any()
    qs = q["qs"][normal].astype(np.int64)
    xn = x[normal]
    d = (amax[normal] / F32(127))[:, None]
    assert np.array_equal(qs, roundf_ref((xn / d).astype(F32)))
    assert (np.abs(qs) <= 127).all() and (np.sign(qs) * np.sign(xn) >= 0).all()
    assert (np.abs(qs).max(axis=1) == 127).all()
    assert not q["d"].any() and not q["s"].any()  # both below half's smallest subnormal here


# --------------------------------------------------------------------------------------------
# errors


QUANTIZERS = [F.quantize_q4_0, F.quantize_q8_0, F.quantize_q8_1]


@pytest.mark.parametrize("quant", QUANTIZERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_rejected(quant, bad):
    x = np.ones((2, 64), F32)
    x[1, 40] = bad
    with pytest.raises(ValueError, match="finite"):
        quant(x)


@pytest.mark.parametrize(
    "quant,value",
    [(F.quantize_q8_0, 1e7), (F.quantize_q4_0, 1e6), (F.quantize_q8_1, 1e7), (F.quantize_q4_0, -1e6)],
    ids=["q8_0-d", "q4_0-d", "q8_1-d", "q4_0-neg-d"],
)
def test_scale_overflowing_half_rejected(quant, value):
    x = np.ones((1, 64), F32)
    x[0, 40] = value
    with pytest.raises(ValueError, match="overflows half"):
        quant(x)


def test_q8_1_block_sum_overflowing_half_rejected():
    x = np.full((1, 64), 3000.0, F32)  # d = 23.6 fits, s = 96000 does not
    assert float(np.float16(3000.0 / 127)) < 65504
    with pytest.raises(ValueError, match="overflows half"):
        F.quantize_q8_1(x)
    # and just below the limit it is accepted
    ok = F.quantize_q8_1(np.full((1, 32), 2000.0, F32))
    assert float(ok["s"][0, 0]) == 64000.0
    # a sum past float32 (finite values): the same error, and no numpy overflow warning before it
    with pytest.raises(ValueError, match="overflows half"), warnings.catch_warnings():
        warnings.simplefilter("error")
        F.quantize_q8_1(np.full((1, 32), 3e38, F32))


def test_scales_just_fitting_half_accepted():
    x = np.zeros((1, 32), F32)
    x[0, 0] = 65504.0 * 127  # Q8_0 d == half max
    assert float(F.quantize_q8_0(x)["d"][0, 0]) == 65504.0
    x[0, 0] = -65504.0 * 8  # Q4_0 d == half max
    assert float(F.quantize_q4_0(x)["d"][0, 0]) == 65504.0


@pytest.mark.parametrize("quant", QUANTIZERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("k", [0, 1, 16, 48, 100])
def test_k_not_multiple_of_32_rejected(quant, k):
    with pytest.raises(ValueError, match="multiple of 32"):
        quant(np.ones((2, k), F32))


@pytest.mark.parametrize("quant", QUANTIZERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.int64, np.bool_])
def test_integer_input_rejected(quant, dtype):
    with pytest.raises(ValueError, match="floating"):
        quant(np.ones((2, 64), dtype=dtype))


@pytest.mark.parametrize("quant", QUANTIZERS, ids=lambda f: f.__name__)
def test_other_float_dtypes_and_shapes(quant):
    seed = fresh_seed()
    x = np.random.default_rng(seed).standard_normal((2, 3, 64)).astype(np.float16)
    q = quant(x)
    assert q.shape == (2, 3, 2)
    assert np.array_equal(raw(q.reshape(6, 2)), raw(quant(x.astype(F32).reshape(6, 64)))), f"seed={seed}"
    assert np.array_equal(raw(quant(x.astype(np.float64))), raw(q)), f"seed={seed}"
    with pytest.raises(ValueError):
        quant(np.float32(1.0))


def test_quantize_dispatch():
    x = np.linspace(-1, 1, 64, dtype=F32)[None]
    assert np.array_equal(raw(F.quantize(x, "Q4_0")), raw(F.quantize_q4_0(x)))
    assert np.array_equal(raw(F.quantize(x, F.Q8_1)), raw(F.quantize_q8_1(x)))
    with pytest.raises(ValueError, match="not a quantized format"):
        F.quantize(x, "f16")
    with pytest.raises(ValueError, match="unknown format"):
        F.quantize(x, "q5_k")


# --------------------------------------------------------------------------------------------
# as_blocks


def test_as_blocks_raw_and_structured():
    x = np.random.default_rng(7).standard_normal((3, 128)).astype(F32)
    for name, fmt in (("q4_0", GQ.Q4_0), ("q8_0", GQ.Q8_0)):
        ours = OURS_Q[name](x)
        gb = gguf.quants.quantize(x, fmt)
        assert gb.dtype == np.uint8
        view = F.as_blocks(gb, name)
        assert view.dtype == F.get_format(name).dtype and view.shape == (3, 4)
        assert np.array_equal(raw(view), raw(ours))
        same = F.as_blocks(ours, name)
        assert same.dtype == ours.dtype and np.array_equal(raw(same), raw(ours))
    q81 = F.quantize_q8_1(x)
    assert np.array_equal(raw(F.as_blocks(raw(q81), "q8_1")), raw(q81))


def test_as_blocks_rejects_wrong_format():
    q8 = F.quantize_q8_0(np.ones((2, 64), F32))
    with pytest.raises(ValueError, match="q4_0") as ei:
        F.as_blocks(q8, F.Q4_0, "W")
    assert "q8_0" in str(ei.value)
    with pytest.raises(ValueError, match="q4_0"):
        F.dequantize_q4_0(q8)
    with pytest.raises(ValueError, match="multiple of 18"):
        F.as_blocks(np.zeros((2, 20), np.uint8), "q4_0")
    with pytest.raises(ValueError):
        F.as_blocks(np.zeros((2, 36), np.float32), "q8_1")
    with pytest.raises(ValueError, match="not a block format"):
        F.as_blocks(np.zeros((2, 36), np.uint8), "f32")


# --------------------------------------------------------------------------------------------
# NMSE sanity


def test_quantization_nmse_on_gaussian():
    seed = fresh_seed()
    x = np.random.default_rng(seed).standard_normal((64, 1024)).astype(F32)
    e4 = F.nmse(F.dequantize_q4_0(F.quantize_q4_0(x)), x)
    e8 = F.nmse(F.dequantize_q8_0(F.quantize_q8_0(x)), x)
    e81 = F.nmse(F.dequantize_q8_1(F.quantize_q8_1(x)), x)
    assert 3e-3 <= e4 <= 1.5e-2, f"seed={seed}: q4_0 nmse {e4}"
    assert 0 < e8 < 1e-4, f"seed={seed}: q8_0 nmse {e8}"
    assert 0 < e81 < 1e-4, f"seed={seed}: q8_1 nmse {e81}"
    assert e8 < e4 and math.isfinite(e81)


def test_blocks_given_as_a_list_are_refused_by_name():
    """.tolist() of blocks is a list of tuples that numpy cannot turn back into blocks: the error
    names the expected numpy array instead of numpy's 'inhomogeneous shape'."""
    w = F.quantize_q4_0(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="expected a numpy array of q4_0 blocks .*got list"):
        F.dequantize(w.tolist(), "q4_0")


def test_numeric_edge_audit_findings():
    """Session 34's audit of numerical edge cases (each assertion fails on the code before it)."""
    from qgemm import packing, reference as R

    rng = np.random.default_rng(fresh_seed())
    # Weights whose d x q passes half's range: the fp16 tensor-core paths would make them inf.
    w = rng.standard_normal((4, 64)).astype(F32)
    w[:, 0] = 70000
    wq8 = F.quantize_q8_0(w)
    assert F.f16_dequant_overflow(wq8, "q8_0") == (0, 0, float(wq8["d"][0, 0]))
    w4 = w.copy()
    w4[2, 40] = -70000  # row 2's second block
    w4[:, 0] = 1.0
    wq4 = F.quantize_q4_0(w4)
    assert F.f16_dequant_overflow(wq4, "q4_0")[:2] == (2, 1)
    assert F.f16_dequant_overflow(F.quantize_q8_0(rng.standard_normal((8, 256)).astype(F32)), "q8_0") is None
    big_d = F.quantize_q8_0(rng.standard_normal((1, 32)).astype(F32))
    big_d["d"] = 600.0
    big_d["qs"] = 100  # d x q = 60000: a large d whose weights still fit
    assert F.f16_dequant_overflow(big_d, "q8_0") is None
    big_d["qs"][0, 0, 7] = -110  # 66000
    assert F.f16_dequant_overflow(big_d, "q8_0") == (0, 0, 600.0)
    import qgemm

    x = np.ones((64, 64), F32)
    with pytest.raises(ValueError, match=r"w8a16\.mma dequantizes the weights to float16.*row 0, block 0.*'w8a8\.mma'"):
        qgemm.matmul(x, wq8)  # planned for fp16 MMA with or without a GPU: refused before anything launches
    with pytest.raises(ValueError, match=r"row 0, block 0.*float16's range.*int8 kernels"):
        qgemm.get("w8a16.mma")(x.astype(np.float16), wq8)
    with pytest.raises(ValueError, match=r"row 2, block 1"):
        qgemm.get("w4a16.mma")(x.astype(np.float16), wq4)
    if not qgemm.gpu_available():  # the GEMV and int8 kernels take them: past the check, to the GPU check
        with pytest.raises(qgemm.NoGPUError):
            qgemm.matmul(x[:4], wq8)
        with pytest.raises(qgemm.NoGPUError):
            qgemm.matmul(x, wq8, path="w8a8.mma")
    # dequantizers of zero rows (the quantizers already returned them)
    for fmt in ("q4_0", "q8_0", "q8_1"):
        assert F.dequantize(F.quantize(np.zeros((0, 64), F32), fmt), fmt).shape == (0, 64)
    assert F.unpack_q4_0(F.quantize_q4_0(np.zeros((0, 64), F32))).shape == (0, 64)
    # blocks too small for float32's 1/d: no numpy warnings, the bytes gguf's quantizers give
    tiny = np.zeros((4, 32), F32)
    tiny[0, 3], tiny[1, 5], tiny[2, 1], tiny[2, 2], tiny[3, 9] = 1e-38, -2e-39, 3e-44, -1e-45, 2.5e-38
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = {fmt: OURS_Q[fmt](tiny) for fmt in OURS_Q}
        q81 = F.quantize_q8_1(tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fmt in OURS_Q:
            assert raw(ours[fmt]).tobytes() == gguf.quants.quantize(tiny, GGUF_T[fmt]).tobytes()
    # Q8_1 blocks whose amax is subnormal (rows 0-2, below FLT_MIN = 1.18e-38; row 2's d is 0 in
    # float32, so x / d would be +-inf) are flushed, as llama.cpp's build does: all codes 0; row 3's
    # 2.5e-38 is normal
    assert q81["d"][2, 0] == 0 and not q81["qs"][:3].any()
    assert q81["qs"][3, 0, 9] == 127 and np.count_nonzero(q81["qs"][3]) == 1
    # the references refuse what would reach their integer casts as garbage
    with pytest.raises(ValueError, match="finite"):
        R.exact_w4a8s(np.full((1, 64), np.nan, F32), wq4)
    with pytest.raises(ValueError, match="finite"):
        R.quantize_rows_i8(np.full((1, 32), 1e300))
    with pytest.raises(ValueError, match=r"exact_w4a8: A must be 2-D"):
        R.exact_w4a8(F.quantize_q8_1(np.ones(64, F32)), wq4)
    with pytest.raises(ValueError, match=r"exact_w8a8: W must be 2-D"):
        R.exact_w8a8(F.quantize_q8_1(np.ones((1, 64), F32)), wq8[0])
    # packing.unpack: K a multiple of 32, uint8 bytes, positive sizes
    buf = packing.pack(F.quantize_q4_0(rng.standard_normal((16, 128)).astype(F32)), "q4_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        packing.unpack(buf, "q4_0", 16, 100)  # pads to the same 128: the size alone passed
    with pytest.raises(ValueError, match="uint8"):
        packing.unpack(buf.astype(np.int32), "q4_0", 16, 128)
    with pytest.raises(ValueError, match="positive integer"):
        packing.unpack(buf, "q4_0", -16, 128)
    # matmul: a 2-D x without rows says so, as a 3-D one does
    with pytest.raises(ValueError, match="no rows"):
        qgemm.matmul(np.zeros((0, 64), F32), wq8)


def test_inputs_the_session_69_audit_found(rng):
    """Each was a numpy error, a wrong reason or an unchecked result before."""
    x = rng.standard_normal((3, 64)).astype(np.float32)
    b = F.f32_to_bf16(x)  # qgemm's bfloat16 (the 2-byte void), which matmul takes: the host quantizers now too
    for quantize in (F.quantize_q4_0, F.quantize_q8_0, F.quantize_q8_1):
        assert quantize(b).tobytes() == quantize(F.bf16_to_f32(b)).tobytes()
    with pytest.raises(ValueError, match="expected a floating-point array"):
        F.quantize_q8_0(np.zeros((1, 32), np.int32))
    w = F.quantize_q4_0(x)
    with pytest.raises(ValueError, match="fmt must be 'q4_0' or 'q8_0'"):
        F.f16_dequant_overflow(w, "q8_1")
    with pytest.raises(ValueError, match=r"expected \[n, 32\]"):
        F.warp_sum_32(np.zeros((2, 31), np.float32))
    assert F.is_bf16("no-such-type") is False  # a name numpy does not know: not a numpy TypeError
    with pytest.raises(ValueError, match="must not be negative"):
        F.get_format("q4_0").nbytes(-2, 32)
