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

The Mustafar attention products on a compressed KV cache (qgemm.kvcache) are operators too:
`torch_ops.scores(q, ck)` (`torch.ops.qgemm.mustafar_scores`, as `kvcache.scores`) and
`torch_ops.attend(p, cv)` (`torch.ops.qgemm.mustafar_attend`, as `kvcache.attend`).

The operator runs `qgemm.matmul(x, weights, out=..., stream=torch.cuda.current_stream())`: the
same plan, kernels and results as the direct call, the output allocated by torch (its caching
allocator, and its CUDA-graph pools under `mode="reduce-overhead"`: the tests use the "cudagraphs"
backend, the same CUDA-graph trees). It has no backward: for
inference. Weights and caches reach the graph as integer handles (`handle`), since an operator
takes tensors and plain values only; a graph whose weights or cache were freed raises ValueError,
never reads freed memory. Importing this module imports torch, an optional dependency of qgemm.
"""

from __future__ import annotations

import copy
import itertools
import math
import threading
import weakref

import torch

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"qgemm.torch_ops needs torch >= 2.4 (torch.library.custom_op); this is torch {torch.__version__}")

from . import kvcache  # noqa: E402  (after the version check)
from .dispatch import matmul as _qgemm_matmul  # noqa: E402
from .packing import PackedWeights  # noqa: E402

__all__ = ["QuantLinear", "attend", "handle", "matmul", "scores"]

_CACHES = (kvcache.CompressedKV, kvcache.DeviceKV)
_weights: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()  # PackedWeights and caches
_handles = itertools.count(1)
_lock = threading.Lock()


def handle(weights) -> int:
    """The integer the operators take for `weights`: a qgemm.PackedWeights (for
    `torch.ops.qgemm.matmul`) or a compressed KV cache, `kvcache.CompressedKV` or its
    `to_device()` (for the Mustafar operators); given once per object, then the same. The
    operators look it up while the object lives: keep a reference (a QuantLinear holds its own)."""
    if not isinstance(weights, (PackedWeights,) + _CACHES):
        raise TypeError("qgemm.torch_ops: expected qgemm.PackedWeights (qgemm.pack_weights(w)) or a compressed KV cache "
                        f"(qgemm.kvcache.compress_keys / compress_values), got {type(weights).__name__}")
    with _lock:
        h = getattr(weights, "_torch_op_handle", None)
        if h is None or _weights.get(h) is not weights:  # none yet, or a copy's stale one
            h = next(_handles)
            weights._torch_op_handle = h
            _weights[h] = weights
    return h


def _handle_of(obj) -> int:
    """handle(obj), checked, when eager; inside a function being compiled, the handle obj was given
    before (dynamo reads the attribute as a constant, where it would trace the lock and dict)."""
    if torch.compiler.is_compiling():
        h = getattr(obj, "_torch_op_handle", None)
        if h is not None:
            return h
    return handle(obj)


def _lookup(h: int, op: str = "qgemm::matmul", kind: str | None = None):
    """The object of handle h: PackedWeights (kind None) or a compressed cache of that kind. In a
    fake implementation h can be a SymInt (dynamo makes an int that changed between calls
    dynamic, e.g. one compiled function called with two weights): int() specializes the graph on
    it, one graph per object, as their shapes differ anyway."""
    if isinstance(h, torch.SymInt):
        h = int(h)
    obj = _weights.get(h)
    what = "qgemm.PackedWeights" if kind is None else f"compressed {kind} cache"
    if obj is None:
        raise ValueError(f"{op}: handle {h} names no live {what} (freed, or not made by qgemm.torch_ops.handle): keep it "
                         "alive as long as the model or compiled graph using it")
    if (not isinstance(obj, PackedWeights)) if kind is None else getattr(obj, "kind", None) != kind:
        got = "qgemm.PackedWeights" if isinstance(obj, PackedWeights) else f"a compressed {obj.kind} cache"
        raise ValueError(f"{op}: handle {h} names {got}, expected a {what}")
    return obj


@torch.library.custom_op("qgemm::matmul", mutates_args=())
def _matmul_op(x: torch.Tensor, weights: int) -> torch.Tensor:
    pw = _lookup(weights)
    if x.device.type != "cuda":
        raise ValueError(f"qgemm::matmul: x must be a CUDA tensor, got one on {x.device}")
    # (detached: inside the operator an input can still require grad -- grad mode is off, the flag
    # is not -- and torch refuses the array interface of such a tensor)
    x = x.detach().contiguous()  # qgemm reads rows of K; a compiled graph may hand over another layout
    out = torch.empty((*x.shape[:-1], pw.n), device=x.device, dtype=torch.float32)
    _qgemm_matmul(x, pw, out=out, stream=torch.cuda.current_stream(x.device))
    return out


@_matmul_op.register_fake
def _matmul_fake(x: torch.Tensor, weights: int) -> torch.Tensor:
    pw = _lookup(weights)
    if x.dim() < 1 or x.shape[-1] != pw.k:
        raise ValueError(f"qgemm::matmul: x must be [..., K] with K = {pw.k} (the weights' K), got {tuple(x.shape)}")
    # what the operator refuses, refused while tracing too (a graph that can only fail when run)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"qgemm::matmul: activations must be float32, float16 or bfloat16 [..., K], got {x.dtype}")
    if math.prod(x.shape[:-1]) == 0:
        raise ValueError(f"qgemm::matmul: x of shape {tuple(x.shape)} has no rows (M = 0)")
    return x.new_empty((*x.shape[:-1], pw.n), dtype=torch.float32)


def matmul(x: torch.Tensor, weights: PackedWeights) -> torch.Tensor:
    """`torch.ops.qgemm.matmul(x, handle(weights))`: float32 [..., N] = x [..., K] . W^T, with
    x a CUDA tensor (float32, float16 or bfloat16) and W packed by `qgemm.pack_weights`. Inside a
    function compiled with `fullgraph=True`, give the weights their handle first (`handle(pw)`,
    or one eager call): dynamo then reads it as a constant instead of tracing the lock that
    assigns it."""
    return torch.ops.qgemm.matmul(x, _handle_of(weights))


def _attention_op(name: str, kind: str, out_dtype, last: int):
    """A Mustafar operator: x [B*groups, Lq, D or S] float16 and a cache handle -> [B*groups, Lq,
    shape[last]] of the cache (S for scores, D for attend) in out_dtype, by kvcache.scores / attend."""
    op = f"qgemm::{name}"
    run = kvcache.scores if kind == "key" else kvcache.attend

    @torch.library.custom_op(op, mutates_args=())
    def impl(x: torch.Tensor, cache: int) -> torch.Tensor:
        c = _lookup(cache, op, kind)
        if x.device.type != "cuda":
            raise ValueError(f"{op}: the {'queries' if kind == 'key' else 'probabilities'} must be a CUDA tensor, "
                             f"got one on {x.device}")
        x = x.detach().contiguous()  # (as in qgemm::matmul)
        out = torch.empty((*x.shape[:2], c.shape[last]), device=x.device, dtype=out_dtype)
        run(x, c, out=out, stream=torch.cuda.current_stream(x.device))
        return out

    @impl.register_fake
    def fake(x: torch.Tensor, cache: int) -> torch.Tensor:
        c = _lookup(cache, op, kind)
        width = c.shape[2] if kind == "key" else c.shape[1]  # queries have D columns, probabilities S
        if x.dim() != 3 or x.shape[2] != width or x.dtype != torch.float16:
            raise ValueError(f"{op}: expected float16 [B*groups, Lq, {width}] for a {kind} cache of shape "
                             f"{tuple(c.shape)}, got {x.dtype} {tuple(x.shape)}")
        if x.shape[0] == 0 or x.shape[1] == 0 or x.shape[0] % c.shape[0] != 0:
            raise ValueError(f"{op}: {x.shape[0]} heads x Lq={x.shape[1]} for a cache of B={c.shape[0]}: the heads must "
                             "be a positive multiple of B (B x num_key_value_groups) and Lq positive")
        return x.new_empty((*x.shape[:2], c.shape[last]), dtype=out_dtype)

    return impl


_scores_op = _attention_op("mustafar_scores", "key", torch.float16, 1)
_attend_op = _attention_op("mustafar_attend", "value", torch.float32, 2)


def scores(q: torch.Tensor, ck) -> torch.Tensor:
    """`torch.ops.qgemm.mustafar_scores(q, handle(ck))`: q . K^T on a compressed key cache, as
    `qgemm.kvcache.scores` -- q float16 [B*groups, Lq, D] on the GPU -> float16 [B*groups, Lq, S].
    Upload the cache (`ck.to_device()`) before capturing a CUDA graph; under `fullgraph=True` give
    it its handle first, as for `matmul`."""
    return torch.ops.qgemm.mustafar_scores(q, _handle_of(ck))


def attend(p: torch.Tensor, cv) -> torch.Tensor:
    """`torch.ops.qgemm.mustafar_attend(p, handle(cv))`: p . V on a compressed value cache, as
    `qgemm.kvcache.attend` -- p float16 [B*groups, Lq, S] on the GPU -> float32 [B*groups, Lq, D]."""
    return torch.ops.qgemm.mustafar_attend(p, _handle_of(cv))


def _qgemm_device() -> torch.device:
    """The CUDA device qgemm runs on (QGEMM_DEVICE), where host tensors go: torch's current
    device can be another."""
    from .runtime import device_ordinal

    return torch.device("cuda", device_ordinal())


class QuantLinear(torch.nn.Module):
    """`torch.nn.Linear` over ggml Q4_0 / Q8_0 weights: forward(x) =
    `torch.ops.qgemm.matmul(x, handle)` (+ bias), float32 [..., out_features]. `weights`: a
    qgemm.PackedWeights, or ggml blocks [N, K/32] (numpy or a device array; raw uint8 bytes need
    `fmt`) packed here once, or float weights [N, K] with `fmt` (quantized on the GPU by ggml's
    quantizer, then packed: `qgemm.pack_weights`). `bias`: None or [N] values, kept as a float32
    buffer on the GPU and added to the float32 product. The module holds the packed weights and
    the bias (they are not parameters: no state_dict, no gradient).
    `QuantLinear.from_linear(linear, fmt)` makes one from an `nn.Linear`."""

    def __init__(self, weights, fmt: str | None = None, bias=None):
        super().__init__()
        if not isinstance(weights, PackedWeights):
            from .packing import pack_weights

            weights = pack_weights(weights, fmt)
        elif fmt is not None and fmt != weights.fmt:
            raise ValueError(f"QuantLinear: fmt={fmt!r} but the packed weights are {weights.fmt}")
        self.weights = weights
        self.handle = handle(weights)
        self.in_features, self.out_features, self.fmt = weights.k, weights.n, weights.fmt
        if bias is not None:
            want = f"QuantLinear: bias must be {weights.n} finite float values (out_features)"
            try:
                bias = torch.as_tensor(bias).detach()
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"{want}, got {type(bias).__name__} ({e})") from None
            if bias.device.type == "meta":
                raise ValueError(f"{want}, got a meta tensor (it holds no values)")
            if bias.shape != (weights.n,) or not (bias.is_floating_point() and bias.isfinite().all()):
                raise ValueError(f"{want}, got {bias.dtype} {tuple(bias.shape)}")
            device = bias.device if bias.device.type == "cuda" or not torch.cuda.is_available() else _qgemm_device()
            bias = bias.to(device=device, dtype=torch.float32)
        self.register_buffer("bias", bias, persistent=False)  # (not in state_dict, as the weights are not)

    def _apply(self, fn, *args, **kwargs):
        # Module.to / .half() / .bfloat16() convert floating buffers; the bias stays float32 (added to
        # the float32 product), and only follows the device
        bias = self.bias
        out = super()._apply(fn, *args, **kwargs)
        if bias is not None and self.bias is not None and self.bias.dtype != torch.float32:
            self.bias = bias.to(device=self.bias.device)
        return out

    def __deepcopy__(self, memo):
        # a copy holds a copy of the weights, which needs a handle of its own (the handle is stored
        # here, and on the weights: copied as they are, both would name the original's weights)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        new.weights.__dict__.pop("_torch_op_handle", None)
        new.handle = handle(new.weights)
        return new

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str = "q4_0") -> "QuantLinear":
        """`linear` (an nn.Linear, its weight [out, in] float32 / float16 / bfloat16 on any device,
        in_features a multiple of 32) with its weight quantized to `fmt` ("q4_0" or "q8_0") by
        ggml's quantizer on the GPU -- the bytes `qgemm.quantize(weight, fmt)` gives -- and its
        bias, if any, kept in float32."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"QuantLinear.from_linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if w.device.type != "cuda":
            if not torch.cuda.is_available():
                from .runtime import require_gpu

                require_gpu("QuantLinear.from_linear")  # NoGPUError, saying why (torch may be CPU-only on a GPU machine)
                raise ValueError(f"QuantLinear.from_linear: the weight is on {w.device} and this torch has no CUDA")
            w = w.to(_qgemm_device())
        w = w.contiguous()
        return cls(w, fmt, bias=None if linear.bias is None else linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.qgemm.matmul(x, self.handle)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, bias={self.bias is not None}"
