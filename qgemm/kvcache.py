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
           `group_offsets [B, G+1] int32`, one offset per 16 tiles (G = ceil(T/16)); the kernels
           recover each tile's offset from the bitmaps' popcounts.

Dequantization (the kernels' arithmetic, reproduced exactly by `decompress`): with L = 2**bits,
    mult = fp16(L * scale),  add = fp16(fp32(-zero * scale) - L * scale)
    value = fp16(h * mult + add),  h = 1 + q / L   (an fp16 built from the code's bits; one rounding)
which is (q - zero) * scale up to the rounding of the two fp16 constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

TILE = 64
GROUP = 16  # tiles per warp step / per compact group offset
BITS = (16, 4, 2)
HEAD_DIMS = (64, 128, 256)
KINDS = ("key", "value")
_FP16_MAX = 65504.0


# ---------------------------------------------------------------------------------------------
# input checks


def _check_cache(x, what: str = "cache") -> np.ndarray:
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
    try:
        s = float(sparsity)
    except (TypeError, ValueError):
        raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}") from None
    if not (0.0 <= s < 1.0) or isinstance(sparsity, bool):
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity!r}")
    return s


def kept_per_token(d: int, sparsity: float) -> int:
    """How many of a token's D values prune() keeps: D - round(sparsity * D) (at least 1)."""
    return max(1, d - int(round(_check_sparsity(sparsity) * d)))


# ---------------------------------------------------------------------------------------------
# pruning


def prune(x: np.ndarray, sparsity: float) -> np.ndarray:
    """Per-token magnitude pruning: in every [b, s, :] keep the D - round(sparsity * D) entries of
    largest magnitude, zero the rest (ties broken by position). float16 in, float16 out."""
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
        idx = np.argpartition(-mag, keep - 1, axis=1)[:, :keep]
        np.put_along_axis(out[i:i + step], idx, np.take_along_axis(r, idx, axis=1), axis=1)
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


def unpack_bits(bitmaps: np.ndarray) -> np.ndarray:
    """int64 [...] -> bool [..., 64] (element i of the tile)."""
    u = np.asarray(bitmaps).view(np.uint64)
    return ((u[..., None] >> np.arange(TILE, dtype=np.uint64)) & np.uint64(1)).astype(bool)


def tile_nbytes(n: np.ndarray, bits: int) -> np.ndarray:
    return (np.asarray(n, dtype=np.int64) * bits + 7) // 8


# ---------------------------------------------------------------------------------------------
# the compressed form


