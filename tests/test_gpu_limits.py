"""Shapes at CUDA's limits.

Operands of more than 2^31 elements: an output C[M, N] or activations x[M, K] past the range of a
32-bit index. Every kernel computes its addresses in 64 bits (a row times its length as size_t); a
32-bit product would wrap past 2^31 and write or read the wrong rows -- a silent wrong answer, or a
fault. These run the production paths at such shapes (K or N small, so the work takes seconds),
check the rows past the 2^31st element against the exact reference, and check that every element
of the output was written (poisoned with NaN first).

More tokens than CUDA launches CTA rows (65535): the Q8_1 quantizers, the prologue of the int8
paths, had a CTA row per token (session 40 found it here: M > 65535 was refused).

Marked `gpu`; the two large ones need ~9-14 GB of free device memory and skip without it."""

import dataclasses

import numpy as np
import pytest

import qgemm
from qgemm import check, runtime

pytestmark = pytest.mark.gpu

GB = 1 << 30
M_BIG = 65600  # M x N (first test) and M x K (second) pass 2^31 from row 65520 / 65536 on


def free_device_bytes() -> int:
    from cuda.bindings import driver

    runtime.ensure_current()
    free, _total = runtime.check(driver.cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


def need(nbytes: int) -> None:
    if free_device_bytes() < nbytes + GB:
        pytest.skip(f"needs {nbytes / GB:.0f} GB of free device memory")


def rows_of(d: qgemm.DeviceArray, rows) -> np.ndarray:
    """Rows of a device [M, N] float32 array, each copied alone (the whole may not fit the host)."""
    n = d.shape[1]
    out = np.empty((len(rows), n), np.float32)
    for i, r in enumerate(rows):
        out[i] = qgemm.DeviceArray(d.ptr + int(r) * n * 4, (n,), np.float32, owner=d).to_host()
    return out


def count_nan(d: qgemm.DeviceArray, chunk_rows: int = 4096) -> int:
    """NaN elements of a device [M, N] float32 array, read back in chunks of rows."""
    m, n = d.shape
    bad = 0
    for r0 in range(0, m, chunk_rows):
        rows = min(chunk_rows, m - r0)
        part = qgemm.DeviceArray(d.ptr + r0 * n * 4, (rows, n), np.float32, owner=d).to_host()
        bad += int(np.isnan(part).sum())
    return bad


def check_rows(plan, x_rows: np.ndarray, w, got: np.ndarray, what: str) -> None:
    want = dataclasses.replace(plan, m=x_rows.shape[0]).reference(x_rows, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * float(np.abs(want).max()), err_msg=what)


def test_output_past_2_to_the_31_elements(rng):
    """C[65600, 32776] float32 (2^31 + 2.5 M elements) at K = 32, on the default path (ggml blocks
    and packed weights) and the sm_80 tensor-core kernels."""
    m, n, k = M_BIG, 32776, 32
    assert m * n > 2**31
    need(m * n * 4 + GB)
    x = rng.standard_normal((m, k), dtype=np.float32)
    wf = rng.standard_normal((n, k), dtype=np.float32)
    w = qgemm.quantize_q4_0(wf)
    dx = qgemm.DeviceArray.from_host(x)
    out = qgemm.DeviceArray.empty((m, n), np.float32)
    tail = np.arange((2**31) // n - 2, m)  # the rows that cross and lie past element 2^31
    probe = np.concatenate([[0, 1, m // 2], tail])
    dw = qgemm.DeviceArray.from_host(w.view(np.uint8))
    for weights, path in ((dw, None), (qgemm.pack_weights(w), None), (dw, "w4a16.mma"), (dw, "w4a8.mma")):
        packed = weights is not dw
        what = f"path={path or 'default'}{' packed' if packed else ''}"
        plan = qgemm.plan(m, n, k, "q4_0", path=path, packed=packed)
        out.fill_bytes(0xFF)  # NaN: every element must be written
        assert qgemm.matmul(dx, weights, "q4_0", path=path, out=out) is out
        runtime.synchronize()
        check_rows(plan, x[probe], w, rows_of(out, probe), f"{what} ({plan.kernel})")
        assert count_nan(out) == 0, f"{what}: elements left unwritten"


def test_activations_past_2_to_the_31_elements(rng):
    """x[65600, 32768] float32 (2^31 + 2.1 M elements) at N = 40: the prologue (convert.f16k, or
    quantize.q8_1) and the GEMM read rows past element 2^31. Row m of x is one value a_m, distinct
    between neighbouring rows, so a row read from the wrong place gives another result."""
    m, n, k = M_BIG, 40, 32768
    assert m * k > 2**31
    need(m * k * 4 + m * k * 2 + GB)
    a = (1.0 + (np.arange(m) % 997) / 997.0).astype(np.float32)
    dx = qgemm.DeviceArray.empty((m, k), np.float32)
    step = 2048
    for r0 in range(0, m, step):  # uploaded in parts: the whole x is 8.6 GB
        rows = min(step, m - r0)
        part = qgemm.DeviceArray(dx.ptr + r0 * k * 4, (rows, k), np.float32, owner=dx)
        part.copy_from_host(np.repeat(a[r0:r0 + rows, None], k, axis=1))
    wf = rng.standard_normal((n, k), dtype=np.float32)
    w = qgemm.quantize_q8_0(wf)
    out = qgemm.DeviceArray.empty((m, n), np.float32)
    probe = np.concatenate([[0, 1, m // 2], np.arange((2**31) // k - 2, m)])
    x_probe = np.repeat(a[probe, None], k, axis=1)
    dw = qgemm.DeviceArray.from_host(w.view(np.uint8))
    for weights, path in ((dw, None), (qgemm.pack_weights(w), None), (dw, "w8a8.mma")):
        packed = weights is not dw
        what = f"path={path or 'default'}{' packed' if packed else ''}"
        plan = qgemm.plan(m, n, k, "q8_0", path=path, packed=packed)
        out.fill_bytes(0xFF)
        assert qgemm.matmul(dx, weights, "q8_0", path=path, out=out) is out
        runtime.synchronize()
        got = rows_of(out, probe)
        check_rows(plan, x_probe, w, got, f"{what} ({plan.kernel}, {plan.quantizer})")
        assert count_nan(out) == 0, f"{what}: elements left unwritten"



@pytest.mark.parametrize("name", ["quantize.q8_1", "quantize.q8_1_f16"])
def test_quantizer_rows_past_the_grid(name):
    """The Q8_1 quantizers at M = 65535 x 2 + 7 (CUDA launches at most 65535 CTA rows along y: grid.z
    takes the rest, its last plane 7 tokens): byte-identical to the CPU quantizer, every block
    written (check.validate poisons the output)."""
    r = check.validate(qgemm.get(name), (2 * 65535 + 7, 1, 64))
    assert r.detail["mismatched_blocks"] == 0, f"seed {r.seed}: {r.note}"
    assert r.unwritten == 0
    assert r.passed
