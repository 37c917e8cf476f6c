"""A long-running process: an inference server calls qgemm.matmul and the KV-cache ops millions of
times. Every call's temporaries (uploads of host inputs, per-call repacking, staging scratch,
results copied back) must be freed or reused, so that memory stays level however long the process
runs. Device memory is what qgemm holds (runtime.allocated_bytes: its own cuMemAlloc / cuMemFree,
exact and private to this process -- cuMemGetInfo is not: the GPU suite runs several pytest
processes on one GPU); host memory the Python heap (tracemalloc: the host path's memos are per
shape, never per call).

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


def held_bytes() -> int:
    runtime.synchronize()
    gc.collect()  # arrays dropped in a reference cycle are freed here, not later
    return runtime.allocated_bytes()


def test_allocated_bytes_counts_allocations_and_frees():
    """The measure itself: an array counts its bytes until it is freed (by free(), or by dropping
    the last reference), views and wrappers count nothing."""
    before = held_bytes()
    a = qgemm.DeviceArray.empty((64 * MB + 3,), np.uint8)
    assert held_bytes() - before == 64 * MB + 3
    view = a.view(np.uint8).reshape(1, -1)
    b = qgemm.DeviceArray.from_host(np.zeros((1000, 10), np.float32))
    assert held_bytes() - before == 64 * MB + 3 + 40000
    a.free()
    assert held_bytes() - before == 40000 and view.freed
    del b
    assert held_bytes() == before


def test_repeated_calls_keep_device_memory_level(rng):
    """Every path a caller takes, repeated: matmul with host operands (decode on ggml blocks, prefill
    with the weights repacked per call where the GPU takes that path), device operands into a
    caller's `out`, weights packed and dropped, a qgemm CUDA graph made and dropped, the KV-cache
    ops on host and device caches. After one warm-up round (kernels loaded, scratch sized) further
    rounds must not hold one more device byte, and the Python heap must stay within 1 MB."""
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
        start, host_start = held_bytes(), tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            one_round()
        end, host_end = held_bytes(), tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert end == start, f"qgemm holds {(end - start) / MB:.2f} MB more device memory after 20 rounds"
    # the host side too: plans, launch configurations and stream wrappers are memoized per shape,
    # not per call (a call's results are dropped by the loop)
    assert host_end - host_start <= 1 * MB, f"Python heap grew by {(host_end - host_start) / MB:.2f} MB over 20 rounds"
