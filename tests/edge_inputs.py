"""Inputs at the edges of float32 that more than one test module builds (a plain module, not a test
file: test_gpu_kernels.py must not import test_formats.py, which skips itself without gguf)."""

import numpy as np

F32 = np.float32


def tiny_q8_1_blocks(rng, n=4000):
    """Blocks whose amax spans float32's subnormals up past FLT_MIN (log-uniform, 1e-45 .. 1e-36),
    with FLT_MIN itself and the subnormal just below it at both signs as the amax of eight more."""
    x = rng.standard_normal((n + 8, 32)).astype(F32)
    x /= np.abs(x).max(axis=1, keepdims=True)
    x[:n] *= (10.0 ** rng.uniform(-45, -36, n))[:, None].astype(F32)
    tiny = np.finfo(F32).tiny
    edge = np.array([tiny, np.nextafter(tiny, F32(0))], F32)
    x[n:] *= np.repeat(np.array([1, -1], F32), 4)[:, None] * np.tile(edge, 4)[:, None] * F32(0.999)
    x[n:, 5] = np.repeat(np.array([1, -1], F32), 4) * np.tile(edge, 4)  # the amax, exactly
    return x
