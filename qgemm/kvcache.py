"""Mustafar: bitmap-sparse (and 4/2-bit quantized) KV cache, its numpy references, and the
device side of the `mustafar.*` kernels (upload, launch, validate, profile).

A KV cache is [B, S, D] float16: B = batch x kv-heads, S = tokens, D = head dim (64, 128 or 256).
`prune(x, sparsity)` zeroes the smallest-magnitude entries of every token (per-token magnitude
pruning, the Mustafar scheme); `compress_keys` / `compress_values` store what is left as tiles of
64 elements with a 64-bit occupancy bitmap (bit i <-> element i of the tile):

    keys    tile t = token s * (D/64) + j   elements = K[s, 64j : 64j+64]        (K^T column-major)
    values  tile t = dim d * ceil(S/64) + u  elements = V[64u : 64u+64, d]       (V^T row-major;
            tokens >= S of the last tile of a row are padding, their bits are 0)

so the key kernel reads whole tokens (a dot product with the query per token) and the value
kernel whole runs of tokens of one channel (a dot product with the probabilities per channel).

bits = 16: `counts [B, T+1] int32` (index of each tile's first value in `values`, then the end;
           continuous across batches) and `values float16 [N]` (the non-zeros, tile by tile).
bits = 4 / 2: `offsets [B, T] int32` (byte offset of each tile's codes in `packed`), `packed uint8`
           (each tile's codes from a byte boundary, ceil(n * bits / 8) bytes, value k of the tile
           in bits [k*bits, (k+1)*bits) counted from the low bit of the first byte:
           q0 | q1 << 2 | q2 << 4 | q3 << 6 for 2-bit), `scales`, `zeros [B, T] float32` (asymmetric
           min-max over the tile's non-zeros: x ~ (q - zero) * scale, zero in code units).
compact (bits 4 / 2, an extra layout): `dq [B, T, 2] float16` (the two fp16 constants the kernels
           dequantize with, see below: bit-identical values, half the bytes of scale + zero) and
           `group_offsets [B, G+1] int32`: the byte offset of every group of 16 consecutive tiles of
           a tile row (keys: one row of T tiles; values: one row per channel), then the end; the
           kernels recover each tile's offset from the bitmaps' popcounts.

Dequantization (the kernels' arithmetic, reproduced exactly by `decompress`, but for the value
channels the device scales, below): with L = 2**bits,
    mult = fp16(L * scale),  add = fp16(fp32(-zero * scale) - L * scale)
    value = fp16(h * mult + add),  h = 1 + q / L   (an fp16 built from the code's bits; one rounding)
which is (q - zero) * scale up to the rounding of the two fp16 constants.

The device copy of a value cache (to_device) holds each channel whose values all lie below 1 in
magnitude times the power of two that puts its largest in [1, 2) (channel_exponents), and the
value kernels multiply that channel's fp32 sums back: their half2 word sums then keep their
precision however small the cache's values are (kernel_values: what they hold, scaled back).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

import numpy as np

TILE = 64
# tiles per compact group offset (a warp step -- STEP_LANES tiles of a value channel, STEP_LANES x
# D/64 of keys -- is a whole number of groups)
GROUP = 16
BITS = (16, 4, 2)
HEAD_DIMS = (64, 128, 256)
KINDS = ("key", "value")
_FP16_MAX = 65504.0


# ---------------------------------------------------------------------------------------------
# input checks


def _masked_refusal(x, what: str) -> None:
    """A numpy masked array hides its masked entries from the finiteness checks (np.isfinite(m).all()
    ignores them), while the kernels and np.asarray read the data under the mask."""
    if isinstance(x, np.ma.MaskedArray):
        raise ValueError(f"{what} is a numpy masked array; pass plain data (x.filled(0) to zero the masked entries, "
                         "or np.ma.getdata(x) to keep them)")


def _check_cache(x, what: str = "cache") -> np.ndarray:
    _masked_refusal(x, what)
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{what} must be a numpy float16 array [B, S, D], got {type(x).__name__}")
    if x.dtype != np.float16:
        raise ValueError(f"{what} must be float16 [B, S, D] (the KV cache dtype), got {x.dtype} {x.shape}")
    if x.ndim != 3 or min(x.shape) <= 0:
        raise ValueError(f"{what} must be 3-D [B, S, D] with positive sizes, got shape {x.shape}")
    if x.shape[2] not in HEAD_DIMS:
        raise ValueError(f"{what}: head dim D must be one of {HEAD_DIMS}, got D={x.shape[2]}")
    if not np.isfinite(x).all():
        raise ValueError(f"{what} must be finite (found inf or NaN)")
    return np.ascontiguousarray(x)


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return int(bits)


def _check_sparsity(sparsity) -> float:
    if isinstance(sparsity, (str, bytes)):  # float("0.5") would take it
        raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
    try:
        s = float(sparsity)
    except (TypeError, ValueError):
        raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}") from None
    if not (0.0 <= s < 1.0) or isinstance(sparsity, (bool, np.bool_)):
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity!r}")
    return s


def kept_per_token(d: int, sparsity: float) -> int:
    """How many of a token's D values prune() keeps: D - round(sparsity * D) (at least 1).
    ValueError for a D that is not a positive int or a sparsity not in [0, 1)."""
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"kept_per_token: D must be a positive int (the head dim), got {d!r}")
    return max(1, int(d) - int(round(_check_sparsity(sparsity) * d)))


# ---------------------------------------------------------------------------------------------
# pruning


def prune(x: np.ndarray, sparsity: float) -> np.ndarray:
    """Per-token magnitude pruning: in every [b, s, :] keep the max(1, D - round(sparsity * D))
    entries of largest magnitude (`kept_per_token`; Python's round, halves to even), zero the rest
    (ties broken by position). float16 in, float16 out.
    ValueError for a cache that is not finite float16 [B, S, D] with D in 64 / 128 / 256, or a
    sparsity not in [0, 1)."""
    x = _check_cache(x)
    sparsity = _check_sparsity(sparsity)
    b, s, d = x.shape
    keep = kept_per_token(d, sparsity)
    if keep >= d:
        return x.copy()
    rows = x.reshape(-1, d)
    out = np.zeros_like(rows)
    step = max(1, (1 << 22) // d)  # bounded temporaries on big caches
    for i in range(0, rows.shape[0], step):
        r = rows[i:i + step]
        mag = np.abs(r.astype(np.float32))
        # the keep-th largest magnitude; all above it stay, and of those equal to it the first by
        # position (argpartition alone breaks ties in no defined order)
        thr = -np.partition(-mag, keep - 1, axis=1)[:, keep - 1:keep]
        above = mag > thr
        tie = mag == thr
        room = keep - above.sum(axis=1, keepdims=True)
        kept = above | (tie & (np.cumsum(tie, axis=1) <= room))
        out[i:i + step] = np.where(kept, r, np.float16(0))
    return out.reshape(b, s, d)


# ---------------------------------------------------------------------------------------------
# tiles


def num_tiles(kind: str, s: int, d: int) -> int:
    return s * (d // TILE) if kind == "key" else d * (-(-s // TILE))


def to_tiles(x: np.ndarray, kind: str) -> np.ndarray:
    """[B, S, D] -> [B, T, 64] in the kind's tile order (values: tokens padded with zeros)."""
    b, s, d = x.shape
    if kind == "key":
        return x.reshape(b, s * d // TILE, TILE)
    nst = -(-s // TILE)
    vt = np.zeros((b, d, nst * TILE), dtype=x.dtype)
    vt[:, :, :s] = x.transpose(0, 2, 1)
    return vt.reshape(b, d * nst, TILE)


def from_tiles(t: np.ndarray, kind: str, s: int, d: int) -> np.ndarray:
    b = t.shape[0]
    if kind == "key":
        return t.reshape(b, s, d)
    nst = -(-s // TILE)
    return np.ascontiguousarray(t.reshape(b, d, nst * TILE)[:, :, :s].transpose(0, 2, 1))


def _bit_weights() -> np.ndarray:
    return np.left_shift(np.uint64(1), np.arange(TILE, dtype=np.uint64))


def bitmaps_of(tiles: np.ndarray) -> np.ndarray:
    """[B, T, 64] -> int64 [B, T]: bit i set where element i is non-zero."""
    nz = tiles != 0
    return np.bitwise_or.reduce(np.where(nz, _bit_weights(), np.uint64(0)), axis=-1).view(np.int64)


def popcount(bitmaps: np.ndarray) -> np.ndarray:
    return np.bitwise_count(np.asarray(bitmaps).view(np.uint64)).astype(np.int64)


def density(ck) -> float:
    """The fraction of the cache's elements that are stored (1 - its sparsity)."""
    if not isinstance(ck, CompressedKV):
        raise ValueError(f"expected a CompressedKV (from compress_keys / compress_values), got {type(ck).__name__}")
    b, s, d = ck.shape
    return float(popcount(ck.parts()["bitmaps"]).sum()) / max(1, b * s * d)


def unpack_bits(bitmaps: np.ndarray) -> np.ndarray:
    """int64 [...] -> bool [..., 64] (element i of the tile)."""
    u = np.asarray(bitmaps).view(np.uint64)
    return ((u[..., None] >> np.arange(TILE, dtype=np.uint64)) & np.uint64(1)).astype(bool)


def tile_nbytes(n: np.ndarray, bits: int) -> np.ndarray:
    return (np.asarray(n, dtype=np.int64) * bits + 7) // 8


def group_starts(kind: str, s: int, d: int) -> np.ndarray:
    """First tile of each compact group: 16 consecutive tiles of one tile row (keys: the whole
    [T] is one row; values: one row per channel, ceil(S/64) tiles), as the kernels' warp steps."""
    row = num_tiles(kind, s, d) if kind == "key" else -(-s // TILE)
    rows = 1 if kind == "key" else d
    per = -(-row // GROUP)
    return (np.arange(rows)[:, None] * row + np.arange(per)[None, :] * GROUP).ravel()


# ---------------------------------------------------------------------------------------------
# the compressed form


@dataclass(eq=False)  # identity equality: a field-wise == would compare arrays (ambiguous truth value)
class CompressedKV:
    """A compressed key or value cache (the layout: qgemm/kvcache.py's module docstring and
    docs/mustafar.md; made by compress_keys / compress_values). Its device copy
    (to_device) belongs to this object alone: dataclasses.replace(), copy and pickle leave it
    behind (a copy that changed a part would otherwise launch on the old upload)."""

    kind: str
    bits: int
    shape: tuple
    bitmaps: np.ndarray
    counts: np.ndarray | None = None
    values: np.ndarray | None = None
    offsets: np.ndarray | None = None
    packed: np.ndarray | None = None
    scales: np.ndarray | None = None
    zeros: np.ndarray | None = None
    dq: np.ndarray | None = None
    group_offsets: np.ndarray | None = None
    _device: object = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:  # copy.copy / deepcopy / pickle: the host parts only
        state = dict(self.__dict__)
        state["_device"] = None
        state.pop("_torch_op_handle", None)  # qgemm.torch_ops' handle names this object only
        return state

    @property
    def compact(self) -> bool:
        """Whether this is the compact 4/2-bit layout (dq and group_offsets instead of scales,
        zeros and offsets)."""
        return self.dq is not None

    @property
    def tiles(self) -> int:
        """T, the number of 64-element tiles per kv head (a row of `bitmaps`)."""
        return int(self.bitmaps.shape[1])

    def parts(self) -> dict:
        """The layout's arrays by name (the ones `nbytes` counts and the kernels read). ValueError
        for an object whose bits or parts are not a layout's (validate_compressed checks the rest)."""
        if isinstance(self.bits, (bool, np.bool_)) or not isinstance(self.bits, (int, np.integer)) or self.bits not in BITS:
            raise ValueError(f"not a compressed cache: bits must be one of {BITS}, got {self.bits!r}")
        names = ["bitmaps"] + (["counts", "values"] if self.bits == 16 else
                               (["group_offsets", "packed", "dq"] if self.compact else ["offsets", "packed", "scales", "zeros"]))
        parts = {n: getattr(self, n) for n in names}
        for n, a in parts.items():
            if not isinstance(a, np.ndarray):
                raise ValueError(f"not a compressed cache: its {n} must be a numpy array, got {type(a).__name__}")
        return parts

    def breakdown(self) -> dict:
        """Bytes per part, e.g. {'bitmaps': ..., 'offsets': ..., 'packed': ..., 'scales': ..., 'zeros': ...}."""
        return {n: int(a.nbytes) for n, a in self.parts().items()}

    @property
    def nbytes(self) -> int:
        """All bytes of the compressed form, metadata included."""
        return sum(self.breakdown().values())

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense float16 cache [B, S, D]."""
        b, s, d = self.shape
        return b * s * d * 2

    @property
    def ratio(self) -> float:
        """nbytes / dense float16 bytes."""
        return self.nbytes / self.dense_nbytes

    @property
    def nnz(self) -> int:
        """Number of stored (non-zero) elements."""
        return int(popcount(self.bitmaps).sum())

    @property
    def layout(self) -> str:
        """The layout's name, "fp16", "q4", "q2", "q4c" or "q2c": the suffix of the `mustafar.*`
        kernels that take it."""
        return "fp16" if self.bits == 16 else f"q{self.bits}" + ("c" if self.compact else "")

    def __repr__(self) -> str:
        try:
            b, s, d = self.shape
            return (f"<CompressedKV {self.kind} {self.layout} [B={b}, S={s}, D={d}]: {self.nbytes} bytes "
                    f"({100 * self.ratio:.1f}% of dense fp16), {self.nnz} non-zeros>")
        except Exception:  # printing a damaged cache while debugging it must not raise
            try:
                validate_compressed(self)
                why = "its parts cannot be summed"
            except Exception as e:
                why = str(e)
            return f"<CompressedKV {self.kind!r} bits={self.bits!r} shape={self.shape!r}: not a valid compressed cache ({why})>"

    def validate(self) -> "CompressedKV":
        """validate_compressed(self) (ValueError unless the parts agree), then self."""
        validate_compressed(self)
        return self

    def to_device(self):
        """Validate, then upload once (memoized, once however many threads ask): the kernels'
        operand. After the device copy's free(), the next call uploads a new one."""
        with _upload_lock:
            if not self.on_device:
                self._device = DeviceKV.upload(self)
            return self._device

    @property
    def on_device(self) -> bool:
        """Whether to_device() has an upload to return without copying (what a CUDA graph capture needs)."""
        return self._device is not None and not self._device.freed


_upload_lock = threading.Lock()


def _quantize_tiles(tiles: np.ndarray, bits: int):
    """Min-max asymmetric quantization over each tile's non-zeros -> codes (in element order),
    scales, zeros (float32)."""
    levels = (1 << bits) - 1
    xf = tiles.astype(np.float32)
    nz = tiles != 0
    big = np.float32(np.inf)
    mn = np.where(nz, xf, big).min(axis=-1)
    mx = np.where(nz, xf, -big).max(axis=-1)
    has = nz.any(axis=-1)
    mn = np.where(has, mn, 0).astype(np.float32)
    mx = np.where(has, mx, 0).astype(np.float32)
    rng = mx - mn
    # A tile whose non-zeros are all one value v (a single non-zero, say: the last tile of a value
    # channel when S % 64 is small) has no range. Scale 2^-60 makes its float16 multiplier 0 and its
    # addend exactly v (mult = 2^bits x scale underflows; -zero x scale = v exactly: powers of two),
    # so every code decodes to v: exact, and finite for any v float16 holds.
    scale = np.where(rng > 0, rng / np.float32(levels), np.float32(2.0 ** -60))
    scale = np.where(has, scale, 0).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    zero = np.where(has, -mn / safe, 0).astype(np.float32)
    q = np.rint((xf - mn[..., None]) / safe[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)
    q[~nz] = 0
    return q, scale, zero


# a tile is "narrow" when its step (mult / 2^bits) is below this many fp16 ulps of its constants'
# magnitude (the larger of |add| and 2 mult; add = min - mult lies below the tile's values): only
# there can the constants' fp16 rounding move the decoded grid by a sizable part of a step, so
# only there are the codes searched again. Elsewhere it moves by at most ~1.5 of those ulps, and a
# min-max code decodes at most 4 of them (1/4 of a step) farther from its value than the nearest
# point of the grid (tests/test_kvcache.py checks both). A zero-mean tile is never narrow (2 mult
# is ~2^bits steps, its ulp ~2^(bits - 9) of one): searching every tile made numpy compression of
# a 32x16384x128 cache ~1.6x slower.
_NARROW_ULPS = 16


def _constants_ulp(dq: np.ndarray) -> np.ndarray:
    """The fp16 ulp [..] at the magnitude of a tile's decode constants dq [.., 2]: max(|add|, 2 mult)."""
    mag = np.maximum(np.abs(dq[..., 1].astype(np.float64)), 2 * np.abs(dq[..., 0].astype(np.float64)))
    return np.exp2(np.floor(np.log2(np.maximum(mag, 2.0 ** -14))) - 10)


def _nearest_codes(tiles: np.ndarray, q: np.ndarray, dq: np.ndarray, bits: int) -> np.ndarray:
    """The codes of narrow tiles moved to the point of the decoded grid nearest each value (the
    grid: fp16(h x mult + add) of every code, as dequantize_codes and the kernels decode). The
    min-max codes are picked on the unrounded grid, and rounding `add` to float16 shifts the whole
    grid by up to half an fp16 ulp of the tile's magnitude: several steps for a narrow tile far
    from 0 (5.03 .. 5.06 at 4 bits decoded 5.047 as 5.051, one ulp off, where another code holds
    it exactly; a channel of mean 5 and deviation 0.01 had 6x the RMS error). The decoder and the
    format are unchanged.

    With f the last code whose exact h x mult + add is <= x (x is a float16 and rounding is
    monotonic), no point of the decoded grid lies between codes f's and f + 1's: one of them is the
    nearest. A code is kept unless another is strictly nearer. Only the non-zeros of narrow tiles
    are searched (_NARROW_ULPS)."""
    levels = 1 << bits
    mult = dq[..., 0].astype(np.float64)
    add = dq[..., 1].astype(np.float64)
    ulp = _constants_ulp(dq)
    narrow = (mult > 0) & (mult / levels < _NARROW_ULPS * ulp)
    if not narrow.any():
        return q
    at = np.flatnonzero((tiles != 0) & narrow[..., None])
    t = at // TILE
    m, a = mult.reshape(-1)[t], add.reshape(-1)[t]
    x = tiles.reshape(-1)[at].astype(np.float64)
    qv = q.reshape(-1)[at].astype(np.int64)

    def err(code):  # |x - the code's decoded value|, as dequantize_codes decodes it
        return np.abs(x - ((1.0 + code / levels) * m + a).astype(np.float16).astype(np.float64))

    f = np.clip(np.floor(((x - a) / m - 1.0) * levels), 0, levels - 1).astype(np.int64)
    g = np.minimum(f + 1, levels - 1)
    e_f, e_g = err(f), err(g)
    best = np.where(e_g < e_f, g, f)
    out = q.copy()
    out.reshape(-1)[at] = np.where(err(qv) <= np.minimum(e_f, e_g), qv, best)
    return out


def dequant_constants(scales: np.ndarray, zeros: np.ndarray, bits: int) -> np.ndarray:
    """float32 scale, zero -> the two float16 constants (mult, add) [..., 2] the kernels use,
    computed with the kernels' float32 operations (no fused multiply-add) and rounded once."""
    L = np.float32(1 << bits)
    s = np.asarray(scales, dtype=np.float32)
    z = np.asarray(zeros, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        mult32 = s * L
        bias = (-z) * s
        add32 = bias - mult32
        out = np.stack([mult32.astype(np.float16), add32.astype(np.float16)], axis=-1)
    return out


def _decoded_extremes(dq: np.ndarray, bits: int) -> np.ndarray:
    """Codes 0 and 2^bits - 1 decoded with each tile's constants, [.., 1, 2] float16: the tile's
    smallest and largest decodable values (h x mult + add is monotonic in the code, as mult >= 0)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return dequantize_codes(np.array([0, (1 << bits) - 1]), dq[..., None, :], bits)


def _decode_overflows(dq: np.ndarray, bits: int) -> np.ndarray:
    """Tiles [..] whose dequantization is not finite in float16: the constants themselves, or codes
    0 and 2^bits - 1 decoded (_decoded_extremes). Empty tiles too: a warp walks every lane to its
    fullest lane's count, decoding codes past a lane's own with that lane's tile constants and
    multiplying them by a zero row, and 0 x inf is NaN."""
    ends = _decoded_extremes(dq, bits)
    ok = np.isfinite(dq.astype(np.float32)).all(axis=-1) & np.isfinite(ends.astype(np.float32)).all(axis=(-2, -1))
    return ~ok


def dequantize_codes(codes: np.ndarray, dq: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., n] with dq [..., 2] (broadcast over n) -> float16: fp16(h * mult + add),
    h = 1 + q / 2**bits, with one rounding (float64 holds the exact sum)."""
    h = 1.0 + np.asarray(codes, dtype=np.float64) / float(1 << bits)
    mult = dq[..., 0:1].astype(np.float64)
    add = dq[..., 1:2].astype(np.float64)
    return (h * mult + add).astype(np.float16)


def _pack_codes(codes_c: np.ndarray, bits: int) -> np.ndarray:
    """Compacted codes [..., 64] (uint8) -> bytes [..., 64 * bits / 8], low bits first."""
    per = 8 // bits
    c = codes_c.reshape(codes_c.shape[:-1] + (TILE // per, per)).astype(np.uint8)
    out = np.zeros(c.shape[:-1], dtype=np.uint8)
    for i in range(per):
        out |= (c[..., i] << (i * bits)).astype(np.uint8)
    return out


def _unpack_codes(by: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(by >> (i * bits)) & mask for i in range(per)]
    return np.stack(parts, axis=-1).reshape(by.shape[:-1] + (by.shape[-1] * per,)).astype(np.uint8)


def _compress(x: np.ndarray, kind: str, bits, sparsity=None, compact: bool = False) -> CompressedKV:
    x = _check_cache(x, f"{kind} cache")
    bits = _check_bits(bits)
    if not isinstance(compact, (bool, np.bool_)):
        raise ValueError(f"compact must be True or False, got {compact!r}")
    if compact and bits == 16:
        raise ValueError("compact=True applies to bits 4 and 2 (the fp16 layout has no scale/zero/offsets to shrink)")
    if sparsity is not None:
        x = prune(x, sparsity)
    b, s, d = x.shape
    tiles = to_tiles(x, kind)
    nz = tiles != 0
    bm = bitmaps_of(tiles)
    n = nz.sum(axis=-1).astype(np.int64)  # [B, T]
    t = tiles.shape[1]
    if bits == 16:
        counts = np.zeros((b, t + 1), dtype=np.int64)
        flat = np.concatenate([[0], np.cumsum(n.ravel())])
        counts[:, :t] = flat[:-1].reshape(b, t)
        counts[:, t] = flat[1:].reshape(b, t)[:, -1]
        if flat[-1] >= 2**31:
            raise ValueError(f"{kind} cache has {flat[-1]} non-zeros; the fp16 layout indexes them with int32")
        vals = tiles[nz]
        return CompressedKV(kind, 16, (b, s, d), bm, counts=counts.astype(np.int32), values=np.ascontiguousarray(vals))
    q, scale, zero = _quantize_tiles(tiles, bits)
    dq = dequant_constants(scale, zero, bits)
    bad = _decode_overflows(dq, bits)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        nzv = tiles[at][tiles[at] != 0].astype(np.float32)
        raise ValueError(f"{kind} cache: a tile does not decode within float16 at {bits} bits: its two fp16 constants "
                         f"mult = {1 << bits} x scale and add = min - mult, or the value the largest code decodes to "
                         f"(h x mult + add), pass +-{_FP16_MAX:g}: a tile whose range is wide, or whose minimum "
                         f"lies near -{_FP16_MAX:g} (add is below it); tile {at[1]} of cache row {at[0]} holds "
                         f"{nzv.min():g} .. {nzv.max():g}; scale the cache down")
    q = _nearest_codes(tiles, q, dq, bits)
    # codes in non-zero order: rank of each non-zero within its tile
    rank = np.cumsum(nz, axis=-1) - 1
    comp = np.zeros_like(q)
    bi, ti, ei = np.nonzero(nz)
    comp[bi, ti, rank[bi, ti, ei]] = q[bi, ti, ei]
    by = _pack_codes(comp, bits)  # [B, T, 64*bits/8]
    nb = tile_nbytes(n, bits)
    keep = np.arange(by.shape[-1])[None, None, :] < nb[..., None]
    packed = np.ascontiguousarray(by[keep])
    starts = np.concatenate([[0], np.cumsum(nb.ravel())[:-1]]).reshape(b, t)
    if packed.size >= 2**31:
        raise ValueError(f"{kind} cache: {packed.size} packed bytes; offsets are int32")
    if compact:
        gs = group_starts(kind, s, d)
        go = np.empty((b, gs.size + 1), dtype=np.int64)
        go[:, :-1] = starts[:, gs]
        go[:, -1] = (starts + nb)[:, -1]
        return CompressedKV(kind, bits, (b, s, d), bm, packed=packed, dq=np.ascontiguousarray(dq),
                            group_offsets=go.astype(np.int32))
    return CompressedKV(kind, bits, (b, s, d), bm, offsets=starts.astype(np.int32), packed=packed,
                        scales=scale.astype(np.float32), zeros=zero.astype(np.float32))


def compress_keys(k: np.ndarray, bits: int = 16, sparsity: float | None = None, compact: bool = False) -> CompressedKV:
    """Compress a (pruned) key cache [B, S, D] float16: tiles along each token's D (K^T column-major).
    Zeros are the pruned entries; pass `sparsity` to prune first. bits: 16 (the non-zeros as
    fp16), 4 or 2 (min-max codes per tile); compact=True (4/2-bit only): the compact layout.

    ValueError for a cache that is not finite float16 [B, S, D] with D in 64 / 128 / 256, bits
    not in (16, 4, 2), sparsity not in [0, 1), compact=True with 16 bits, or a tile whose values
    do not decode within float16 at these bits."""
    return _compress(k, "key", bits, sparsity, compact)


def compress_values(v: np.ndarray, bits: int = 16, sparsity: float | None = None, compact: bool = False) -> CompressedKV:
    """Compress a (pruned) value cache [B, S, D] float16: tiles along S for each channel (V^T row-major).
    The arguments and errors are compress_keys'."""
    return _compress(v, "value", bits, sparsity, compact)


def compact(ck: CompressedKV) -> CompressedKV:
    """The compact layout of a 4/2-bit CompressedKV: same bitmaps and packed codes, fp16 dequant
    constants instead of float32 scale + zero, one int32 offset per 16 tiles. Bit-identical values.
    ValueError for an fp16 or already compact cache, or one whose parts disagree."""
    validate_compressed(ck)
    if ck.bits == 16 or ck.compact:
        raise ValueError(f"compact() takes a 4/2-bit CompressedKV in the plain layout, got {ck.layout}")
    b, t = ck.bitmaps.shape
    nb = tile_nbytes(popcount(ck.bitmaps), ck.bits)
    gs = group_starts(ck.kind, ck.shape[1], ck.shape[2])
    go = np.empty((b, gs.size + 1), dtype=np.int64)
    go[:, :-1] = ck.offsets[:, gs]
    go[:, -1] = ck.offsets[:, -1].astype(np.int64) + nb[:, -1]
    return CompressedKV(ck.kind, ck.bits, ck.shape, ck.bitmaps, packed=ck.packed,
                        dq=dequant_constants(ck.scales, ck.zeros, ck.bits), group_offsets=go.astype(np.int32))


# ---------------------------------------------------------------------------------------------
# consistency (before anything is uploaded or launched)


def _arr(ck, name, dtypes, shape, what):
    a = getattr(ck, name)
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{what}: part {name!r} must be a numpy array, got {type(a).__name__}")
    if a.dtype not in [np.dtype(d) for d in dtypes]:
        raise ValueError(f"{what}: {name} must be {' or '.join(str(np.dtype(d)) for d in dtypes)}, got {a.dtype}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: {name} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: {name} must be C-contiguous")
    return a


def validate_compressed(ck) -> None:
    """ValueError unless every part agrees with the others: shapes, dtypes, bitmap popcounts vs
    counts / offsets, offsets inside the buffers, padding bits clear, finite scales."""
    if not isinstance(ck, CompressedKV):
        raise ValueError(f"expected a CompressedKV (from compress_keys / compress_values), got {type(ck).__name__}")
    what = f"compressed {ck.kind} cache"
    if ck.kind not in KINDS:
        raise ValueError(f"compressed cache: kind must be 'key' or 'value', got {ck.kind!r}")
    _check_bits(ck.bits)
    shape = ck.shape
    if (not isinstance(shape, tuple) or len(shape) != 3
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in shape)):
        raise ValueError(f"{what}: shape must be (B, S, D), three integers, got {shape!r}")
    b, s, d = (int(v) for v in shape)
    if b <= 0 or s <= 0 or d not in HEAD_DIMS:
        raise ValueError(f"{what}: shape must be (B, S, D) with D in {HEAD_DIMS}, got {ck.shape!r}")
    t = num_tiles(ck.kind, s, d)
    bm = _arr(ck, "bitmaps", (np.int64, np.uint64), (b, t), what)
    n = popcount(bm)
    if ck.kind == "value" and s % TILE:
        nst = -(-s // TILE)
        pad = np.uint64(~((1 << (s % TILE)) - 1) & 0xFFFFFFFFFFFFFFFF)
        last = bm.view(np.uint64).reshape(b, d, nst)[:, :, -1]
        if np.any(last & pad):
            raise ValueError(f"{what}: bitmap bits set for tokens >= S={s} (padding of each channel's last tile)")
    if ck.bits == 16:
        if (ck.compact or ck.offsets is not None or ck.packed is not None or ck.scales is not None
                or ck.zeros is not None or ck.group_offsets is not None):
            raise ValueError(f"{what}: an fp16 layout has counts and values, not offsets/packed/scales/zeros/dq/"
                             "group_offsets")
        c = _arr(ck, "counts", (np.int32, np.int64), (b, t + 1), what).astype(np.int64)
        v = _arr(ck, "values", (np.float16,), None, what)
        if v.ndim != 1:
            raise ValueError(f"{what}: values must be 1-D float16, got shape {v.shape}")
        if not 0 <= c[0, 0] < 2**31:  # (bounded first: the sums below must not wrap)
            raise ValueError(f"{what}: counts must start in [0, 2^31), got {c[0, 0]}")
        if np.any(np.diff(c, axis=1) != n):
            bad = np.argwhere(np.diff(c, axis=1) != n)[0]
            raise ValueError(f"{what}: counts disagree with the bitmap popcounts (batch {bad[0]}, tile {bad[1]}: "
                             f"{int(c[bad[0], bad[1] + 1] - c[bad[0], bad[1]])} vs {int(n[bad[0], bad[1]])})")
        if b > 1 and np.any(c[1:, 0] != c[:-1, -1]):
            raise ValueError(f"{what}: counts must continue across batches (counts[b, 0] == counts[b-1, T])")
        if c[-1, -1] > v.size:
            raise ValueError(f"{what}: counts reach {int(c[-1, -1])} values but values holds {v.size}")
        if c[-1, -1] >= 2**31:
            raise ValueError(f"{what}: more than 2^31 values")
        if not np.isfinite(v[c[0, 0]:c[-1, -1]]).all():
            raise ValueError(f"{what}: values must be finite")
        return
    if ck.counts is not None or ck.values is not None:
        raise ValueError(f"{what}: a {ck.bits}-bit layout has packed codes, not counts/values")
    p = _arr(ck, "packed", (np.uint8,), None, what)
    if p.ndim != 1:
        raise ValueError(f"{what}: packed must be 1-D uint8, got shape {p.shape}")
    nb = tile_nbytes(n, ck.bits)
    if ck.compact:
        if ck.offsets is not None or ck.scales is not None or ck.zeros is not None:
            raise ValueError(f"{what}: the compact layout has group_offsets and dq, not offsets/scales/zeros")
        gs = group_starts(ck.kind, s, d)
        g = gs.size
        go = _arr(ck, "group_offsets", (np.int32, np.int64), (b, g + 1), what).astype(np.int64)
        dq = _arr(ck, "dq", (np.float16,), (b, t, 2), what)
        if not np.isfinite(dq.astype(np.float32)).all():
            raise ValueError(f"{what}: dq must be finite")
        if np.any(dq[..., 0] < 0):  # mult = 2^bits x scale: the quantizer never makes a negative scale
            raise ValueError(f"{what}: dq's multipliers (2^bits x scale) must be >= 0")
        if _decode_overflows(dq, ck.bits).any():
            raise ValueError(f"{what}: a tile's codes decode past float16's range (dq too large)")
        start = go[0, 0]
        if not 0 <= start < 2**31:  # (bounded first: the sums below must not wrap)
            raise ValueError(f"{what}: offsets must be in [0, 2^31), got {start}")
        flat = start + np.concatenate([[0], np.cumsum(nb.ravel())])
        tile_start = flat[:-1].reshape(b, t)
        want = np.empty((b, g + 1), dtype=np.int64)
        want[:, :g] = tile_start[:, gs]
        want[:, g] = flat[1:].reshape(b, t)[:, -1]
        if np.any(go != want):
            bad = np.argwhere(go != want)[0]
            raise ValueError(f"{what}: group_offsets disagree with the bitmap popcounts (batch {bad[0]}, group {bad[1]}: "
                             f"{int(go[bad[0], bad[1]])}, expected {int(want[bad[0], bad[1]])})")
        end = flat[-1]
    else:
        if ck.dq is not None or ck.group_offsets is not None:
            raise ValueError(f"{what}: the plain layout has offsets, scales and zeros, not dq/group_offsets")
        off = _arr(ck, "offsets", (np.int32, np.int64), (b, t), what).astype(np.int64)
        sc = _arr(ck, "scales", (np.float32,), (b, t), what)
        ze = _arr(ck, "zeros", (np.float32,), (b, t), what)
        if not (np.isfinite(sc).all() and np.isfinite(ze).all()):
            raise ValueError(f"{what}: scales and zeros must be finite")
        if np.any(sc < 0):  # min-max quantization never makes one; a negative scale would flip the values
            raise ValueError(f"{what}: scales must be >= 0")
        dqc = dequant_constants(sc, ze, ck.bits)
        if not np.isfinite(dqc.astype(np.float32)).all():
            raise ValueError(f"{what}: a scale or zero overflows the fp16 dequantization constants")
        if _decode_overflows(dqc, ck.bits).any():
            raise ValueError(f"{what}: a tile's codes decode past float16's range (scale / zero too large)")
        start = off[0, 0]
        if not 0 <= start < 2**31:  # (bounded first: the sums below must not wrap)
            raise ValueError(f"{what}: offsets must be in [0, 2^31), got {start}")
        want = start + np.concatenate([[0], np.cumsum(nb.ravel())[:-1]]).reshape(b, t)
        if np.any(off != want):
            bad = np.argwhere(off != want)[0]
            raise ValueError(f"{what}: offsets disagree with the bitmap popcounts (batch {bad[0]}, tile {bad[1]}: "
                             f"{int(off[bad[0], bad[1]])}, expected {int(want[bad[0], bad[1]])} = previous offset + "
                             f"ceil(popcount * {ck.bits} / 8))")
        end = int(off[-1, -1] + nb[-1, -1])
    if end > p.size:
        raise ValueError(f"{what}: offsets run past the packed buffer (tiles end at byte {int(end)}, packed holds {p.size})")
    if end >= 2**31:
        raise ValueError(f"{what}: more than 2^31 packed bytes")


# ---------------------------------------------------------------------------------------------
# decompression and references (numpy, float64)


def tile_values(ck: CompressedKV) -> np.ndarray:
    """The decompressed tiles [B, T, 64] float16 (zeros where the bitmap is clear)."""
    validate_compressed(ck)
    b, s, d = ck.shape
    t = ck.tiles
    occ = unpack_bits(ck.bitmaps)  # [B, T, 64]
    out = np.zeros((b, t, TILE), dtype=np.float16)
    if ck.bits == 16:
        c = ck.counts.astype(np.int64)
        out[occ] = ck.values[c[0, 0]:c[-1, -1]]
        return out
    n = popcount(ck.bitmaps)
    nb = tile_nbytes(n, ck.bits)
    width = TILE * ck.bits // 8
    if ck.compact:
        start = int(ck.group_offsets[0, 0])
        offs = start + np.concatenate([[0], np.cumsum(nb.ravel())[:-1]])
        dq = ck.dq
    else:
        offs = ck.offsets.astype(np.int64).ravel()
        dq = dequant_constants(ck.scales, ck.zeros, ck.bits)
    # gather each tile's bytes into a fixed-width [B*T, width] array (zeros past its length)
    j = np.arange(width)[None, :]
    valid = j < nb.ravel()[:, None]
    src = np.where(valid, offs[:, None] + j, 0)
    by = np.where(valid, ck.packed[np.minimum(src, max(ck.packed.size - 1, 0))] if ck.packed.size else 0, 0).astype(np.uint8)
    codes = _unpack_codes(by, ck.bits).reshape(b, t, TILE)  # compacted: code k of the tile's non-zeros
    vals = dequantize_codes(codes, dq, ck.bits)  # [B, T, 64] value of the k-th non-zero
    rank = np.cumsum(occ, axis=-1) - 1
    out[occ] = np.take_along_axis(vals, np.where(occ, rank, 0), axis=-1)[occ]
    return out


def decompress(ck: CompressedKV) -> np.ndarray:
    """The cache [B, S, D] float16 the kernels compute with (dequantized values where the bitmap
    is set, zeros elsewhere; kernel_values for the value kernels' exact operand, which differs
    where a scaled channel's host decode is subnormal)."""
    validate_compressed(ck)
    b, s, d = ck.shape
    return from_tiles(tile_values(ck), ck.kind, s, d)


def _groups_of(rows: int, b: int, what: str) -> int:
    if b <= 0:
        raise ValueError(f"{what}: the cache has B={b} kv heads; B, S and D must be positive")
    if rows % b:
        raise ValueError(f"{what}: {rows} query heads is not a multiple of the cache's B={b} (B x groups expected)")
    return rows // b


def _three_d(x, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 3 or a.dtype.kind not in "fiu":
        raise ValueError(f"{what} must be a 3-D numeric array, got {a.dtype} {a.shape}")
    return a


def reference_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Scores q . K^T in float64: q [B*groups, Lq, D], K [B, S, D] -> [B*groups, Lq, S]
    (grouped-query attention: query head h uses kv head h // groups)."""
    q, k = _three_d(q, "queries [B*groups, Lq, D]"), _three_d(k, "the key cache [B, S, D]")
    b, s, d = k.shape
    bg, lq, dq = q.shape
    if dq != d:
        raise ValueError(f"queries have D={dq}, the key cache D={d}")
    g = _groups_of(bg, b, "queries")
    qq = np.asarray(q, dtype=np.float64).reshape(b, g * lq, d)
    return np.matmul(qq, np.asarray(k, dtype=np.float64).transpose(0, 2, 1)).reshape(bg, lq, s)


def reference_output(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Attention output p . V in float64: p [B*groups, Lq, S], V [B, S, D] -> [B*groups, Lq, D]."""
    p, v = _three_d(p, "probabilities [B*groups, Lq, S]"), _three_d(v, "the value cache [B, S, D]")
    b, s, d = v.shape
    bg, lq, sp = p.shape
    if sp != s:
        raise ValueError(f"probabilities have S={sp}, the value cache S={s}")
    g = _groups_of(bg, b, "probabilities")
    pp = np.asarray(p, dtype=np.float64).reshape(b, g * lq, s)
    return np.matmul(pp, np.asarray(v, dtype=np.float64)).reshape(bg, lq, d)


def rel_error(x: np.ndarray, ref: np.ndarray) -> float:
    """||x - ref|| / ||ref|| (Frobenius, float64): qgemm.reference.relative_error (ValueError for
    operands of different shapes)."""
    from .reference import relative_error

    return relative_error(x, ref)


# ---------------------------------------------------------------------------------------------
# device side: upload, launch configuration, the `mustafar.*` kernels' runner

NUM_WARPS = 8


def _pad16(a: np.ndarray) -> np.ndarray:
    """Bytes of `a`, zero-padded to a multiple of 16 (the kernels copy 16-byte aligned chunks)."""
    by = np.ascontiguousarray(a).view(np.uint8).ravel()
    n = max(16, -(-by.size // 16) * 16)
    out = np.zeros(n, dtype=np.uint8)
    out[:by.size] = by
    return out


# The value kernels sum a bitmap word's products p x v in half2 (docs/mustafar.md, "Accuracy"). At
# long S the probabilities are near 1/S, so with small values those sums fall among fp16's
# subnormals and lose their relative precision: measured on an H200 at S = 16384, 2.7e-3 (standard
# deviation 0.01) and 2.1e-2 (0.001) against the reference, 5.5e-2 at 0.001 and S = 65536, where a
# unit-scale cache gives 4-5e-4. So the device copy of a value cache holds each channel whose values
# all lie below 1 in magnitude scaled by the power of two that puts its largest in [1, 2), and the
# kernels multiply the channel's fp32 sums by the inverse before adding them to the output: 5.5e-4
# at 0.001 and S = 65536, same H200 (4.1-5.0e-4 in every cell with a first target, [16, 32) for
# every channel below 16, whose multiply every cache paid for). Powers of two change no value's
# bits (fp16 subnormals gain precision), and no channel is scaled down (a large channel's small
# values would become subnormal). A cache none of whose channels needs it -- any unit-scale one --
# is uploaded as it is and runs the kernels compiled without the multiply (MF_OSC=0: the code of
# before; with it the 4/2-bit walks measured 1.4-2.6% slower). A numpy model of the walk puts
# [1, 2) at 6.0e-4 (S = 65536) and 7.9e-4 (131072) for a standard deviation of 0.01, against
# 4.5-5.2e-4 for targets [4, 8) .. [256, 512); an unscaled channel just above 1 (standard
# deviation 0.25) models 6.2e-4 and 9.5e-4 there.
SCALE_BELOW = 1.0


def channel_exponents(cv: CompressedKV) -> np.ndarray:
    """The powers of two e [B, D] (int8, 0 .. 24) by which the device copy of a compressed value
    cache multiplies each channel (the kernels multiply its sums by 2^-e): where the channel's
    largest decodable magnitude (every code of every tile, empty ones included: the kernels decode
    them) is below 1, times 2^e it lies in [1, 2); e = 0 where it is 1 or more, and for an empty
    channel. The values themselves are unchanged: decompress() and every host part stay as
    compressed. ValueError for a key cache (its kernels are not scaled) or an inconsistent one."""
    validate_compressed(cv)
    if cv.kind != "value":
        raise ValueError(f"channel_exponents() takes a compressed value cache, got a {cv.kind} cache")
    return _channel_exponents(cv)


def _channel_exponents(cv: CompressedKV) -> np.ndarray:
    """channel_exponents of a value cache already validated."""
    b, s, d = cv.shape
    nst = -(-s // TILE)
    if cv.bits == 16:
        c = cv.counts.astype(np.int64)
        first = c[:, :-1].reshape(b, d, nst)[:, :, 0].ravel()  # each channel's first value
        end = np.append(first[1:], c[-1, -1])
        # |v| as float16 bits: for finite values (validated) their order is the magnitudes' order
        mag = cv.values[c[0, 0]:c[-1, -1]].view(np.uint16) & np.uint16(0x7FFF)
        top = np.zeros(b * d, dtype=np.uint16)
        some = end > first
        if some.any():
            top[some] = np.maximum.reduceat(mag, first[some] - c[0, 0])
        amax = top.view(np.float16).astype(np.float32)
    else:
        dq = cv.dq if cv.compact else dequant_constants(cv.scales, cv.zeros, cv.bits)
        amax = np.abs(_decoded_extremes(dq, cv.bits).astype(np.float32)).reshape(b, d, nst * 2).max(axis=-1).ravel()
    _, x = np.frexp(amax)  # amax = m 2^x, m in [0.5, 1): amax 2^(1 - x) lies in [1, 2)
    e = np.where((amax > 0) & (amax < SCALE_BELOW), 1 - x, 0)
    return e.reshape(b, d).astype(np.int8)


def _device_parts(ck: CompressedKV) -> dict:
    """The arrays an upload copies, by kernel parameter name ("bmp", "offs", "scl", "zer", "data",
    "osc"), as the kernels read them: a value cache with some channel to scale (channel_exponents)
    has every channel times 2^e and "osc" = 2^-e [B, D] float32; otherwise no "osc" and the parts
    as they are. Validates ck (ValueError)."""
    validate_compressed(ck)
    b, s, d = ck.shape
    nst = -(-s // TILE)
    scaled = False
    if ck.kind == "value":
        e = _channel_exponents(ck).astype(np.int32)
        scaled = bool(e.any())
        up = np.ldexp(np.float32(1), e)  # [B, D] float32, exact
        osc = np.ldexp(np.float32(1), -e)
    parts = {"bmp": np.ascontiguousarray(ck.bitmaps).view(np.uint32).reshape(-1)}
    if ck.bits == 16:
        parts["offs"] = ck.counts.astype(np.int32).reshape(-1)
        v = np.array(ck.values)  # what the kernels may read below a tile's values stays finite
        c0, c1 = int(ck.counts[0, 0]), int(ck.counts[-1, -1])
        v[:c0] = 0
        v[c1:] = 0
        if scaled:
            per_tile = np.diff(ck.counts.astype(np.int64), axis=1)  # [B, T], channel-major within a batch
            per_chan = per_tile.reshape(b, d, nst).sum(axis=-1).ravel()
            v[c0:c1] = (v[c0:c1].astype(np.float32) * np.repeat(up.ravel(), per_chan)).astype(np.float16)
        parts["data"] = _pad16(v)
    elif ck.compact:
        parts["offs"] = ck.group_offsets.astype(np.int32).reshape(-1)
        dq = ck.dq
        if scaled:
            dq = (dq.reshape(b, d, nst, 2).astype(np.float32) * up[:, :, None, None]).astype(np.float16)
            dq = dq.reshape(ck.dq.shape)
        parts["scl"] = np.ascontiguousarray(dq).view(np.uint32).reshape(-1)
        parts["data"] = _pad16(ck.packed)
    else:
        parts["offs"] = ck.offsets.astype(np.int32).reshape(-1)
        sc = ck.scales
        if scaled:  # the kernels make mult and add from it: 2^e times the host's (float32, exact)
            sc = (sc.reshape(b, d, nst) * up[:, :, None]).reshape(sc.shape)
        parts["scl"] = np.ascontiguousarray(sc, dtype=np.float32).reshape(-1)
        parts["zer"] = ck.zeros.reshape(-1)
        parts["data"] = _pad16(ck.packed)
    if scaled:
        parts["osc"] = np.ascontiguousarray(osc, dtype=np.float32).reshape(-1)
    return parts


def kernel_values(ck: CompressedKV) -> np.ndarray:
    """The cache [B, S, D] float32 the kernels multiply with: decompress(ck) for keys, and for
    values the device copy's decode (each channel times 2^e, channel_exponents) times 2^-e. That
    is decompress(ck) exactly, except in a scaled channel's 4/2-bit tiles whose decoded values or
    fp16 constants are float16 subnormals on the host: the scaled decode rounds those on a finer
    grid (the plain layout rebuilds mult from the scaled scale, the compact one scales its stored
    constants, so there the two layouts can differ too), within a few units of 2^-24 of
    decompress's values. The value kernels' exact-math reference. ValueError as decompress."""
    if not isinstance(ck, CompressedKV) or ck.kind != "value" or ck.bits == 16:
        return decompress(ck).astype(np.float32)  # (fp16 values: scaling them by powers of two is exact)
    parts = _device_parts(ck)
    if "osc" not in parts:  # no channel scaled
        return decompress(ck).astype(np.float32)
    b, s, d = ck.shape
    if ck.compact:
        dev = replace(ck, dq=parts["scl"].view(np.float16).reshape(ck.dq.shape))
    else:
        dev = replace(ck, scales=parts["scl"].reshape(ck.scales.shape))
    nst = -(-s // TILE)
    t = tile_values(dev).astype(np.float32).reshape(b, d, nst * TILE) * parts["osc"].reshape(b, d, 1)
    return from_tiles(t.reshape(b, d * nst, TILE), "value", s, d)


class DeviceKV:
    """A validated CompressedKV in device memory (what the kernels read; a value cache's channels
    scaled by powers of two: channel_exponents)."""

    def __init__(self, ck: CompressedKV, arrays: dict):
        self.kind, self.bits, self.shape, self.compact, self.layout = ck.kind, ck.bits, tuple(ck.shape), ck.compact, ck.layout
        self.nbytes = ck.nbytes  # the compressed form's bytes (what a launch reads, plus padding)
        self.max_step = step_bytes_max(ck)  # sizes the kernels' windows
        # whether version 2's fp16 value walk zeroes what it reads past a lane's values (MF_VMASK, plan_for)
        self.density = density(ck)
        self.arrays = arrays
        # whether the upload scaled a value channel (channel_exponents): its kernels multiply by "osc" (MF_OSC)
        self.scaled = "osc" in arrays

    @classmethod
    def upload(cls, ck: CompressedKV) -> "DeviceKV":
        """Validate `ck` (ValueError) and copy its parts to the GPU: a new upload at every call
        (CompressedKV.to_device() keeps one per cache)."""
        from . import runtime

        parts = _device_parts(ck)  # (validates ck first)
        return cls(ck, {name: runtime.DeviceArray.from_host(a) for name, a in parts.items()})

    @property
    def freed(self) -> bool:
        """True once free() ran (on any of its buffers)."""
        return any(a.freed for a in self.arrays.values())

    def ptr(self, name: str) -> int:
        """The device address of part `name` ("bmp", "offs", "scl", "zer", "data" or "osc"), 0
        for a part this layout lacks; ValueError once freed."""
        a = self.arrays.get(name)
        if a is not None and a.freed:
            raise ValueError(f"this {self.kind} cache's device copy was freed (DeviceKV.free()); upload it again "
                             "with CompressedKV.to_device()")
        return 0 if a is None else a.ptr

    def free(self) -> None:
        """Release the device buffers now; launching on this object afterwards raises ValueError."""
        for a in self.arrays.values():
            a.free()


@dataclass
class LaunchPlan:
    """One `mustafar.*` launch (plan_for): the #defines to compile with, grid, block, dynamic
    shared memory, `per_cta` (key kernels: warp steps of 32 tokens per CTA; value kernels: channels
    per CTA, or 64-token tiles per CTA with version 4) and `rows` (R = groups x Lq)."""

    defines: dict
    grid: tuple
    block: tuple
    shmem: int
    per_cta: int
    rows: int  # R = groups * Lq


ZERO_ENTRY = "mustafar_zero_output"  # the value modules' zeroing kernel (cuda_src/common/mustafar.cuh)
ZERO_THREADS = 256                   # its block: __launch_bounds__(256), a grid-stride loop of 256
STEP_LANES = 32     # a warp step = 32 lanes (keys: 32 tokens; values: 32 tiles of a channel)
SMEM_MAX = 227 * 1024


def step_bytes_max(ck: "CompressedKV") -> int:
    """Bytes of the largest warp step of a compressed cache (its window): 32 tokens (keys) or
    32 tiles of one channel from a multiple of 32 (values). ValueError for anything but a CompressedKV."""
    if not isinstance(ck, CompressedKV):
        raise ValueError(f"expected a CompressedKV (from compress_keys / compress_values), got {type(ck).__name__}")
    b, s, d = ck.shape
    n = popcount(ck.parts()["bitmaps"])
    nb = 2 * n if ck.bits == 16 else tile_nbytes(n, ck.bits)
    if ck.kind == "key":
        per = STEP_LANES * (d // TILE)
        t = nb.shape[1]
        pad = np.zeros((b, -(-t // per) * per), dtype=np.int64)
        pad[:, :t] = nb
        return int(pad.reshape(b, -1, per).sum(-1).max()) if pad.size else 0
    lanes = STEP_LANES
    nst = -(-s // TILE)
    rows = nb.reshape(b, d, nst)
    pad = np.zeros((b, d, -(-nst // lanes) * lanes), dtype=np.int64)
    pad[:, :, :nst] = rows
    return int(pad.reshape(b, d, -1, lanes).sum(-1).max())


def window_bytes(kind: str, bits: int, d: int, max_step: int | None) -> int:
    """One window stage: the largest step's bytes + 16 (alignment of its start) + 32
    (lanes read whole words around their codes), rounded up to 512 or 1024 bytes and to a multiple
    of 512 above (few compiled variants); without max_step, the worst case (every element
    non-zero)."""
    if max_step is None:
        u = d // TILE if kind == "key" else 1  # tiles per lane
        max_step = STEP_LANES * u * TILE * (2 if bits == 16 else bits / 8)
    need = int(max_step) + 48
    if need <= 1024:
        return 512 if need <= 512 else 1024
    return -(-need // 512) * 512


PAD = 64  # zero bytes below each window stage (cuda_src/common/mustafar.cuh MF_PAD)
# Version 2's fp16 value walk reads past a lane's last value into finite data (other lanes' values
# or a zeroed pad) and multiplies it by the zero row; zeroing those values instead (MF_VMASK=1)
# costs 4 of a pair's ~24 instructions. H100, 32x16384x128, µs without / with: 70% sparsity 30.7 /
# 34.3, 65% 33.9 / 37.8, 60% 36.5 / 40.9, 55% 41.4 / 43.6, but 50% 46.2 / 44.8 (docs/perf/NOTES.md,
# session 19): the zeroing only from about half the elements stored.
VMASK_DENSITY = 0.475


SMEM_SM = 228 * 1024   # shared memory of an SM (each resident CTA also reserves 1 KiB)
MF4_LUT_BYTES = 128    # version 4's decoding table (cuda_src/common/mustafar.cuh MF4_LUT_BYTES)


def min_ctas(mr: int, d: int) -> int:
    """Resident CTAs per SM the kernels' registers are bounded for (MF_MIN_CTAS in
    cuda_src/common/mustafar.cuh): 4 CTAs of 8 warps, 3 with 8 rows or D = 256, 2 with both."""
    return 4 if (mr == 4 and d <= 128) else (2 if (mr == 8 and d == 256) else 3)


def _whole_chunk_ctas(ctas: int, shmem: int, mr: int, cc: int, sm_count: int) -> bool:
    """Value kernels: whether a CTA takes a whole chunk (all D channels) with 16 warps, two CTAs per
    SM, instead of 8 warps and part of the channels. Each CTA stages its chunk's probabilities once
    (loads, transposing stores, a barrier before any walk): 16 warps halve that work and its waits
    per step. H100, against the 8-warp plan: 32x16384x128 (256 CTAs, one wave; 8 warps over 64
    channels) value fp16 70% 30.6 -> 28.3 us, 50% 44.5 -> 41.9, value q2 70% 27.6 -> 26.2 (session
    20); 32x32768x128 (512 CTAs, 1.94 waves; 8 warps over all 128 channels) value fp16 54.3 ->
    51.6, q2 47.9 -> 45.7 (session 21; docs/perf/NOTES.md). Only where those CTAs make nearly full
    waves at two per SM (the last one at least 90% full: fewer leave SMs idle), with 4 rows per
    CTA (8 rows would need more than the 64 registers a thread then has), on sm_90 (where it was
    measured) and if two fit in shared memory."""
    waves = ctas / (2 * sm_count)
    return (mr == 4 and cc >= 90 and waves >= 0.9 and (waves % 1 == 0 or waves % 1 >= 0.9)
            and 2 * (shmem + 1024) <= SMEM_SM)


def _int_at_least(v, lo: int) -> bool:
    """An int (numpy's too, not a bool) of at least `lo`."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v >= lo


def _positive_int(v) -> bool:
    return _int_at_least(v, 1)


def _opt_bool(v) -> bool:
    return v is None or isinstance(v, (bool, np.bool_))


def _plan_mma(kind: str, bits: int, shape, rows: int, sm_count: int, ctas_per_sm: int | None = None) -> LaunchPlan:
    """Version 4 (tensor cores on densely decoded tiles, value kernels, 4/2-bit): a warp = 8
    channels x a range of 64-token chunks, CTAs of up to 16 warps sharing the range's staged
    probabilities; the range sized for about one wave (a multiple of 16 chunks: the compact
    layout's group offsets) of two CTAs per SM. Two, not one, at every row count: on the H100
    (32x16384x128, session 16) 32 rows ran 25-30% faster (q2 73.8 against 98.7 us, q4c 69.6
    against 99.7) though 4 row tiles in 64 registers spill 24-92 bytes, 16 rows 4-6% faster;
    one CTA's range was capped by its staged probabilities to 1.45 waves."""
    b, s, d = shape
    warps = min(16, d // 8)
    ncb = d // (8 * warps)
    nt = min(4, -(-rows // 8))
    rb = -(-rows // (8 * nt))
    mc = ctas_per_sm or 2
    nst = -(-s // TILE)
    per = -(-nst * ncb * rb * b // (mc * sm_count))
    per = max(16, -(-per // 16) * 16)
    cap = ((SMEM_SM // mc - 1024 - MF4_LUT_BYTES) // (nt * 1024)) // 16 * 16
    per = min(per, cap, -(-nst // 16) * 16)
    grid = (-(-nst // per) * ncb * rb, b, 1)
    defines = {"MF_MMA": 1, "MF_NT": nt, "MF_D": d, "MF_WARPS": warps, "MF_MIN_CTAS": mc}
    return LaunchPlan(defines, grid, (32 * warps, 1, 1), MF4_LUT_BYTES + per * nt * 1024, per, rows)


def use_mma(kind: str, bits: int, rows: int, cc: int = 90) -> bool:
    """Whether plan_for uses the tensor-core value kernel ("version 4": tiles decoded densely and
    multiplied by mma.sync) instead of the bitmap walk: 4/2-bit value caches with more than 8
    query rows per kv head (groups x Lq), on sm_80+. On the H100 (32x16384x128, 70% sparsity) it
    ran 41-47% faster than the walk at 32 rows (two CTAs per SM, session 16: q2 73.8 against
    125.3 us, q4c 69.6 against 131.7) and, at one CTA per SM (session 15), 30-45% slower at 4
    rows; a key version measured slower than the keys' walk at every row count
    (docs/mustafar.md, the kernels)."""
    return kind == "value" and bits != 16 and cc >= 80 and rows > 8


def plan_for(kind: str, bits: int, shape, rows: int, sm_count: int = 132, max_step: int | None = None,
             mma: bool | None = None, cc: int = 90,
             ctas_per_sm: int | None = None, steps_per_cta: int | None = None, v3: bool | None = None,
             density: float | None = None, whole: bool | None = None) -> LaunchPlan:
    """The launch of a `mustafar.*` kernel: a lane walks a whole token (keys) or a whole tile
    (values), except where `use_mma` (or mma=True) picks version 4 (cc: compute capability); rows
    in blocks of 4 or 8 (grid.x: row block fastest, so that a chunk's row blocks read its
    compressed bytes from L2); windows sized from the cache's largest step (max_step,
    `step_bytes_max`; None: the worst case); the grid about
    one wave of the CTAs an SM holds (registers and shared memory); value kernels take 16-warp CTAs
    over whole chunks where those make nearly full waves (_whole_chunk_ctas). ctas_per_sm: the resident CTAs
    per SM the kernel's registers are bounded for (MF_MIN_CTAS) and the grid is sized by, instead
    of the measured default (tools/kv_probe.py's MF_MIN_CTAS variants). steps_per_cta (key
    kernels): warp steps of 32 tokens per CTA instead of the even one-wave split
    (tools/kv_probe.py's MF_STEPS_PER_CTA variants). v3: version 3 (True) or 2 (False) of the
    walk instead of the measured default (tools/kv_probe.py's MF_V3 variants). density (the
    stored fraction of the cache, `density()`; None: unknown): version 2's fp16 value walk zeroes
    the values it reads past a lane's count (MF_VMASK=1) only from VMASK_DENSITY up, where that
    measured faster. whole (value kernels): 16-warp CTAs over whole chunks (True) or not (False)
    instead of _whole_chunk_ctas's rule (tools/kv_probe.py's MF_WHOLE variants).
    ValueError for another kind, bits or D, B, S, rows or sm_count not positive ints, B above
    65535, an option given to the wrong kind or out of its range, or a step that does not fit in
    shared memory."""
    if not isinstance(shape, (tuple, list)) or len(shape) != 3:
        raise ValueError(f"plan_for: shape must be the cache's (B, S, D), got {shape!r}")
    b, s, d = shape
    if kind not in ("key", "value") or not _positive_int(bits) or bits not in (16, 4, 2) or not _positive_int(d) \
            or d not in (64, 128, 256):
        raise ValueError(f"plan_for: kind must be 'key' or 'value', bits 16 / 4 / 2 and D 64 / 128 / 256, got "
                         f"kind={kind!r} bits={bits!r} D={d!r}")
    if not _int_at_least(cc, 75):  # NVRTC 13 compiles sm_75 and newer
        raise ValueError(f"plan_for: cc must be the compute capability as an int, 75 (sm_75) or above, got {cc!r}")
    if max_step is not None and not _int_at_least(max_step, 0):  # (0: a cache with no non-zeros, empty steps)
        raise ValueError(f"plan_for: max_step must be a non-negative int (bytes of the largest step) or None, "
                         f"got {max_step!r}")
    for name, v in (("mma", mma), ("v3", v3), ("whole", whole)):
        if not _opt_bool(v):
            raise ValueError(f"plan_for: {name} must be True, False or None, got {v!r}")
    if not all(_positive_int(v) for v in (b, s, rows, sm_count)):
        raise ValueError(f"plan_for: B, S, the query rows and sm_count must be positive ints, got shape {tuple(shape)}, "
                         f"rows={rows!r}, sm_count={sm_count!r}")
    if b > 65535:  # the kernels' grid.y: CUDA launches at most 65535
        raise ValueError(f"a {kind} cache of B={b} (batch x kv heads) is beyond one launch (at most 65535): split it")
    if density is not None and (isinstance(density, (bool, np.bool_))
                                or not isinstance(density, (int, float, np.integer, np.floating))
                                or not 0.0 <= density <= 1.0):
        raise ValueError(f"density must be the stored fraction of the cache, a number in [0, 1], got {density!r}")
    if ctas_per_sm is not None and not (_positive_int(ctas_per_sm) and ctas_per_sm <= 32):
        raise ValueError(f"ctas_per_sm must be an int in 1..32 (resident CTAs per SM; no GPU holds more), got "
                         f"{ctas_per_sm!r}")
    if steps_per_cta is not None and (kind != "key" or not _positive_int(steps_per_cta)):
        raise ValueError(f"steps_per_cta is for key kernels and must be a positive int (warp steps of 32 tokens per "
                         f"CTA), got {steps_per_cta!r} for a {kind} kernel")
    if whole is not None and kind != "value":
        raise ValueError(f"whole (16-warp CTAs over whole chunks) is for value kernels and must be True, False or None, "
                         f"got {whole!r} for a {kind} kernel")
    # numpy scalars pass the checks above; the defines and cache keys get plain Python values
    ctas_per_sm, steps_per_cta = (None if v is None else int(v) for v in (ctas_per_sm, steps_per_cta))
    mma, v3, whole = (None if v is None else bool(v) for v in (mma, v3, whole))
    density = None if density is None else float(density)
    if mma is None:
        mma = use_mma(kind, bits, rows, cc)
    elif mma and not (kind == "value" and bits != 16 and cc >= 80):
        raise ValueError(f"version 4 (mma=True) is for 4/2-bit value kernels on sm_80+, got {kind} bits={bits} sm_{cc}")
    if mma:
        # (max_step, which the runner always passes, sizes the walk's windows: version 4 has none)
        if v3 is not None or whole is not None:  # options of the walk (versions 2 / 3)
            raise ValueError(f"plan_for: v3 and whole shape the walk; version 4 (mma, chosen for {kind} bits={bits} "
                             f"at {rows} rows on sm_{cc}) takes neither (pass mma=False for the walk), got v3={v3!r} "
                             f"whole={whole!r}")
        return _plan_mma(kind, bits, shape, rows, sm_count, ctas_per_sm)
    # version 3 of the walk, except fp16 values (version 2: docs/mustafar.md; version 3 measured 17%
    # slower there, and with both reading value pairs (session 18) 2-6% faster at 70% but 10% slower
    # at 50%); fp16 keys measured 29.8 us on version 3 against 32.2 on version 2 (H100)
    if v3 is None:
        v3 = bits != 16 or kind == "key"
    mr = 4 if rows <= 4 else 8
    rb = -(-rows // mr)
    win = window_bytes(kind, bits, d, max_step)
    nw = 2 * (d // TILE if kind == "key" else 1)  # bitmap words per lane
    if kind == "key":
        rep = 16 if mr == 4 else 8           # conflict-free 8-byte (half-warp) / 16-byte (quarter-warp) gathers
        xs = (d // 32) * 33 * rep * mr * 2
    else:
        xs = 33 * 64 * mr * 2
    # windows (each above a zeroed pad, except version 2's keys) and version 3's word records
    if v3:
        per_warp = lambda w: 2 * (PAD + w) + 2 * nw * STEP_LANES * 8  # noqa: E731
    else:
        per_warp = (lambda w: 2 * w) if kind == "key" else (lambda w: 2 * (PAD + w))  # noqa: E731
    warps = NUM_WARPS
    while warps > 1 and xs + warps * per_warp(win) > SMEM_MAX:
        warps //= 2
    if xs + warps * per_warp(win) > SMEM_MAX:
        raise ValueError(f"compressed {kind} cache: a warp step of {max_step} bytes does not fit in shared memory")
    shmem = xs + warps * per_warp(win)
    mc = ctas_per_sm or min_ctas(mr, d)
    resident = max(1, min(mc * NUM_WARPS // warps, SMEM_SM // (shmem + 1024)))
    if not v3 and not ctas_per_sm:  # version 2's own grid (as measured): ~4 CTAs per SM (keys), >= ~2 per SM (values)
        resident = 4 if kind == "key" else 20 / 9
    if kind == "key":
        steps_b = -(-s // STEP_LANES)
        if steps_per_cta is None:
            # one wave: c CTAs per kv head and row block, the head's steps split evenly among them.
            # From two steps per warp on, per is not rounded up to a multiple of the warps (a CTA's
            # warps take ceil / floor of per / warps steps): rounding 43 up to 48 at 32x16384 gave
            # the SMs holding 3 CTAs 16% more steps than an even split (H100, fp16 at 70%: 29.6 ->
            # 28.0 us). Below that the warps' own step counts weigh more (32x4096: 11 steps per CTA
            # 10.7 us, 16 steps 10.3), so per stays a multiple of the warps there.
            c = max(1, int(resident * sm_count) // (b * rb))
            per = max(warps, -(-steps_b // c))
            if per < 2 * warps:
                per = -(-per // warps) * warps
        else:
            per = steps_per_cta
        per = min(per, -(-steps_b // warps) * warps)
        grid = (-(-steps_b // per) * rb, b, 1)
        defines = {"MF_R": mr, "MF_D": d, "MF_REP": rep, "MF_WARPS": warps, "MF_WIN2": win}
    else:
        nst = -(-s // TILE)
        chunks = -(-nst // STEP_LANES)
        per = d                                                # channels per CTA
        shmem16 = xs + 2 * NUM_WARPS * per_warp(win)
        if whole is None:
            whole = not ctas_per_sm and _whole_chunk_ctas(chunks * b * rb, shmem16, mr, cc, sm_count)
        elif whole and (mr != 4 or 2 * (shmem16 + 1024) > SMEM_SM):
            raise ValueError("whole=True needs 4 rows per CTA and two 16-warp CTAs' shared memory per SM")
        if whole:
            warps, shmem, mc = 2 * NUM_WARPS, shmem16, 2
        while not whole and per // 2 >= warps and 10 * chunks * b * rb * (d // per) < 9 * resident * sm_count:  # ~one wave
            per //= 2
        grid = (chunks * (d // per) * rb, b, 1)
        defines = {"MF_R": mr, "MF_D": d, "MF_WARPS": warps, "MF_WIN2": win}
    if ctas_per_sm or warps > NUM_WARPS:
        defines["MF_MIN_CTAS"] = mc
    if not v3:
        defines["MF_V3"] = 0
        if kind == "value" and bits == 16 and density is not None and density >= VMASK_DENSITY:
            defines["MF_VMASK"] = 1
    return LaunchPlan(defines, grid, (32 * warps, 1, 1), shmem, per, rows)


_call_plans: dict = {}  # MustafarRunner.launch's memo: (plan_for's plan, the kernel's module, its int32 arguments)


def _with_output_scale(plan_: LaunchPlan, scaled: bool) -> LaunchPlan:
    """plan_ with MF_OSC=1 where the upload scaled a value channel (DeviceKV.scaled: the kernel must
    multiply by its output scales, or its results come out 2^e too large) and without MF_OSC
    otherwise (the kernels as compiled before the scaling existed). The launcher applies it to
    every plan, plan_for's or a caller's, so no plan can launch the wrong one."""
    if bool(plan_.defines.get("MF_OSC", 0)) == bool(scaled):
        return plan_
    defines = {k: v for k, v in plan_.defines.items() if k != "MF_OSC"}
    if scaled:
        defines["MF_OSC"] = 1
    return replace(plan_, defines=defines)


def _int_args(s: int, rows: int, plan_) -> tuple:
    """The kernels' three int32 arguments after the pointers: S, R and the plan's per_cta."""
    return np.int32(s), np.int32(rows), np.int32(plan_.per_cta)


# Why a result of finite operands can still come back inf / NaN. The kernels sum the products of one
# 32-position bitmap word in half2 (fp32 across words: docs/mustafar.md), so a partial sum past 65504
# overflows even where the whole dot product fits; key scores are float16 besides.
_OVERFLOW_WHY = {
    "key": ("a score, or the half2 partial sum of the <= 32 products q x k of one bitmap word, passed 65504; scale "
            "the queries down (e.g. fold 1/sqrt(D) into them) and rescale the scores"),
    "value": ("the half2 partial sum of the <= 32 products p x v of one bitmap word passed 65504; the kernels "
              "expect attention probabilities (entries at most 1) and a cache whose values stay well below 2047 "
              "(the device copy scales only channels below 1 up, into [1, 2): channel_exponents); scale such a "
              "cache down"),
}


class MustafarRunner:
    """Launch, validation and timing of one `mustafar.*` kernel (the registry's `runner` hook)."""

    def __init__(self, kind: str, bits: int, compact: bool = False):
        self.kind, self.bits, self.compact = kind, bits, compact
        self.layout = "fp16" if bits == 16 else f"q{bits}" + ("c" if compact else "")

    def __repr__(self) -> str:
        return f"<MustafarRunner {self.kind} {self.layout}>"

    # -- shapes and operands -------------------------------------------------------------------
    def shape_problem(self, shape) -> str | None:
        """Why BxSxD cannot run on this kernel (None if it can)."""
        try:
            b, s, d = shape
        except Exception:
            return f"shape must be BxSxD, got {shape!r}"
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in (b, s, d)):
            return f"B, S, D must be ints, got {shape!r}"
        if min(b, s, d) <= 0:
            return f"B, S, D must be positive, got {b}x{s}x{d}"
        if d not in HEAD_DIMS:
            return f"head dim D must be one of {HEAD_DIMS} (shape BxSxD), got D={d}"
        if b > 65535:  # plan_for's bound: the kernels' grid.y
            return f"B={b} (batch x kv heads) is beyond one launch (at most 65535): split it"
        return None

    def _check_cache(self, kernel, w):
        """The compressed cache, validated (host) and of this kernel's kind and layout; not uploaded."""
        if isinstance(w, CompressedKV):
            if not w.on_device:  # its upload was validated, and it is what runs (34 ms a call at 32x16384x128)
                validate_compressed(w)
            dkv = w
        elif isinstance(w, DeviceKV):
            dkv = w
        else:
            raise ValueError(f"{kernel.name}: the second operand must be a CompressedKV (qgemm.kvcache.compress_"
                             f"{self.kind}s) or its .to_device(), got {type(w).__name__}")
        if dkv.kind != self.kind or dkv.layout != self.layout:
            raise ValueError(f"{kernel.name} takes a compressed {self.kind} cache in the {self.layout} layout, got a "
                             f"{dkv.kind} cache in the {dkv.layout} layout (use mustafar.{dkv.kind}_{dkv.layout})")
        return dkv

    def _check_x(self, kernel, x, dkv, device: bool, stream=None):
        from . import runtime

        b, s, d = dkv.shape
        what = "queries" if self.kind == "key" else "probabilities"
        last = d if self.kind == "key" else s
        if device:
            dx = runtime.as_device_array(x, stream)  # (DLPack: the producer's pending work ordered before `stream`)
            dtype, shape = dx.dtype, dx.shape  # (a DeviceArray already: returned as it is)
        else:
            _masked_refusal(x, f"{kernel.name}: {what}")
            if not isinstance(x, np.ndarray):
                raise ValueError(f"{kernel.name}: {what} must be a numpy or device array, got {type(x).__name__}")
            dx, dtype, shape = x, x.dtype, x.shape
        if dtype != np.float16:
            raise ValueError(f"{kernel.name}: {what} must be float16, got {runtime.dtype_name(dtype)}")
        if len(shape) != 3 or shape[2] != last or shape[0] <= 0 or shape[1] <= 0:
            raise ValueError(f"{kernel.name}: {what} must be [B*groups, Lq, {'D' if self.kind == 'key' else 'S'}="
                             f"{last}] float16, got {tuple(shape)}")
        if shape[0] % b:
            raise ValueError(f"{kernel.name}: {what} have {shape[0]} heads, not a multiple of the cache's B={b} "
                             "(B x num_key_value_groups expected)")
        if not device and not x.flags.c_contiguous:
            raise ValueError(f"{kernel.name}: {what} must be C-contiguous")
        if not device and not np.isfinite(x).all():
            raise ValueError(f"{kernel.name}: {what} must be finite; found inf or NaN")
        return dx, shape[0] // b, shape[1]

    def out_shape(self, dkv, bg: int, lq: int):
        b, s, d = dkv.shape
        return ((bg, lq, s), np.float16) if self.kind == "key" else ((bg, lq, d), np.float32)

    # -- calling ---------------------------------------------------------------------------------
    def __call__(self, kernel, x, w=None, *, out=None, stream=None):
        """kernel(q, ck) -> scores [B*groups, Lq, S] float16 (key kernels);
        kernel(p, cv) -> output [B*groups, Lq, D] float32 (value kernels).
        Host numpy operands -> numpy result; device operands (and a DeviceKV) -> device result."""
        from . import runtime

        ck = self._check_cache(kernel, w)
        dx = runtime.device_array_or_none(x, stream)  # (read once: torch builds its array interface per access)
        device = dx is not None
        dx, groups, lq = self._check_x(kernel, dx if device else x, ck, device, stream)
        if runtime.gpu_available():
            why = ("host operands are uploaded and the result read back synchronously; capture device arrays"
                   if not device else "the compressed cache is uploaded first; call ck.to_device() before capturing"
                   if isinstance(ck, CompressedKV) and not ck.on_device else None)
            runtime.prepare_call(stream, kernel.name, why and f"this call cannot be captured into a CUDA graph: {why}")
            stream = runtime.launch_stream(stream)  # once: a caller's stream is checked (driver calls) on each conversion
        if not runtime.gpu_available():  # named, before the cache's upload asks for the runtime
            runtime.require_gpu(f"running {kernel.name}")
        dkv = ck.to_device() if isinstance(ck, CompressedKV) else ck
        if tuple(dkv.shape) != tuple(ck.shape) or dkv.layout != ck.layout:  # a part or the shape changed after to_device()
            raise ValueError(f"{kernel.name}: the cache's device copy ({dkv.layout} {tuple(dkv.shape)}) no longer matches it "
                             f"({ck.layout} {tuple(ck.shape)}); free it (ck.to_device().free()) and upload again")
        oshape, odt = self.out_shape(dkv, dx.shape[0], lq)
        if not device:
            if out is not None:
                raise ValueError(f"{kernel.name}: out= must be a device array; host calls return a new numpy array")
            dx = runtime.DeviceArray.from_host(np.ascontiguousarray(x))
        if out is None:
            dout = runtime.DeviceArray.empty(oshape, odt)
        else:
            dout = runtime.as_output_array(out, kernel.name, stream)
            if dout.shape != oshape or dout.dtype != np.dtype(odt):
                raise ValueError(f"{kernel.name}: out must be {np.dtype(odt)} {oshape}, got {dout.dtype} {dout.shape}")
        self.launch(kernel, dkv, dx, dout, groups * lq, stream=stream)
        if device:
            return out if out is not None else dout
        res = dout.to_host()
        if not np.isfinite(res).all():  # finite operands: only an overflow makes inf / NaN (see _OVERFLOW_WHY)
            raise ValueError(f"{kernel.name}: the result overflowed float16: {_OVERFLOW_WHY[self.kind]}")
        return res

    def launch(self, kernel, dkv: DeviceKV, dx, dout, rows: int, stream=None, plan_: LaunchPlan | None = None) -> None:
        """Launch on device operands already checked (the hot path). Value kernels accumulate:
        the output is zeroed first, on the same stream, by the module's mustafar_zero_output. Both
        kernels are launched with programmatic dependent launch where the GPU and cuda.core
        support it (KernelSpec.pdl, runtime.pdl_enabled; the waits and their order are in
        cuda_src/common/mustafar.cuh): the value kernel's start then overlaps the end of the
        kernel before it and the zeroing."""
        from . import runtime

        b, s, d = dkv.shape
        # every address read before anything else (DeviceKV.ptr refuses a freed copy): a free() fails
        # here, not after a module load, nor between the value op's zeroing (which would have cleared
        # out=) and its kernel. Pointers go as Python ints: cuda.core passes an int as a pointer-sized
        # argument (a numpy scalar each cost ~0.25 us).
        ptrs = (dkv.ptr("bmp"), dkv.ptr("offs"), dkv.ptr("scl"), dkv.ptr("zer"), dkv.ptr("data"), dx.ptr, dout.ptr,
                dkv.ptr("osc"))
        if plan_ is None:
            info = runtime.device_info() if runtime.gpu_available() else None
            key = (kernel, self.kind, self.bits, tuple(dkv.shape), rows, info.sm_count if info else 132,
                   dkv.max_step, info.cc if info else 90, dkv.density, dkv.scaled)
            # the plan is a pure function of the key, worked out once per kernel (the object: a module
            # belongs to it), cache shape and row count; its module is kept beside it (Kernel._module
            # looks it up by the sorted #defines)
            hit = _call_plans.get(key)
            if hit is None:
                p = _with_output_scale(plan_for(*key[1:7], cc=key[7], density=key[8]), dkv.scaled)
                hit = runtime.remember(_call_plans, key, (p, kernel._module(p.defines), _int_args(s, rows, p)), 1024)
            plan_, mod, ints = hit
        else:
            plan_ = _with_output_scale(plan_, dkv.scaled)
            mod, ints = kernel._module(plan_.defines), _int_args(s, rows, plan_)
        args = ptrs + ints
        n = dout.nbytes // 4
        if self.kind == "value" and n:
            mod.launch(ZERO_ENTRY, (min(-(-n // ZERO_THREADS), 1024), 1, 1), (ZERO_THREADS, 1, 1), 0,
                       (dout.ptr, np.int32(n)), stream=stream, pdl=kernel.spec.pdl)
        mod.launch(kernel.spec.entry, plan_.grid, plan_.block, plan_.shmem, args, stream=stream, pdl=kernel.spec.pdl)

    # -- validation ------------------------------------------------------------------------------
    def make_case(self, shape, seed: int, opts: dict):
        """Random cache (Gaussian fp16), pruned and compressed; queries or probabilities."""
        b, s, d = shape
        lq, groups, sparsity = _opts(opts)
        scale = _cache_scale(opts)
        rng = np.random.default_rng(seed)
        cache = (rng.standard_normal((b, s, d), dtype=np.float32) * np.float32(scale)).astype(np.float16)
        if not np.isfinite(cache).all():
            raise ValueError(f"cache_scale={scale:g}: the random Gaussian cache overflows float16 (its values "
                             f"reach ~5 standard deviations; float16 ends at {_FP16_MAX:g}); take a smaller one")
        ck = _compress(prune(cache, sparsity), self.kind, self.bits, None, self.compact)
        if self.kind == "key":
            x = rng.standard_normal((b * groups, lq, d), dtype=np.float32).astype(np.float16)
        else:
            x = random_probs(rng, (b * groups, lq, s))
        return cache, ck, x

    def validate(self, kernel, shape, seed=None, opts=None, plan_: LaunchPlan | None = None):
        """One fresh random case against the reference (score()); plan_: a launch plan other than
        plan_for's (both versions of a kernel in tests and experiments)."""
        from . import runtime

        why = self.shape_problem(shape)
        if why:
            raise ValueError(f"{kernel.name}: {why}")
        shape = tuple(int(v) for v in shape)
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % (2**31))
        cache, ck, x = self.make_case(shape, seed, opts or {})
        dkv = ck.to_device()
        dx = runtime.DeviceArray.from_host(x)
        oshape, odt = self.out_shape(dkv, x.shape[0], x.shape[1])
        dout = runtime.DeviceArray.empty(oshape, odt)
        dout.fill_bytes(0xFF)  # NaN in fp16 and fp32: an output the kernel never writes shows up
        self.launch(kernel, dkv, dx, dout, x.shape[0] // shape[0] * x.shape[1], plan_=plan_)
        runtime.check_last_error(kernel.name)
        got = dout.to_host()
        r = score(kernel.name, self.kind, shape, seed, got, x, ck, cache, kernel.op.exact_tol)
        dkv.free()
        return r

    # -- timing ----------------------------------------------------------------------------------
    def profile(self, kernel, shape, warmup=10, iters=50, cold=False, opts=None, seed=0):
        from . import bench, runtime

        why = self.shape_problem(shape)
        if why:
            raise ValueError(f"{kernel.name}: {why}")
        shape = tuple(int(v) for v in shape)
        _, ck, x = self.make_case(shape, seed, opts or {})
        t = time_kernel(kernel, self, ck, x, warmup=warmup, iters=iters, cold=cold)
        info = runtime.device_info()
        bw = bench.copy_bandwidth()
        moved = t["bytes"]
        floor = moved / bw * 1e6
        med = t["median_us"]
        flops = 2 * ck.nnz * (x.shape[0] // shape[0]) * x.shape[1]
        return bench.Profile(
            kernel=kernel.name, shape=shape, cold=cold, iters=iters, median_us=med, min_us=t["min_us"], max_us=t["max_us"],
            tflops=flops / (med * 1e-6) / 1e12, bytes=moved, gbps=moved / (med * 1e-6) / 1e9, floor_us=floor,
            roofline_pct=100.0 * floor / med, bound="memory",
            extra={"copy_bandwidth_gbps": bw / 1e9, "compressed_bytes": ck.nbytes, "compressed_gbps": ck.nbytes / (med * 1e-6) / 1e9,
                   "compressed_pct_of_copy": 100.0 * ck.nbytes / (med * 1e-6) / bw, "ratio": ck.ratio,
                   "breakdown": ck.breakdown(), "opts": dict(zip(("lq", "groups", "sparsity"), _opts(opts or {}))),
                   "sm_count": info.sm_count, **t["how"]})


def _opts(opts: dict):
    """(lq, groups, sparsity) of a validate / profile case: the options as given (None: the
    default 1, 4, 0.7). ValueError for lq or groups that are not positive ints."""
    lq, groups = (opts.get(k) for k in ("lq", "groups"))
    lq, groups = (1 if lq is None else lq), (4 if groups is None else groups)
    if not (_positive_int(lq) and _positive_int(groups)):
        raise ValueError(f"lq (query length) and groups (query heads per kv head) must be positive ints, "
                         f"got lq={lq!r}, groups={groups!r}")
    sparsity = opts.get("sparsity")
    sparsity = _check_sparsity(0.7 if sparsity is None else sparsity)
    return int(lq), int(groups), sparsity


def _cache_scale(opts: dict) -> float:
    """The standard deviation of a validate case's random cache (opts["cache_scale"]; None: 1).
    ValueError unless a positive finite number."""
    v = opts.get("cache_scale")
    if v is None:
        return 1.0
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not (np.isfinite(v) and v > 0):
        raise ValueError(f"cache_scale (the random cache's standard deviation) must be a positive finite number, got {v!r}")
    return float(v)


def random_probs(rng, shape) -> np.ndarray:
    """Attention probabilities: softmax of N(0, 2^2) logits over the last axis, float16."""
    z = rng.standard_normal(shape, dtype=np.float32) * 2.0
    z -= z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float16)


def product_energy(x: np.ndarray, cache: np.ndarray, kind: str) -> float:
    """sum over outputs of sum over the reduction of (x * cache)^2: the scale errors are measured
    against (robust to outputs that cancel to ~0)."""
    x2 = np.square(np.asarray(x, dtype=np.float64))
    c2 = np.square(np.asarray(cache, dtype=np.float64))
    return float(reference_scores(x2, c2).sum() if kind == "key" else reference_output(x2, c2).sum())


def score(name: str, kind: str, shape, seed, got, x, ck: CompressedKV, cache, exact_tol: float):
    """A kernel's output against the numpy reference on the decompressed cache (tight: float
    rounding only) and against the dense, unpruned, unquantized computation (reported; must be no
    worse than the reference's own)."""
    from .check import Result

    dec = kernel_values(ck)
    ref = reference_scores if kind == "key" else reference_output
    exact = ref(x, dec)
    truth = ref(x, cache)
    unwritten = int(np.isnan(got).sum())
    fin = np.nan_to_num(got.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    energy = max(product_energy(x, dec, kind), np.finfo(np.float64).tiny)
    rel = float(np.sqrt(np.sum((fin - exact) ** 2) / energy))
    max_abs = float(np.max(np.abs(fin - exact))) if fin.size else 0.0
    den = max(float(np.sum(truth ** 2)), np.finfo(np.float64).tiny)
    nm = float(np.sum((fin - truth) ** 2) / den)
    nm_ref = float(np.sum((exact - truth) ** 2) / den)
    # the kernel's own float rounding on top of the reference's error: ~1e-6 of NMSE on average
    # (fp16 outputs, half2 sums inside a bitmap word), and a mean over few outputs scatters widely
    # around it (a dense fp16 key cache at S = 1, 66 scores, measured 1.6e-6 once in ~900 GPU runs):
    # the floor widens as 9 / sqrt(outputs), as check.nmse_tolerance does for the GEMMs
    nm_tol = 1.05 * nm_ref + 1e-6 * (1.0 + 9.0 / np.sqrt(max(got.size, 1)))
    passed = unwritten == 0 and bool(np.isfinite(got).all()) and rel <= exact_tol and nm <= nm_tol
    note = []
    if unwritten:
        note.append(f"{unwritten} outputs never written")
    if rel > exact_tol:
        note.append(f"rel err {rel:.2e} > {exact_tol:.0e}")
    if nm > nm_tol:
        note.append(f"NMSE vs dense {nm:.3e} > {nm_tol:.3e} (the reference's x1.05)")
    return Result(name, tuple(shape), seed, bool(passed), max_abs, rel, nm, unwritten, exact_tol, nm_tol, "; ".join(note),
                  detail={"rel_err_vs_dense": float(np.sqrt(nm)), "reference_rel_err_vs_dense": float(np.sqrt(nm_ref)),
                          "ratio": ck.ratio, "nbytes": ck.nbytes, "nnz": ck.nnz, "layout": ck.layout,
                          "rows": int(x.shape[0] // shape[0] * x.shape[1])})


def time_kernel(kernel, runner: MustafarRunner, ck: CompressedKV, x: np.ndarray, warmup=10, iters=50, cold=False,
                plan_: LaunchPlan | None = None) -> dict:
    """Time one launch of `kernel` on `ck` with queries / probabilities `x`, graph-batched after
    warm-up (cold: buffer sets rotated through > 2x L2) -> dict: `median_us`, `min_us`, `max_us`,
    `bytes` (moved per launch) and `how` (buffer sets, grid, shared memory, defines). plan_: a
    launch plan other than plan_for's (experiments)."""
    import statistics

    from . import bench, runtime

    b = ck.shape[0]
    rows = x.shape[0] // b * x.shape[1]
    oshape, odt = runner.out_shape(ck, x.shape[0], x.shape[1])
    out_bytes = int(np.prod(oshape)) * np.dtype(odt).itemsize
    moved = ck.nbytes + x.nbytes + out_bytes
    from .bench import cold_sets

    sets = cold_sets(moved) if cold else 1
    info = runtime.device_info()
    dkvs = [DeviceKV.upload(ck) for _ in range(sets)]
    p = _with_output_scale(plan_ or plan_for(runner.kind, runner.bits, ck.shape, rows, info.sm_count, step_bytes_max(ck),
                                            cc=info.cc, density=density(ck)), dkvs[0].scaled)
    kernel._module(p.defines)  # (compiled before the timing)
    dxs = [runtime.DeviceArray.from_host(x) for _ in range(sets)]
    outs = [runtime.DeviceArray.empty(oshape, odt) for _ in range(sets)]

    def launch(i, stream=None):
        runner.launch(kernel, dkvs[i], dxs[i], outs[i], rows, stream=stream, plan_=p)

    times, how = bench._time_launches(launch, sets, warmup, iters)
    runtime.check_last_error(kernel.name)
    for a in dkvs:
        a.free()
    for a in dxs + outs:
        a.free()
    how = dict(how, buffer_sets=sets, grid=list(p.grid), shmem=p.shmem, defines=p.defines)
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times), "bytes": moved, "how": how}


# ---------------------------------------------------------------------------------------------
# the user-facing calls


def kernel_name(kind: str, ck) -> str:
    if getattr(ck, "bits", None) not in BITS:  # a hand-edited cache: say what is wrong with it, not with a kernel name
        raise ValueError(f"a compressed cache's bits must be one of {BITS}, got {getattr(ck, 'bits', None)!r}")
    return f"mustafar.{kind}_{ck.layout}"


def scores(q, ck, *, out=None, stream=None):
    """q . K^T on the compressed key cache: q [B*groups, Lq, D] float16 -> [B*groups, Lq, S] float16
    (grouped-query attention: query head h reads kv head h // groups), by the `mustafar.key_*`
    kernel of the cache's layout. `ck`: a CompressedKV (uploaded at its first use, synchronously,
    and the copy kept: call ck.to_device() first, and always before a CUDA graph capture) or its
    to_device(). Host q -> numpy result, synchronously. Device q -> a qgemm.DeviceArray, or `out=`
    (a writable float16 [B*groups, Lq, S] device array), queued on `stream`.

    ValueError for a cache that is not a compressed key cache, or queries that are not float16
    [B*groups, Lq, D] for it (host queries: also non-finite ones); for a host call, after the
    launch, when a score or a half2 partial sum overflowed float16 (fold 1/sqrt(D) into q:
    docs/mustafar.md, accuracy); a device result is not checked. NoGPUError without a GPU."""
    from . import registry

    if not isinstance(ck, (CompressedKV, DeviceKV)) or ck.kind != "key":
        raise ValueError(f"scores() takes a compressed key cache, got {getattr(ck, 'kind', type(ck).__name__)}")
    return registry.get(kernel_name("key", ck))(q, ck, out=out, stream=stream)


def attend(p, cv, *, out=None, stream=None):
    """p . V on the compressed value cache: p [B*groups, Lq, S] float16 -> [B*groups, Lq, D] float32,
    by the `mustafar.value_*` kernel of the cache's layout; otherwise as `scores` (a compressed
    value cache, probabilities in place of queries; `out=` a writable float32 [B*groups, Lq, D]
    device array, zeroed and then written). p should be attention probabilities (entries at most
    1: softmax rows, or exp(s - max) before the division): larger values can overflow the kernels'
    half2 partial sums (a host call raises). The device copy holds each channel scaled by a power
    of two (channel_exponents) so that small-valued caches keep the accuracy of unit-scale ones."""
    from . import registry

    if not isinstance(cv, (CompressedKV, DeviceKV)) or cv.kind != "value":
        raise ValueError(f"attend() takes a compressed value cache, got {getattr(cv, 'kind', type(cv).__name__)}")
    return registry.get(kernel_name("value", cv))(p, cv, out=out, stream=stream)


def error_report(k: np.ndarray, v: np.ndarray, q: np.ndarray, sparsity: float, bits: int, compact: bool = False) -> dict:
    """Accuracy of compressing k and v at `sparsity`, `bits` (and `compact`), on the numpy float64
    references (no GPU). k, v: float16 [B, S, D] of one shape; q: numeric [B*groups, Lq, D].
    Returns a dict of relative Frobenius errors, with the arguments (`sparsity`, `bits`,
    `compact`): `scores_vs_dense`, `scores_pruning`, `scores_quantization` (q.K^T: compressed vs
    dense, pruned fp16 vs dense, compressed vs pruned), `pv_vs_dense`, `pv_pruning`,
    `pv_quantization` (p.V with the dense probabilities softmax(q.K^T / sqrt(D)) in fp16), and
    `attention_vs_dense` (softmax(q.K^T / sqrt(D)).V with both caches compressed). ValueError for
    operands that are not finite 3-D numeric arrays, k / v not float16 or of different shapes,
    and as prune / compress_keys."""
    for name, a in (("k", k), ("v", v), ("q", q)):
        if not isinstance(a, np.ndarray):
            raise ValueError(f"error_report: {name} must be a numpy array, got {type(a).__name__}")
        if a.ndim != 3 or not np.issubdtype(a.dtype, np.number):
            raise ValueError(f"error_report: {name} must be a 3-D numeric array "
                             f"({'[B*groups, Lq, D]' if name == 'q' else '[B, S, D] float16'}), got {a.dtype} {a.shape}")
        if not np.isfinite(a).all():  # a NaN would read as an infinite error, not as the bad input it is
            raise ValueError(f"error_report: {name} must be finite; found inf or NaN")
    if k.shape != v.shape:
        raise ValueError(f"error_report: k and v must be caches of one shape [B, S, D], got {k.shape} and {v.shape}")
    for name, a in (("k", k), ("v", v)):  # prune() checks them too, but would not say which
        if a.dtype != np.float16:
            raise ValueError(f"error_report: {name} must be a float16 cache, got {a.dtype}")
    d = k.shape[2]
    kp, vp = prune(k, sparsity), prune(v, sparsity)
    kd = decompress(compress_keys(kp, bits, compact=compact))
    vd = decompress(compress_values(vp, bits, compact=compact))

    def softmax(z):
        z = z - z.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)

    s_dense, s_sparse, s_q = reference_scores(q, k), reference_scores(q, kp), reference_scores(q, kd)
    p_dense = softmax(s_dense / np.sqrt(d)).astype(np.float16)
    o_dense = reference_output(p_dense, v)
    o_v = reference_output(p_dense, vd)
    o_vs = reference_output(p_dense, vp)
    attn = reference_output(softmax(s_q / np.sqrt(d)).astype(np.float16), vd)
    return {"sparsity": sparsity, "bits": bits, "compact": compact,
            "scores_vs_dense": rel_error(s_q, s_dense), "scores_pruning": rel_error(s_sparse, s_dense),
            "scores_quantization": rel_error(s_q, s_sparse),
            "pv_vs_dense": rel_error(o_v, o_dense), "pv_pruning": rel_error(o_vs, o_dense), "pv_quantization": rel_error(o_v, o_vs),
            "attention_vs_dense": rel_error(attn, o_dense)}
