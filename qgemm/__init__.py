"""qgemm: llama.cpp-compatible quantized GEMM (Q4_0 / Q8_0 / Q8_1) on NVIDIA GPUs.

Kernels are CUDA sources under cuda_src/, compiled at run time by NVRTC for the GPU's exact
sm_XX (cached on disk) and launched through the CUDA driver API.

    import qgemm
    qgemm.list()                       # the registered kernels
    k = qgemm.get("w4a16.naive")
    c = k(a, w)                        # C[M,N] = A[M,K] . W[N,K]^T
"""

from . import formats, reference
from .errors import CompileError, CudaError, NoGPUError, QgemmError, SetupError, UnknownNameError, UnsupportedArchError
from .formats import (
    QK,
    block_q4_0,
    block_q8_0,
    block_q8_1,
    dequantize,
    dequantize_q4_0,
    dequantize_q8_0,
    dequantize_q8_1,
    quantize,
    quantize_q4_0,
    quantize_q8_0,
    quantize_q8_1,
)
from .dispatch import explain, matmul, plan
from .gguf_io import load_gguf
from .ops import Kernel, Op
from .packing import PackedWeights, pack_weights
from .registry import get, spec
from .runtime import DeviceArray, gpu_available

__version__ = "0.1.0"


def list(family: str | None = None):  # noqa: A001 - the card's API is qgemm.list()
    """Names of the registered kernels (optionally of one family, e.g. 'w4a16'), in registry order.
    An unknown family raises UnknownNameError (a KeyError and a ValueError) naming the families."""
    from .registry import list_kernels

    return [s.name for s in list_kernels(family=family)]


__all__ = [
    "QK", "block_q4_0", "block_q8_0", "block_q8_1", "quantize", "dequantize", "quantize_q4_0",
    "quantize_q8_0", "quantize_q8_1", "dequantize_q4_0", "dequantize_q8_0", "dequantize_q8_1",
    "formats", "reference", "get", "spec", "list", "Kernel", "Op", "DeviceArray", "gpu_available",
    "matmul", "explain", "plan", "load_gguf", "pack_weights", "PackedWeights",
    "CompileError", "CudaError", "NoGPUError", "QgemmError", "SetupError", "UnknownNameError", "UnsupportedArchError",
]
