"""One-time repacking of ggml Q4_0 / Q8_0 weights into the layout the skinny kernels read.

ggml blocks are 18 (Q4_0) or 34 (Q8_0) bytes, so rows of blocks are only 2-byte aligned and a
kernel that reads them directly cannot use 16-byte loads. The *skinny* layout
(`w4a16.skinny`, `w8a16.skinny`; drawn out in docs/formats.md and cuda_src/common/skinny_f16.cuh)
separates the scales from the quants and orders the quants so that each lane of a warp loads
exactly the bytes of its MMA fragments, 16 at a time, 512 contiguous bytes per warp load:

    qs  [tiles of 16 rows][groups of 4 blocks][pieces][32 lanes][16 B]
        Q4_0: 2 pieces (h):      lane (g, t) of piece h holds qs word t of blocks 0..3, row 16T + g + 8h
        Q8_0: 4 pieces (h, p):   ... qs words t and t+4 of blocks 2p and 2p+1, row 16T + g + 8h
    d   [tiles][groups][8 (g)][8 halves]: d(row 16T + g + 8h, block 4G + j) at half 4h + j

Rows are padded to a multiple of 16 and blocks to a multiple of 4 with d = 0 and quants that
dequantize to exactly 0, so padding contributes exact zeros. The packed buffer is as large as the
blocks (plus padding): Q4_0 4096x4096 is 9.44 MB either way.

`pack(blocks, fmt)` / `unpack(buf, fmt, n, k)` are exact inverses (tested); `pack_weights`
uploads once and returns a `PackedWeights` that `qgemm.matmul` takes in place of the blocks.

The activations of the Hopper prefill kernels (`w4a16.wgmma_rs`, `w8a16.wgmma_rs`) have a layout
of their own, *kperm16*: fp16 [M, K] with k deinterleaved inside every 16 -- the 8 even k first,
then the 8 odd ones. A product is unchanged when both operands' k are permuted alike, and this
permutation makes lane (g, t)'s own skinny qs word its natural wgmma A fragment (docs/formats.md):
the prologue (`convert.f16k`) writes it at no extra cost, and the kernel needs no byte shuffle.
`kperm16` / `unkperm16` are the host versions (exact inverses).
"""

from __future__ import annotations

import time

import numpy as np

from . import formats as F
from . import runtime

LAYOUT = "skinny"
_PIECES = {"q4_0": 2, "q8_0": 4}
_QS_BYTES = {"q4_0": 16, "q8_0": 32}
_ZERO_QS = {"q4_0": 0x88, "q8_0": 0x00}  # nibble 8 -> 8 - 8 = 0; int8 0


