"""A long-running process: an inference server calls qgemm.matmul and the KV-cache ops millions of
times. Every call's temporaries (uploads of host inputs, per-call repacking, staging scratch,
results copied back) must be freed or reused, so that device memory stays level however long the
process runs. Measured with cuMemGetInfo: qgemm allocates with plain cuMemAlloc / cuMemFree (no
pool keeps freed memory), so a leak shows as free memory falling round after round; host memory
with tracemalloc (the memos of the host path are per shape, never per call).

Marked `gpu`: skipped cleanly without one (CI)."""

import gc
import tracemalloc

import numpy as np
import pytest

import qgemm
from qgemm import kvcache as kv
from qgemm import runtime

pytestmark = pytest.mark.gpu

MB = 1 << 20


def free_device_bytes() -> int:
    from cuda.bindings import driver

    runtime.synchronize()
    gc.collect()  # arrays dropped in a reference cycle are freed here, not later
    runtime.ensure_current()
    free, _total = runtime.check(driver.cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


def test_free_device_bytes_sees_an_allocation():
    """The measure itself: a 64 MB array held shows as 64 MB less free memory, and its drop gives
    them back (otherwise the test below could not fail)."""
    before = free_device_bytes()
    a = qgemm.DeviceArray.empty((64 * MB,), np.uint8)
    held = free_device_bytes()
    del a
    after = free_device_bytes()
    assert before - held >= 64 * MB - 2 * MB, (before, held)
    assert abs(after - before) <= 2 * MB, (before, after)


def test_repeated_calls_keep_device_memory_level(rng):
    """Every path a caller takes, repeated: matmul with host operands (decode on ggml blocks, prefill
    with the weights repacked per call where the GPU takes that path), device operands into a
    caller's `out`, weights packed and dropped, a qgemm CUDA graph made and dropped, the KV-cache
    ops on host and device caches. After one warm-up round (kernels loaded, scratch sized) further
    rounds must not take device memory: 20 rounds of a 1 MB leak per call would be hundreds of MB."""
    n, k = 1024, 2048
    wf = rng.standard_normal((n, k), dtype=np.float32)
    w4, w8 = qgemm.quantize_q4_0(wf), qgemm.quantize_q8_0(wf)
    pw = qgemm.pack_weights(w8)
    dw8 = qgemm.DeviceArray.from_host(w8.view(np.uint8))
    x1 = rng.standard_normal((1, k), dtype=np.float32)
    x300 = rng.standard_normal((300, k), dtype=np.float32)
    dx8 = qgemm.DeviceArray.from_host(rng.standard_normal((8, k), dtype=np.float32))
    dout = qgemm.DeviceArray.empty((8, n), np.float32)
    dx64 = qgemm.DeviceArray.from_host(rng.standard_normal((64, k), dtype=np.float32))
    dout64 = qgemm.DeviceArray.empty((64, n), np.float32)
    b, s, d, g = 4, 1000, 128, 4
    cache = (rng.standard_normal((b, s, d), dtype=np.float32)).astype(np.float16)
    ck_host = kv.compress_keys(cache, 2, sparsity=0.7)
    cv_dev = kv.compress_values(cache, 16, sparsity=0.5).to_device()
    q = (rng.standard_normal((b * g, 1, d), dtype=np.float32) / 8).astype(np.float16)
    p = kv.random_probs(rng, (b * g, 1, s))
    stream = runtime.create_stream()

    def one_round():
        c1 = qgemm.matmul(x1, w4)
        c300 = qgemm.matmul(x300, w8)
        qgemm.matmul(dx8, pw, out=dout)
        fresh = qgemm.pack_weights(w4)
        c_fresh = qgemm.matmul(x1, fresh)
        del fresh
        graph = runtime.Graph(lambda: qgemm.matmul(dx64, dw8, fmt="q8_0", out=dout64, stream=stream), stream)
        graph.launch()
        runtime.synchronize(stream)
        del graph
        sc = kv.scores(q, ck_host)
        o = kv.attend(p, cv_dev)
        return c1, c300, c_fresh, sc, o

    first = one_round()
    for got in first:  # the round computes, so the loop below measures real calls
        assert np.isfinite(got).all() and np.abs(got).max() > 0
    scale = float(np.abs(first[0]).max())  # ggml blocks and packed weights: the same product, maybe other kernels
    np.testing.assert_allclose(first[0], first[2], rtol=0, atol=0.05 * scale)
    one_round()  # host memos filled, tracemalloc started after them
    tracemalloc.start()
    try:
        start, host_start = free_device_bytes(), tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            one_round()
        end, host_end = free_device_bytes(), tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert start - end <= 4 * MB, f"device memory fell by {(start - end) / MB:.1f} MB over 20 rounds"
    # the host side too: plans, launch configurations and stream wrappers are memoized per shape,
    # not per call (a call's results are dropped by the loop)
    assert host_end - host_start <= 1 * MB, f"Python heap grew by {(host_end - host_start) / MB:.2f} MB over 20 rounds"
