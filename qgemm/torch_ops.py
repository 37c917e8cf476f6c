"""`qgemm.matmul` as a PyTorch operator: one opaque node for `torch.compile` (`fullgraph=True`
too) and torch's CUDA graphs.

Called directly inside a compiled function, `qgemm.matmul` works only through graph breaks:
dynamo traces into qgemm's Python (warning about its caches) until it meets what it cannot
trace, and `fullgraph=True` fails there ("Unsupported: torch.* op returned non-Tensor"; torch
2.11 on an H100, docs/perf/NOTES.md session 64). As the custom operator `torch.ops.qgemm.matmul`
the call is one node: dynamo and inductor see the shape and dtype of its result (its fake
implementation) and nothing inside.

    import torch, qgemm
    from qgemm import torch_ops

    layer = torch_ops.QuantLinear(qgemm.pack_weights(w))  # w: ggml Q4_0 / Q8_0 blocks [N, K/32]
    y = layer(x)                     # x: CUDA tensor [..., K] float32 / float16 / bfloat16 -> float32 [..., N]
    y = torch_ops.matmul(x, pw)      # the same, for a qgemm.PackedWeights held elsewhere
    fast = torch.compile(model, fullgraph=True)

The operator runs `qgemm.matmul(x, weights, out=..., stream=torch.cuda.current_stream())`: the
same plan, kernels and results as the direct call, the output allocated by torch (its caching
allocator, and its CUDA-graph pools under `mode="reduce-overhead"`: the tests use the "cudagraphs"
backend, the same CUDA-graph trees). It has no backward: for
inference. Weights reach the graph as an integer handle (`handle`), since an operator takes
tensors and plain values only; a graph whose weights were freed raises ValueError, never reads
freed memory. Importing this module imports torch, an optional dependency of qgemm.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"qgemm.torch_ops needs torch >= 2.4 (torch.library.custom_op); this is torch {torch.__version__}")

from .dispatch import matmul as _qgemm_matmul  # noqa: E402  (after the version check)
from .packing import PackedWeights  # noqa: E402

__all__ = ["QuantLinear", "handle", "matmul"]

_weights: "weakref.WeakValueDictionary[int, PackedWeights]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)
_lock = threading.Lock()


def handle(weights: PackedWeights) -> int:
    """The integer `torch.ops.qgemm.matmul` takes for `weights` (given once per PackedWeights,
    then the same). The operator looks it up while the PackedWeights lives; keep a reference (a
    QuantLinear holds its own)."""
    if not isinstance(weights, PackedWeights):
        raise TypeError(f"qgemm.torch_ops: expected qgemm.PackedWeights (qgemm.pack_weights(w)), got {type(weights).__name__}")
    with _lock:
        h = getattr(weights, "_torch_op_handle", None)
        if h is None:
            h = next(_handles)
            weights._torch_op_handle = h
            _weights[h] = weights
    return h


def _lookup(h: int) -> PackedWeights:
    pw = _weights.get(h)
    if pw is None:
        raise ValueError(f"qgemm::matmul: weights handle {h} names no live qgemm.PackedWeights (freed, or not made by "
                         "qgemm.torch_ops.handle): keep the weights alive as long as the model or compiled graph using them")
    return pw


@torch.library.custom_op("qgemm::matmul", mutates_args=())
def _matmul_op(x: torch.Tensor, weights: int) -> torch.Tensor:
    pw = _lookup(weights)
    if x.device.type != "cuda":
        raise ValueError(f"qgemm::matmul: x must be a CUDA tensor, got one on {x.device}")
    x = x.contiguous()  # qgemm reads rows of K; a compiled graph may hand over another layout
    out = torch.empty((*x.shape[:-1], pw.n), device=x.device, dtype=torch.float32)
    _qgemm_matmul(x, pw, out=out, stream=torch.cuda.current_stream(x.device))
    return out


@_matmul_op.register_fake
def _matmul_fake(x: torch.Tensor, weights: int) -> torch.Tensor:
    pw = _lookup(weights)
    if x.dim() < 1 or x.shape[-1] != pw.k:
        raise ValueError(f"qgemm::matmul: x must be [..., K] with K = {pw.k} (the weights' K), got {tuple(x.shape)}")
    return x.new_empty((*x.shape[:-1], pw.n), dtype=torch.float32)


def matmul(x: torch.Tensor, weights: PackedWeights) -> torch.Tensor:
    """`torch.ops.qgemm.matmul(x, handle(weights))`: float32 [..., N] = x [..., K] . W^T, with
    x a CUDA tensor (float32, float16 or bfloat16) and W packed by `qgemm.pack_weights`. Inside a
    function compiled with `fullgraph=True`, give the weights their handle first (`handle(pw)`,
    or one eager call): dynamo then reads it as a constant instead of tracing the lock that
    assigns it."""
    h = getattr(weights, "_torch_op_handle", None)
    return torch.ops.qgemm.matmul(x, h if h is not None else handle(weights))


class QuantLinear(torch.nn.Module):
    """`torch.nn.Linear` without bias over ggml Q4_0 / Q8_0 weights: forward(x) =
    `torch.ops.qgemm.matmul(x, handle)`, float32 [..., out_features]. `weights`: a
    qgemm.PackedWeights, or ggml blocks [N, K/32] (numpy or a device array; raw uint8 bytes need
    `fmt`) packed here once. The module holds the packed weights (they are not parameters: no
    state_dict, no gradient)."""

    def __init__(self, weights, fmt: str | None = None):
        super().__init__()
        if not isinstance(weights, PackedWeights):
            from .packing import pack_weights

            weights = pack_weights(weights, fmt)
        elif fmt is not None and fmt != weights.fmt:
            raise ValueError(f"QuantLinear: fmt={fmt!r} but the packed weights are {weights.fmt}")
        self.weights = weights
        self.handle = handle(weights)
        self.in_features, self.out_features, self.fmt = weights.k, weights.n, weights.fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.qgemm.matmul(x, self.handle)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"