def _chunks16(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim == 0 or a.shape[-1] % 16:
        raise ValueError(f"{what}: expected an array [..., K] with K a multiple of 16, got shape {a.shape}")
    return a


def kperm16(a: np.ndarray) -> np.ndarray:
    """[..., K] (K a multiple of 16) -> the same values with k deinterleaved inside every 16:
    position j < 8 of a 16-chunk holds k = 2j, position 8 + j holds k = 2j + 1."""
    a = _chunks16(a, "kperm16")
    c = a.reshape(a.shape[:-1] + (a.shape[-1] // 16, 8, 2))
    return np.ascontiguousarray(np.swapaxes(c, -1, -2)).reshape(a.shape)


def unkperm16(a: np.ndarray) -> np.ndarray:
    """The inverse of `kperm16`."""
    a = _chunks16(a, "unkperm16")
    c = a.reshape(a.shape[:-1] + (a.shape[-1] // 16, 2, 8))
    return np.ascontiguousarray(np.swapaxes(c, -1, -2)).reshape(a.shape)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded(n: int, k: int) -> tuple[int, int]:
    """(rows, blocks) after padding: rows to a multiple of 16, blocks to a multiple of 4."""
    return cdiv(n, 16) * 16, cdiv(k // F.QK, 4) * 4


def packed_nbytes(fmt: str, n: int, k: int) -> int:
    n16, nb4 = padded(n, k)
    return n16 * nb4 * (_QS_BYTES[fmt] + 2)


def scale_offset(fmt: str, n: int, k: int, row: int, blk: int) -> int:
    """Byte offset of d(row, blk) in the packed buffer of an [n, k] matrix (the d part's
    [tiles][groups][8 (g)][8 halves] order, d(16T + g + 8h, 4G + j) at half 4h + j)."""
    n16, nb4 = padded(n, k)
    T, r = divmod(row, 16)
    h, g = divmod(r, 8)
    G, j = divmod(blk, 4)
    return n16 * nb4 * _QS_BYTES[fmt] + 2 * (((T * (nb4 // 4) + G) * 8 + g) * 8 + 4 * h + j)


def _fmt(fmt) -> str:
    name = F.get_format(fmt, "the skinny layout").name
    if name not in _PIECES:
        raise ValueError(f"the skinny layout packs q4_0 or q8_0 weights, got {name}")
    return name


def pack(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """ggml blocks [N, K/32] -> the skinny layout as one uint8 buffer (drawn in the module
    docstring and docs/formats.md). ValueError unless `fmt` is q4_0 or q8_0 and the blocks are
    2-D blocks of it (or their raw uint8 bytes)."""
    fmt = _fmt(fmt)
    b = F.as_blocks(np.asarray(blocks), fmt, "pack: weights")
    if b.ndim != 2:
        raise ValueError(f"pack: weights must be 2-D [N, K/32] {fmt} blocks, got shape {b.shape}")
    n, nb = b.shape
    n16, nb4 = padded(n, nb * F.QK)
    tiles, groups = n16 // 16, nb4 // 4
    qb = _QS_BYTES[fmt]
    qs = np.full((n16, nb4, qb), _ZERO_QS[fmt], dtype=np.uint8)
    qs[:n, :nb] = b["qs"].view(np.uint8).reshape(n, nb, qb)
    d = np.zeros((n16, nb4), dtype=np.float16)
    d[:n, :nb] = b["d"]
    if fmt == "q4_0":
        # [T, h, g, G, j, t, byte] -> [T, G, h, g, t, j, byte]
        q = qs.reshape(tiles, 2, 8, groups, 4, 4, 4).transpose(0, 3, 1, 2, 5, 4, 6)
    else:
        # qs bytes of a block: [half s (words t / t+4), t, byte]; blocks j = 2p + jj
        # [T, h, g, G, p, jj, s, t, byte] -> [T, G, h, p, g, t, jj, s, byte]
        q = qs.reshape(tiles, 2, 8, groups, 2, 2, 2, 4, 4).transpose(0, 3, 1, 4, 2, 7, 5, 6, 8)
    dd = d.reshape(tiles, 2, 8, groups, 4).transpose(0, 3, 2, 1, 4)  # [T, G, g, h, j]
    return np.concatenate([np.ascontiguousarray(q).reshape(-1), np.ascontiguousarray(dd).reshape(-1).view(np.uint8)])


def unpack(buf: np.ndarray, fmt: str, n: int, k: int) -> np.ndarray:
    """The inverse of `pack`: the skinny buffer of an [N, K] matrix -> ggml blocks [N, K/32]."""
    fmt = _fmt(fmt)
    for what, v in (("n", n), ("k", k)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"unpack: {what} must be a positive integer, got {v!r}")
    if k % F.QK:  # the padded size would match K rounded up to 128: the blocks past K would be made up
        raise ValueError(f"unpack: k must be a multiple of {F.QK} (the block size), got {k}")
    buf = np.asarray(buf)
    if buf.dtype != np.uint8:  # a cast would reinterpret the values, not the bytes
        raise ValueError(f"unpack: the packed buffer must be uint8 bytes (as pack returns), got {buf.dtype}")
    buf = buf.reshape(-1)
    if buf.size != packed_nbytes(fmt, n, k):
        raise ValueError(f"unpack: a {n}x{k} {fmt} matrix packs to {packed_nbytes(fmt, n, k)} bytes, got {buf.size}")
    n16, nb4 = padded(n, k)
    tiles, groups, nb = n16 // 16, nb4 // 4, k // F.QK
    qb = _QS_BYTES[fmt]
    qpart, dpart = buf[: n16 * nb4 * qb], buf[n16 * nb4 * qb:]
    if fmt == "q4_0":
        qs = qpart.reshape(tiles, groups, 2, 8, 4, 4, 4).transpose(0, 2, 3, 1, 5, 4, 6).reshape(n16, nb4, qb)
    else:
        qs = qpart.reshape(tiles, groups, 2, 2, 8, 4, 2, 2, 4).transpose(0, 2, 4, 1, 3, 6, 7, 5, 8).reshape(n16, nb4, qb)
    d = dpart.view(np.float16).reshape(tiles, groups, 8, 2, 4).transpose(0, 3, 2, 1, 4).reshape(n16, nb4)
    # the padded size fits several shapes (n rounded up to 16, K/32 to 4): what is dropped must be the
    # padding pack writes (d = +0, quants that decode to 0), or the buffer was packed for another shape
    dbits = d.view(np.uint16)
    if (np.any(dbits[n:]) or np.any(dbits[:n, nb:]) or np.any(qs[n:] != _ZERO_QS[fmt])
            or np.any(qs[:n, nb:] != _ZERO_QS[fmt])):
        raise ValueError(f"unpack: the buffer holds data past a {n}x{k} {fmt} matrix (in rows {n}..{n16 - 1} or "
                         f"blocks {nb}..{nb4 - 1}, where pack writes only padding): it was packed for another shape")
    out = np.empty((n, nb), dtype=F.get_format(fmt).dtype)
    out["d"] = d[:n, :nb]
    out["qs"] = qs[:n, :nb].view(out.dtype["qs"].base).reshape(n, nb, qb)
    return out


class PackedWeights:
    """Weights prepared by `pack_weights` for `qgemm.matmul` (made once, at load; not constructed
    by hand). `.fmt`, `.n`, `.k`; `.shape` (N, K/32) as the blocks it came from; `.packed`: a
    DeviceArray in the decode kernels' "skinny" layout (docs/formats.md); `.blocks`: the ggml
    blocks on the device, for the paths that read those (your own device array when packed from
    one); `.pack_seconds`: the one-time cost (the upload of host blocks and the repacking on the
    GPU), reported apart from matmul times; `.nbytes`: both buffers. Single kernels (`qgemm.get`)
    take it with device activations."""

    def __init__(self, fmt: str, n: int, k: int, packed: runtime.DeviceArray, blocks: runtime.DeviceArray,
                 pack_seconds: float = 0.0, f16_overflow=None):
        self.fmt, self.n, self.k = fmt, n, k
        self.packed, self.blocks = packed, blocks
        self.pack_seconds = pack_seconds
        # (row, block, d) of a block whose weights overflow float16 (formats.f16_dequant_overflow),
        # found once at packing: matmul then refuses the fp16 tensor-core paths for these weights
        self.f16_overflow = f16_overflow

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K/32): the shape of the ggml blocks they were made from."""
        return (self.n, self.k // F.QK)

    @property
    def nbytes(self) -> int:
        """Device bytes of both copies (skinny layout and ggml blocks)."""
        return self.packed.nbytes + self.blocks.nbytes

    def __repr__(self) -> str:
        return (f"<PackedWeights {self.fmt} N={self.n} K={self.k}: {self.packed.nbytes / 1e6:.2f} MB skinny layout + "
                f"{self.blocks.nbytes / 1e6:.2f} MB ggml blocks, packed in {self.pack_seconds * 1e3:.1f} ms>")


def _float_weights(w, fmt, on_device: bool, stream=None):
    """(float weights [N, K] as a host or device array, the format to quantize them to), or None
    when `w` is not a float array (ggml blocks, raw bytes: `dispatch._weights` checks those).
    Host weights are checked here, before anything needs the GPU."""
    who = "pack_weights"
    if on_device:
        a = runtime.as_device_array(w, stream)
        if a.dtype.kind == "f" and a.dtype not in (np.float32, np.float16):
            raise ValueError(f"{who}: float weights on the device must be float32, float16 or bfloat16, got "
                             f"{runtime.dtype_name(a.dtype)} {a.shape}")
        if a.dtype not in (np.float32, np.float16) and not F.is_bf16(a.dtype):
            return None
    else:
        if isinstance(w, (list, tuple)):
            return None  # dispatch._weights says what it takes
        a = runtime.host_array(w, who, "the weights")
        if a.dtype.kind != "f" and not F.is_bf16(a.dtype):
            return None
    what = f"{runtime.dtype_name(a.dtype)} {a.shape}"
    if fmt is None:
        raise ValueError(f"{who}: float weights ({what}) need fmt='q4_0' or 'q8_0', the format to quantize them to")
    fmt = fmt.lower() if isinstance(fmt, str) else fmt
    if fmt not in ("q4_0", "q8_0"):
        raise ValueError(f"{who}: float weights are quantized to q4_0 or q8_0, got fmt={fmt!r}")
    if a.ndim != 2 or 0 in a.shape or a.shape[1] % F.QK:
        raise ValueError(f"{who}: float weights must be 2-D [N, K] with N >= 1 and K a positive multiple of {F.QK}, got {what}")
    if not on_device:
        if a.dtype != np.float16 and not F.is_bf16(a.dtype):
            a = F._as_blocks(a, who)[0].reshape(a.shape)  # float32 (ValueError past its range), finite
        elif not np.isfinite(F.to_float32(a)).all():
            raise ValueError(f"{who}: float weights must be finite; found inf or NaN")
        a = np.ascontiguousarray(a)
    return a, fmt


def _quantize_on_gpu(a, fmt: str, stream=None) -> runtime.DeviceArray:
    """Float weights [N, K] (host or device) -> ggml blocks [N, K/32] on the GPU, by the
    `quantize.<fmt>` kernel for their type (byte for byte formats.quantize of the values)."""
    from . import registry

    suffix = "_f16" if a.dtype == np.float16 else "_bf16" if F.is_bf16(a.dtype) else ""
    kernel = registry.get(f"quantize.{fmt}{suffix}")
    src = a if isinstance(a, runtime.DeviceArray) else runtime.DeviceArray.from_host(a)
    try:
        return kernel(src, stream=stream)
    except ValueError as e:  # e.g. inf / NaN, or a block scale past half: said as the caller's
        raise ValueError(f"pack_weights: quantizing the float weights: {e}") from None


def pack_weights(w, fmt: str | None = None, stream=None) -> PackedWeights:
    """ggml Q4_0 / Q8_0 blocks [N, K/32] (numpy, or a device array: torch, CuPy, DeviceArray) ->
    `PackedWeights` on the GPU, synchronously: a one-time cost at load (`.pack_seconds`), never
    paid per matmul; pack before any CUDA graph capture. The repacking runs on the GPU (the
    `pack.q4_0` / `pack.q8_0` kernels; host blocks are uploaded first, and both copies stay on
    the GPU: about twice the weight bytes). Device blocks are *not* copied -- the result keeps
    using your device array for the paths that read ggml blocks, so leave it unchanged. `fmt` as
    for `matmul` (raw uint8 bytes need it); `stream` orders a DLPack producer's pending work and
    runs the repacking. ValueError for weights `matmul` would refuse (a block scale that is not
    finite included), and during a CUDA graph capture; NoGPUError without a GPU (host weights are
    checked first).

    Float weights [N, K] (float32, float16 or bfloat16; host or device, e.g. an `nn.Linear`'s
    weight) with `fmt` "q4_0" or "q8_0" are first quantized on the GPU (`quantize.q4_0` /
    `quantize.q8_0` and their 16-bit forms): the same bytes as `qgemm.quantize(w, fmt)` of the
    values as float32, ggml's quantizer, in milliseconds where numpy takes seconds; the blocks
    are the result's `.blocks`, and `.pack_seconds` includes the quantization. ValueError for
    float weights that are not finite or whose block scale passes half's range."""
    from . import registry
    from .dispatch import _weights

    t0 = time.perf_counter()
    on_device = runtime.is_device_array(w) and not isinstance(w, np.ndarray)
    floats = None if on_device else _float_weights(w, fmt, False)
    if not on_device and floats is None:  # host blocks are checked before the GPU is: a bad input says so on any machine
        blocks, fmt = _weights(w, fmt, False, who="pack_weights")
    runtime.require_gpu("qgemm.pack_weights")
    runtime.prepare_call(stream, "pack_weights", "cannot run while a CUDA graph is being captured (it reads the "
                                                 "repacking's checks back); pack once, at load, before capturing")
    if on_device:
        floats = _float_weights(w, fmt, True, stream)
    if floats is not None:
        w, fmt = _quantize_on_gpu(floats[0], floats[1], stream), floats[1]
        on_device = True
    if on_device:
        blocks, fmt = _weights(w, fmt, True, stream, who="pack_weights")
    n, k = blocks.shape[0], blocks.shape[1] * F.QK
    kernel = registry.get(f"pack.{fmt}")
    kernel.check_launch(0, n, k)
    stream = runtime.launch_stream(stream)
    dblocks = blocks if on_device else runtime.DeviceArray.from_host(np.ascontiguousarray(blocks))
    packed = runtime.DeviceArray.empty((packed_nbytes(fmt, n, k),), np.uint8)
    # overflow: the first block whose d x q passes float16 (formats.f16_dequant_overflow's test)
    overflow, bad = kernel._repack_checked(dblocks, packed, n, k, stream=stream)
    if bad is not None:  # device blocks only: host ones were checked by _weights
        raise ValueError(f"pack_weights: weight block scales must be finite; row {bad[0]}, block {bad[1]} has d = {bad[2]}")
    return PackedWeights(fmt, n, k, packed, dblocks, time.perf_counter() - t0, f16_overflow=overflow)