@dataclass
class CompressedKV:
    """A compressed key or value cache (see the module docstring for the layout)."""

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
    _device: object = field(default=None, repr=False, compare=False)

    @property
    def compact(self) -> bool:
        return self.dq is not None

    @property
    def tiles(self) -> int:
        return int(self.bitmaps.shape[1])

    def parts(self) -> dict:
        names = ["bitmaps"] + (["counts", "values"] if self.bits == 16 else
                               (["group_offsets", "packed", "dq"] if self.compact else ["offsets", "packed", "scales", "zeros"]))
        return {n: getattr(self, n) for n in names}

    def breakdown(self) -> dict:
        """Bytes per part, e.g. {'bitmaps': ..., 'offsets': ..., 'packed': ..., 'scales': ..., 'zeros': ...}."""
        return {n: int(a.nbytes) for n, a in self.parts().items()}

    @property
    def nbytes(self) -> int:
        """All bytes of the compressed form, metadata included."""
        return sum(self.breakdown().values())

    @property
    def dense_nbytes(self) -> int:
        b, s, d = self.shape
        return b * s * d * 2

    @property
    def ratio(self) -> float:
        """nbytes / dense float16 bytes."""
        return self.nbytes / self.dense_nbytes

    @property
    def nnz(self) -> int:
        return int(popcount(self.bitmaps).sum())

    @property
    def layout(self) -> str:
        return "fp16" if self.bits == 16 else f"q{self.bits}" + ("c" if self.compact else "")

    def __repr__(self) -> str:
        b, s, d = self.shape
        return (f"<CompressedKV {self.kind} {self.layout} [B={b}, S={s}, D={d}]: {self.nbytes} bytes "
                f"({100 * self.ratio:.1f}% of dense fp16), {self.nnz} non-zeros>")

    def validate(self) -> "CompressedKV":
        validate_compressed(self)
        return self

    def to_device(self):
        """Validate, then upload once (memoized): the kernels' operand."""
        if self._device is None:
            self._device = DeviceKV.upload(self)
        return self._device


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
    scale = np.where(rng > 0, rng / np.float32(levels), np.maximum(np.abs(mn), np.float32(2.0 ** -24)) / np.float32(levels))
    scale = np.where(has, scale, 0).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    zero = np.where(has, -mn / safe, 0).astype(np.float32)
    q = np.rint((xf - mn[..., None]) / safe[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)
    q[~nz] = 0
    return q, scale, zero


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
    if not np.isfinite(dq.astype(np.float32)).all():
        raise ValueError(f"{kind} cache: a tile's value range is too large for the fp16 dequantization constants "
                         f"({1 << bits} x scale must stay below {_FP16_MAX:g})")
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
        g = -(-t // GROUP)
        gidx = np.minimum(np.arange(g + 1) * GROUP, t)
        ends = starts + nb
        go = np.empty((b, g + 1), dtype=np.int64)
        go[:, :g] = starts[:, gidx[:g]]
        go[:, g] = ends[:, -1]
        return CompressedKV(kind, bits, (b, s, d), bm, packed=packed, dq=np.ascontiguousarray(dq),
                            group_offsets=go.astype(np.int32))
    return CompressedKV(kind, bits, (b, s, d), bm, offsets=starts.astype(np.int32), packed=packed,
                        scales=scale.astype(np.float32), zeros=zero.astype(np.float32))


def compress_keys(k: np.ndarray, bits: int = 16, sparsity: float | None = None, compact: bool = False) -> CompressedKV:
    """Compress a (pruned) key cache [B, S, D] float16: tiles along each token's D (K^T column-major).
    Zeros are the pruned entries; pass `sparsity` to prune first."""
    return _compress(k, "key", bits, sparsity, compact)


def compress_values(v: np.ndarray, bits: int = 16, sparsity: float | None = None, compact: bool = False) -> CompressedKV:
    """Compress a (pruned) value cache [B, S, D] float16: tiles along S for each channel (V^T row-major)."""
    return _compress(v, "value", bits, sparsity, compact)


def compact(ck: CompressedKV) -> CompressedKV:
    """The compact layout of a 4/2-bit CompressedKV: same bitmaps and packed codes, fp16 dequant
    constants instead of float32 scale + zero, one int32 offset per 16 tiles. Bit-identical values."""
    validate_compressed(ck)
    if ck.bits == 16 or ck.compact:
        raise ValueError(f"compact() takes a 4/2-bit CompressedKV in the plain layout, got {ck.layout}")
    b, t = ck.bitmaps.shape
    g = -(-t // GROUP)
    nb = tile_nbytes(popcount(ck.bitmaps), ck.bits)
    go = np.empty((b, g + 1), dtype=np.int64)
    go[:, :g] = ck.offsets[:, np.arange(g) * GROUP]
    go[:, g] = ck.offsets[:, -1].astype(np.int64) + nb[:, -1]
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
    try:
        b, s, d = (int(v) for v in ck.shape)
    except Exception:
        raise ValueError(f"{what}: shape must be (B, S, D), got {ck.shape!r}") from None
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
        if ck.compact or ck.offsets is not None or ck.packed is not None:
            raise ValueError(f"{what}: an fp16 layout has counts and values, not offsets/packed/dq")
        c = _arr(ck, "counts", (np.int32, np.int64), (b, t + 1), what).astype(np.int64)
        v = _arr(ck, "values", (np.float16,), None, what)
        if v.ndim != 1:
            raise ValueError(f"{what}: values must be 1-D float16, got shape {v.shape}")
        if c[0, 0] < 0:
            raise ValueError(f"{what}: counts must start at >= 0, got {c[0, 0]}")
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
        g = -(-t // GROUP)
        go = _arr(ck, "group_offsets", (np.int32, np.int64), (b, g + 1), what).astype(np.int64)
        dq = _arr(ck, "dq", (np.float16,), (b, t, 2), what)
        if not np.isfinite(dq.astype(np.float32)).all():
            raise ValueError(f"{what}: dq must be finite")
        start = go[0, 0]
        if start < 0:
            raise ValueError(f"{what}: offsets must be >= 0, got {start}")
        flat = start + np.concatenate([[0], np.cumsum(nb.ravel())])
        tile_start = flat[:-1].reshape(b, t)
        want = np.empty((b, g + 1), dtype=np.int64)
        want[:, :g] = tile_start[:, np.arange(g) * GROUP]
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
        if not np.isfinite(dequant_constants(sc, ze, ck.bits).astype(np.float32)).all():
            raise ValueError(f"{what}: a scale or zero overflows the fp16 dequantization constants")
        start = off[0, 0]
        if start < 0:
            raise ValueError(f"{what}: offsets must be >= 0, got {start}")
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
    is set, zeros elsewhere)."""
    b, s, d = ck.shape
    return from_tiles(tile_values(ck), ck.kind, s, d)


def _groups_of(rows: int, b: int, what: str) -> int:
    if rows % b:
        raise ValueError(f"{what}: {rows} query heads is not a multiple of the cache's B={b} (B x groups expected)")
    return rows // b


def reference_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Scores q . K^T in float64: q [B*groups, Lq, D], K [B, S, D] -> [B*groups, Lq, S]
    (grouped-query attention: query head h uses kv head h // groups)."""
    b, s, d = k.shape
    bg, lq, dq = q.shape
    if dq != d:
        raise ValueError(f"queries have D={dq}, the key cache D={d}")
    g = _groups_of(bg, b, "queries")
    qq = np.asarray(q, dtype=np.float64).reshape(b, g * lq, d)
    return np.matmul(qq, np.asarray(k, dtype=np.float64).transpose(0, 2, 1)).reshape(bg, lq, s)


def reference_output(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Attention output p . V in float64: p [B*groups, Lq, S], V [B, S, D] -> [B*groups, Lq, D]."""
    b, s, d = v.shape
    bg, lq, sp = p.shape
    if sp != s:
        raise ValueError(f"probabilities have S={sp}, the value cache S={s}")
    g = _groups_of(bg, b, "probabilities")
    pp = np.asarray(p, dtype=np.float64).reshape(b, g * lq, s)
    return np.matmul(pp, np.asarray(v, dtype=np.float64)).reshape(bg, lq, d)


def rel_error(x: np.ndarray, ref: np.ndarray) -> float:
    """||x - ref|| / ||ref|| (Frobenius, float64)."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = float(np.sqrt(np.sum(ref * ref)))
    num = float(np.sqrt(np.sum((x - ref) ** 2)))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)
