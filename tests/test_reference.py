"""CPU tests of qgemm.reference: the exact_* kernels' arithmetic against slow per-element loops,
the W4A8 compensation, block_sumi exactness and the error metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qgemm import formats as F
from qgemm import reference as R

import qgemm

F32 = np.float32


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**63))


# --------------------------------------------------------------------------------------------
# the debugging-story hand case


def test_w4a8_hand_case_is_141():
    d_a, s_a, d_w = 0.5, -8.0, 0.25
    q_a = list(range(-16, 16))  # -16, -15, ..., 15
    # stored nibbles 0,1,1,2,2,3,3,4,...,15,15 and then (31+1)//2 = 16, which does not fit in a
    # nibble: stored in 4 bits it wraps to 0. That wrap is what makes the story's sumi 1000
    # (with an unwrapped 16 it would be 1240 and the result 171).
    q_w = [((i + 1) // 2) & 0x0F for i in range(32)]
    assert q_w[:8] == [0, 1, 1, 2, 2, 3, 3, 4] and q_w[29:] == [15, 15, 0]
    assert all(0 <= v <= 15 for v in q_w)

    a = np.zeros((1, 1), F.block_q8_1)
    a["d"] = np.float16(d_a)
    a["s"] = np.float16(s_a)
    a["qs"][0, 0] = q_a
    w = np.zeros((1, 1), F.block_q4_0)
    w["d"] = np.float16(d_w)
    w["qs"][0, 0] = [q_w[j] | (q_w[j + 16] << 4) for j in range(16)]
    assert F.unpack_q4_0(w)[0].tolist() == q_w  # packing: j -> low nibble, j+16 -> high nibble

    # the arithmetic, by hand, from the inputs, in plain Python ints
    sumi = sum(int(qa) * int(qw) for qa, qw in zip(q_a, q_w))
    assert sumi == 1000
    # s_a is consistent with the quants: sum of d_a * q_a = 0.5 * -16 = -8
    assert d_a * sum(q_a) == s_a
    result = d_w * (d_a * sumi - 8 * s_a)
    assert result == 141.0

    got = R.exact_w4a8(a, w)
    assert got.shape == (1, 1)
    assert got[0, 0] == 141.0
    # without the compensation: d_w * d_a * sumi
    assert R.exact_w4a8_uncompensated(a, w)[0, 0] == d_w * d_a * sumi == 125.0
    # and the dequantized-operand view gives the same number: sum (d_a q_a) * (d_w (q_w - 8))
    deq = sum((d_a * qa) * (d_w * (qw - 8)) for qa, qw in zip(q_a, q_w))
    assert deq == 141.0
    # raw bytes are accepted too
    assert R.exact_w4a8(a.view(np.uint8).reshape(1, -1), w.view(np.uint8).reshape(1, -1))[0, 0] == 141.0


# --------------------------------------------------------------------------------------------
# exact_* against slow per-element loops


def slow_w4a8(a_blocks, w_blocks):
    m, nb = a_blocks.shape
    n = w_blocks.shape[0]
    out = np.zeros((m, n))
    for i in range(m):
        for j in range(n):
            acc = 0.0
            for b in range(nb):
                ab, wb = a_blocks[i, b], w_blocks[j, b]
                sumi = 0
                for e in range(32):
                    byte = int(wb["qs"][e % 16])
                    qw = (byte & 0x0F) if e < 16 else (byte >> 4)
                    sumi += int(ab["qs"][e]) * qw
                acc += float(wb["d"]) * (float(ab["d"]) * sumi - 8.0 * float(ab["s"]))
            out[i, j] = acc
    return out


def slow_w8a8(a_blocks, w_blocks):
    m, nb = a_blocks.shape
    n = w_blocks.shape[0]
    out = np.zeros((m, n))
    for i in range(m):
        for j in range(n):
            acc = 0.0
            for b in range(nb):
                ab, wb = a_blocks[i, b], w_blocks[j, b]
                sumi = sum(int(ab["qs"][e]) * int(wb["qs"][e]) for e in range(32))
                acc += float(wb["d"]) * float(ab["d"]) * sumi
            out[i, j] = acc
    return out


def slow_wxa16(a, w_blocks, fmt):
    a = np.asarray(a, dtype=np.float32)
    m, k = a.shape
    n, nb = w_blocks.shape
    out = np.zeros((m, n))
    for i in range(m):
        for j in range(n):
            acc = 0.0
            for b in range(nb):
                wb = w_blocks[j, b]
                d = float(wb["d"])
                for e in range(32):
                    if fmt == "q4_0":
                        byte = int(wb["qs"][e % 16])
                        q = ((byte & 0x0F) if e < 16 else (byte >> 4)) - 8
                    else:
                        q = int(wb["qs"][e])
                    acc += float(a[i, b * 32 + e]) * (d * q)
            out[i, j] = acc
    return out


def assert_close(got, ref, msg, rtol=1e-12):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, msg
    assert R.relative_error(got, ref) <= rtol, f"{msg}: relative error {R.relative_error(got, ref)}"
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * scale, err_msg=msg)


@pytest.fixture
def small_case():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    m, n, k = 3, 5, 96
    a = (rng.standard_normal((m, k)) * rng.uniform(0.1, 4, (m, 1))).astype(F32)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 4, (n, 1))).astype(F32)
    a[0, 32:64] += 3.0  # a block with a large sum, so the s_a term carries weight
    return seed, a, w


def test_exact_w4a8_matches_slow_loop(small_case):
    seed, a, w = small_case
    aq, wq = F.quantize_q8_1(a), F.quantize_q4_0(w)
    assert_close(R.exact_w4a8(aq, wq), slow_w4a8(aq, wq), f"w4a8 seed={seed}")


def test_exact_w8a8_matches_slow_loop(small_case):
    seed, a, w = small_case
    aq, wq = F.quantize_q8_1(a), F.quantize_q8_0(w)
    assert_close(R.exact_w8a8(aq, wq), slow_w8a8(aq, wq), f"w8a8 seed={seed}")


def test_exact_w4a16_matches_slow_loop(small_case):
    seed, a, w = small_case
    wq = F.quantize_q4_0(w)
    assert_close(R.exact_w4a16(a, wq), slow_wxa16(a, wq, "q4_0"), f"w4a16 seed={seed}")


def test_exact_w8a16_matches_slow_loop(small_case):
    seed, a, w = small_case
    wq = F.quantize_q8_0(w)
    assert_close(R.exact_w8a16(a, wq), slow_wxa16(a, wq, "q8_0"), f"w8a16 seed={seed}")


def test_exact_table_and_fp32():
    assert set(R.EXACT) == {"fp32", "w4a16", "w8a16", "w4a8", "w8a8", "w4a16h", "w8a16h", "w4a16s", "w8a16s", "w4a8s",
                            "w8a8s"}
    a = np.array([[1.0, 2.0, 3.0]], dtype=np.float64)
    w = np.array([[0.1, 0.2, 0.3], [1.0, 0.0, -1.0]])
    got = R.exact_fp32(a, w)
    ref = a.astype(F32).astype(np.float64) @ w.astype(F32).astype(np.float64).T
    assert np.array_equal(got, ref)
    assert got[0, 1] == -2.0


# --------------------------------------------------------------------------------------------
# the skinny int8 kernels' own activation quantization (float32 scale, round half to even)


def slow_quantize_rows_i8(a):
    """One value at a time in float32 scalars (what one GPU lane does)."""
    m, k = a.shape
    q = np.zeros((m, k // 32, 32), np.int8)
    d = np.zeros((m, k // 32), F32)
    inv127 = F32(float.fromhex("0x1.020408p-7"))
    assert inv127 == F32(1) / F32(127)  # the constant is fl32(1/127)
    for i in range(m):
        for b in range(k // 32):
            blk = a[i, 32 * b:32 * b + 32].astype(F32)
            amax = F32(0)
            for v in blk:
                amax = max(amax, F32(abs(v)))
            d[i, b] = F32(amax * inv127)
            inv = F32(F32(127) / amax) if amax >= F32(2.0 ** -118) else F32(0)
            for j, v in enumerate(blk):
                q[i, b, j] = int(np.rint(F32(v * inv)))
    return q, d


def test_quantize_rows_i8_matches_scalar_loop_and_edges():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((3, 256)) * rng.uniform(0.01, 100, (3, 1))).astype(F32)
    a[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    a[1, 32:64] = 1e-38  # amax below 2^-118: q = 0 (127 / amax would overflow)
    a[2, 64:96] = np.arange(32) - 15.5  # amax 16.5: several products land near .5
    a[2, 96] = 127 * 0.25  # with amax 127 * 0.5 below (127 / amax = 2): x * 2 = 63.5 exactly -> 64
    a[2, 97:128] = 0.0
    a[2, 97] = 127 * 0.5
    a[2, 98] = 1.25  # 2.5 -> 2, where ggml's roundf would give 3
    q, d = R.quantize_rows_i8(a)
    qs, ds = slow_quantize_rows_i8(a)
    assert np.array_equal(q, qs) and np.array_equal(d, ds), f"seed={seed}"
    assert d[0, 0] == 0 and not q[0, 0].any() and not q[1, 1].any()
    assert abs(d[2, 3] - 0.5) <= 1e-7 and q[2, 3, 0] == 64 and q[2, 3, 1] == 127 and q[2, 3, 2] == 2  # ties to even
    assert np.abs(q.astype(int)).max() <= 127
    # reconstruction within half a step where the block is representable
    recon = q.astype(F32) * d[..., None]
    ok = d >= np.finfo(F32).tiny
    err = np.abs(recon - a.reshape(3, 8, 32))[ok]
    assert (err <= 0.5001 * np.repeat(d[ok][:, None], 32, axis=1)).all(), f"seed={seed}"


def test_exact_skinny_int8_references_match_slow_loops(small_case):
    from qgemm import check, ops

    seed, a, w = small_case
    q, d = slow_quantize_rows_i8(a)
    for fmt, exact in (("q4_0", R.exact_w4a8s), ("q8_0", R.exact_w8a8s)):
        wq = F.quantize(w, fmt)
        wd = F.dequantize(wq, fmt).astype(np.float64)  # d_w (q - 8) or d_w q, exact
        # the per-block formula d_w d_a (sumi - 8 sum q_a) is the product of the dequantized operands
        slow = np.einsum("mbk,nbk->mn", q.astype(np.float64) * d.astype(np.float64)[..., None],
                         wd.reshape(w.shape[0], -1, 32))
        assert_close(exact(a, wq), slow, f"{fmt} seed={seed}")
        op = ops.W4A8S if fmt == "q4_0" else ops.W8A8S  # 15 outputs: the tolerance widens with few outputs
        assert F.nmse(exact(a, wq), R.truth(a, w)) <= check.nmse_tolerance(op, (a.shape[0], w.shape[0], a.shape[1])), \
            f"{fmt} seed={seed}"


# --------------------------------------------------------------------------------------------
# the compensation


def test_compensation_matters_on_gaussian_data():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    m, n, k = 16, 64, 1024
    a = rng.standard_normal((m, k)).astype(F32)
    w = rng.standard_normal((n, k)).astype(F32)
    aq, wq = F.quantize_q8_1(a), F.quantize_q4_0(w)
    ref = R.truth(a, w)
    good = F.nmse(R.exact_w4a8(aq, wq), ref)
    bad = F.nmse(R.exact_w4a8_uncompensated(aq, wq), ref)
    assert good < 2e-2, f"seed={seed}: compensated nmse {good}"
    assert bad > 0.5, f"seed={seed}: uncompensated nmse {bad}"
    # the compensated result is the product of the dequantized operands, up to s_a vs sum(d_a q_a)
    deq = R.truth(F.dequantize_q8_1(aq), F.dequantize_q4_0(wq))
    assert F.nmse(R.exact_w4a8(aq, wq), deq) < 1e-3, f"seed={seed}"


# --------------------------------------------------------------------------------------------
# block_sumi


def test_block_sumi_exact_at_extremes():
    m, n, nb = 2, 3, 5
    qa = np.empty((m, nb, 32), np.int8)
    qa[0] = -128
    qa[1] = 127
    qw = np.full((n, nb, 32), 15, np.uint8)
    qw[1, :, ::2] = 0
    qw[2, 2] = 7
    out = R.block_sumi(qa, qw)
    assert out.dtype == np.int64 and out.shape == (m, n, nb)
    for i in range(m):
        for j in range(n):
            for b in range(nb):
                ref = sum(int(qa[i, b, e]) * int(qw[j, b, e]) for e in range(32))
                assert out[i, j, b] == ref, (i, j, b)
    assert out[0, 0, 0] == -128 * 15 * 32 == -61440
    assert out[1, 0, 0] == 127 * 15 * 32 == 60960
    # the int8 x int8 extremes (|sumi| = 2^19) are exact too, with no int8/int16 overflow
    qa8 = np.full((1, 2, 32), -128, np.int8)
    qw8 = np.full((2, 2, 32), -128, np.int8)
    qw8[1] = 127
    out8 = R.block_sumi(qa8, qw8)
    assert out8[0, 0].tolist() == [2**19, 2**19]
    assert out8[0, 1].tolist() == [-128 * 127 * 32] * 2


def test_block_sumi_matches_integer_einsum_random():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    qa = rng.integers(-128, 128, (4, 7, 32)).astype(np.int8)
    qw = rng.integers(0, 16, (6, 7, 32)).astype(np.uint8)
    ref = np.einsum("mbe,nbe->mnb", qa.astype(np.int64), qw.astype(np.int64))
    assert np.array_equal(R.block_sumi(qa, qw), ref), f"seed={seed}"


# --------------------------------------------------------------------------------------------
# metrics


def test_relative_error_and_nmse_properties():
    seed = fresh_seed()
    x = np.random.default_rng(seed).standard_normal((7, 9))
    assert R.relative_error(x, x) == 0.0
    assert F.nmse(x, x) == 0.0
    assert R.relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert F.nmse(np.zeros(3), np.zeros(3)) == 0.0
    assert R.relative_error(np.ones(3), np.zeros(3)) == math.inf
    assert F.nmse(np.ones(3), np.zeros(3)) == math.inf
    # known values
    assert R.relative_error([3.0, 0.0], [0.0, 4.0]) == pytest.approx(5.0 / 4.0)
    assert F.nmse([3.0, 0.0], [0.0, 4.0]) == pytest.approx(25.0 / 16.0)
    assert R.relative_error(2 * x, x) == pytest.approx(1.0)
    assert F.nmse(1.1 * x, x) == pytest.approx(0.01)
    # nmse is the square of relative_error, both scale invariant, not symmetric
    y = x + 0.05 * np.random.default_rng(seed + 1).standard_normal(x.shape)
    assert F.nmse(y, x) == pytest.approx(R.relative_error(y, x) ** 2, rel=1e-12), f"seed={seed}"
    assert R.relative_error(1e3 * y, 1e3 * x) == pytest.approx(R.relative_error(y, x), rel=1e-12)
    assert R.relative_error(y, x) > 0
    assert R.relative_error(np.zeros(3), np.ones(3)) == pytest.approx(1.0)
    # computed in float64 even for float32 inputs
    a32 = np.array([1.0, 1.0 + 2**-20], dtype=F32)
    b32 = np.array([1.0, 1.0], dtype=F32)
    assert F.nmse(a32, b32) == pytest.approx(2.0**-40 / 2, rel=1e-12)


def test_fp16_dequant_reference_rounds_once():
    rng = np.random.default_rng()
    w = qgemm.quantize_q4_0(rng.standard_normal((3, 64), dtype=np.float32))
    h = R.dequantize_to_f16(w, "q4_0")
    exact = qgemm.dequantize_q4_0(w)  # float32 d*(q-8), exact
    assert h.dtype == np.float16 and np.array_equal(h, exact.astype(np.float16))
    w8 = qgemm.quantize_q8_0(rng.standard_normal((3, 64), dtype=np.float32))
    assert np.array_equal(R.dequantize_to_f16(w8, "q8_0"), qgemm.dequantize_q8_0(w8).astype(np.float16))
    a = rng.standard_normal((2, 64)).astype(np.float16)
    np.testing.assert_allclose(R.exact_w4a16h(a, w), a.astype(np.float64) @ h.astype(np.float64).T, rtol=1e-12)


@pytest.mark.parametrize("opname", ["w4a8", "w4a16", "w8a8"])
def test_nmse_tolerance_holds_for_single_outputs(opname):
    """A 1x1x4096 problem is one dot product: its quantization NMSE is chi-square(1) around the
    mean, so a tolerance that only counted K blocks failed ~3% of correct runs. Over many fresh
    draws the exact reference (what a correct kernel returns) must always pass. A single output
    cannot tell a quantization error from a lost quarter of K by NMSE (that is the exact check's
    job, which does), but a few hundred outputs can."""
    from qgemm import check, ops
    from qgemm import reference

    op = ops.OPS[opname]
    rng = np.random.default_rng(2024)

    def lose_quarter(inp, k):  # what a kernel that skips the last quarter of K would return
        k4 = k * 3 // 4
        return op.exact(inp.a[:, : k4 // op.a.block] if op.a.quantized else inp.a[:, :k4], inp.w[:, : k4 // op.w.block])

    shape = (1, 1, 4096)
    tol = check.nmse_tolerance(op, shape)
    for seed in range(300):
        inp = check.make_inputs(op, *shape, rng)
        exact = op.exact(inp.a, inp.w)
        truth = reference.truth(inp.a_float, inp.w_float)
        r = check.compare("ref", op, shape, seed, exact, exact, truth, inp.a_float, inp.w_float)
        assert r.passed and r.nmse < tol, (seed, r.nmse, tol)
        if seed < 10:
            bad = check.compare("bad", op, shape, seed, lose_quarter(inp, 4096), exact, truth, inp.a_float, inp.w_float)
            assert not bad.passed and bad.rel_err > op.exact_tol
    shape = (8, 64, 4096)
    inp = check.make_inputs(op, *shape, rng)
    part = lose_quarter(inp, 4096)
    bad = check.compare("bad", op, shape, 0, part, part, reference.truth(inp.a_float, inp.w_float), inp.a_float, inp.w_float)
    assert not bad.passed and bad.nmse > bad.nmse_tol  # by the NMSE alone


def test_references_refuse_operands_of_different_k():
    """A K mismatch between activations and weights is a ValueError naming both K, in every
    reference: before, the per-block formulas broadcast the scales of one operand over the
    other's blocks and returned a plausible wrong answer (A with fewer blocks than W), or failed
    deep inside numpy (more)."""
    from qgemm import dispatch

    rng = np.random.default_rng(5)
    a32, a64 = rng.standard_normal((4, 32), dtype=np.float32), rng.standard_normal((4, 64), dtype=np.float32)
    w32, w64 = rng.standard_normal((8, 32), dtype=np.float32), rng.standard_normal((8, 64), dtype=np.float32)
    for a, w in ((a32, w64), (a64, w32)):
        ka, kw = a.shape[1], w.shape[1]
        cases = [
            lambda: R.exact_w4a8(F.quantize_q8_1(a), F.quantize_q4_0(w)),
            lambda: R.exact_w8a8(F.quantize_q8_1(a), F.quantize_q8_0(w)),
            lambda: R.exact_w4a8s(a, F.quantize_q4_0(w)),
            lambda: R.exact_w8a8s(a, F.quantize_q8_0(w)),
            lambda: R.exact_w4a8_uncompensated(F.quantize_q8_1(a), F.quantize_q4_0(w)),
            lambda: R.exact_w4a16(a, F.quantize_q4_0(w)),
            lambda: R.exact_w8a16h(a.astype(np.float16), F.quantize_q8_0(w)),
            lambda: R.truth(a, w),
        ]
        for case in cases:
            with pytest.raises(ValueError, match=f"K mismatch: A has K={ka}, W has K={kw}"):
                case()
    with pytest.raises(ValueError, match=r"x must be \[M, K\] = \[4, 64\] for this plan, got shape \(4, 32\)"):
        dispatch.plan(4, 8, 64, arch="sm_90").reference(a32, F.quantize_q4_0(w64))
    with pytest.raises(ValueError, match="K a multiple of 32"):
        R.quantize_rows_i8(np.ones((2, 48), np.float32))


def test_weights_of_another_rank_or_n_are_refused(rng):
    """dequantize_to_f16 (so exact_w4a16h / exact_w8a16h) read a 1-D row of Q8_0 blocks as rows of
    K = 32 and answered with the wrong shape; Plan.reference took weights of another N; a 0-d
    block array raised IndexError in dequantize."""
    x16 = np.ones((3, 64), np.float16)
    for fmt, ref in (("q4_0", R.exact_w4a16h), ("q8_0", R.exact_w8a16h)):
        w = qgemm.quantize(rng.standard_normal((5, 64), dtype=np.float32), fmt)
        assert ref(x16, w).shape == (3, 5)
        for bad in (w[0], w.reshape(1, 5, 2)):
            with pytest.raises(ValueError, match=r"dequantize_to_f16: W must be 2-D \[rows, K/32\]"):
                ref(x16, bad)
        for one in (w[0, 0], w[0, 0, ...]):  # a numpy.void block and a 0-d array of one
            with pytest.raises(ValueError, match="got a 0-d block; a single block is shape"):
                qgemm.dequantize(one, fmt)
        assert qgemm.dequantize(w[0, :1], fmt).shape == (32,)
    p = qgemm.plan(2, 5, 64)
    w = qgemm.quantize_q4_0(rng.standard_normal((5, 64), dtype=np.float32))
    x = rng.standard_normal((2, 64), dtype=np.float32)
    assert p.reference(x, w).shape == (2, 5)
    with pytest.raises(ValueError, match=r"plan.reference: w must be q4_0 blocks \[N, K/32\] = \[5, 2\].*got shape \(4, 2\)"):
        p.reference(x, w[:4])


def test_reference_inputs_the_session_69_audit_found():
    """truth() on quantized blocks was a numpy casting TypeError; dequantize_to_f16 with a format
    other than the weights' named the bad format as the expected one."""
    x = np.ones((2, 64), np.float32)
    w = F.quantize_q4_0(x)
    with pytest.raises(ValueError, match="quantized blocks: dequantize them first"):
        R.truth(x, w)
    assert R.truth(F.f32_to_bf16(x), x)[0, 0] == 64.0  # bfloat16 (exactly float32) is a float matrix
    with pytest.raises(ValueError, match="fmt must be 'q4_0' or 'q8_0'"):
        R.dequantize_to_f16(w, "q8_1")
