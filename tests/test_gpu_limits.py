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


def row_block(d: qgemm.DeviceArray, r0: int, rows: int) -> qgemm.DeviceArray:
    """Rows r0 .. r0 + rows of a device [M, N] array, as a view (no copy)."""
    n = d.shape[1]
    return qgemm.DeviceArray(d.ptr + int(r0) * n * d.dtype.itemsize, (rows, n), d.dtype, owner=d)


def count_nan(d: qgemm.DeviceArray, chunk_rows: int = 4096) -> int:
    """NaN elements of a device [M, N] float32 array, read back in chunks of rows (the whole may
    not fit the host)."""
    return sum(int(np.isnan(row_block(d, r0, min(chunk_rows, d.shape[0] - r0)).to_host()).sum())
               for r0 in range(0, d.shape[0], chunk_rows))


def check_paths(m, n, k, fmt, dx, w, probe, x_probe, paths) -> None:
    """matmul(dx, weights, path=) for each (weights, path): the output poisoned with NaN first,
    the `probe` rows (x_probe: their activations on the host) against the plan's exact reference,
    and no element left unwritten."""
    out = qgemm.DeviceArray.empty((m, n), np.float32)
    for weights, path in paths:
        packed = isinstance(weights, qgemm.PackedWeights)
        plan = qgemm.plan(m, n, k, fmt, path=path, packed=packed)
        what = f"path={path or 'default'}{' packed' if packed else ''} ({plan.kernel}, {plan.quantizer})"
        out.fill_bytes(0xFF)  # NaN: every element must be written
        assert qgemm.matmul(dx, weights, fmt, path=path, out=out) is out
        runtime.synchronize()
        got = np.concatenate([row_block(out, r, 1).to_host() for r in probe])
        want = dataclasses.replace(plan, m=len(probe)).reference(x_probe, w)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * float(np.abs(want).max()), err_msg=what)
        assert count_nan(out) == 0, f"{what}: elements left unwritten"


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
    tail = np.arange((2**31) // n - 2, m)  # the rows that cross and lie past element 2^31
    probe = np.concatenate([[0, 1, m // 2], tail])
    dw = qgemm.DeviceArray.from_host(w.view(np.uint8))
    check_paths(m, n, k, "q4_0", dx, w, probe, x[probe],
                [(dw, None), (qgemm.pack_weights(w), None), (dw, "w4a16.mma"), (dw, "w4a8.mma")])


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
        row_block(dx, r0, rows).copy_from_host(np.repeat(a[r0:r0 + rows, None], k, axis=1))
    wf = rng.standard_normal((n, k), dtype=np.float32)
    w = qgemm.quantize_q8_0(wf)
    probe = np.concatenate([[0, 1, m // 2], np.arange((2**31) // k - 2, m)])
    dw = qgemm.DeviceArray.from_host(w.view(np.uint8))
    check_paths(m, n, k, "q8_0", dx, w, probe, np.repeat(a[probe, None], k, axis=1),
                [(dw, None), (qgemm.pack_weights(w), None), (dw, "w8a8.mma")])


@pytest.mark.parametrize("name", ["quantize.q8_1", "quantize.q8_1_f16"])
def test_quantizer_rows_past_the_grid(name):
    """The Q8_1 quantizers at M = 65535 x 2 + 7 (CUDA launches at most 65535 CTA rows along y: grid.z
    takes the rest, its last plane 7 tokens): byte-identical to the CPU quantizer, every block
    written (check.validate poisons the output)."""
    r = check.validate(qgemm.get(name), (2 * 65535 + 7, 1, 64))
    assert r.detail["mismatched_blocks"] == 0, f"seed {r.seed}: {r.note}"
    assert r.unwritten == 0
    assert r.passed
