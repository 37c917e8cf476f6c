"""ggml block formats (Q4_0, Q8_0, Q8_1): numpy layouts, quantizers and dequantizers.

Every block covers 32 consecutive values along K. The byte layouts are ggml's, to the byte:

    block_q4_0  {half d; uint8 qs[16];}          18 bytes  element j -> low nibble of qs[j],
                                                           element j+16 -> high nibble of qs[j]
    block_q8_0  {half d; int8  qs[32];}          34 bytes
    block_q8_1  {half d; half s; int8 qs[32];}   36 bytes  s = sum of the 32 *original* floats

`quantize_q4_0` / `quantize_q8_0` reproduce ggml's reference quantizers (`quantize_row_q4_0_ref`,
`quantize_row_q8_0_ref`) bit for bit, float32 arithmetic included; `gguf.quants` is the oracle in
the tests. `quantize_q8_1` reproduces the source of ggml's CUDA activation quantizer (`quantize_q8_1`
in ggml-cuda/quantize.cu) in IEEE float32, including the order of its warp-shuffle sum, so the GPU
kernel `quantize.q8_1` and this function agree byte for byte. llama.cpp builds that source with
`-use_fast_math`: its division is approximate (within 2 ulp), so a code whose x / d falls within an
ulp or two of a .5 boundary can come out one step apart there; and it flushes subnormals, as
`quantize_q8_1` does for a block whose largest magnitude is one (all its codes 0) but not for a
subnormal value in a block of normal ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # values per block, for every format here

block_q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])
block_q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])
block_q8_1 = np.dtype([("d", "<f2"), ("s", "<f2"), ("qs", "i1", (QK,))])

assert block_q4_0.itemsize == 18 and block_q8_0.itemsize == 34 and block_q8_1.itemsize == 36

_HALF_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class Format:
    """An operand format: how a [rows, K] matrix is stored."""

    name: str  # "f32", "f16", "q4_0", "q8_0", "q8_1"
    dtype: np.dtype  # element dtype (floats) or block dtype (quantized)
    block: int  # values per element of `dtype` along K (1 for floats, 32 for blocks)
    description: str

    @property
    def quantized(self) -> bool:
        """Blocks of values (a block dtype), not plain floats."""
        return self.block > 1

    def nbytes(self, rows: int, k: int) -> int:
        """Bytes of a [rows, K] matrix in this format; ValueError for negative sizes or a K the
        blocks do not divide."""
        if rows < 0 or k < 0:
            raise ValueError(f"{self.name}: rows and K must not be negative, got rows={rows}, K={k}")
        if k % self.block:
            raise ValueError(f"{self.name}: K must be a multiple of {self.block} (the block size), got K={k}")
        return rows * (k // self.block) * self.dtype.itemsize

    def bits_per_value(self) -> float:
        """Bits stored per value, the block's scales included (Q4_0: 4.5)."""
        return 8.0 * self.dtype.itemsize / self.block

    def __str__(self) -> str:
        return self.name


F32 = Format("f32", np.dtype(np.float32), 1, "float32 values")
F16 = Format("f16", np.dtype(np.float16), 1, "float16 values")
# numpy has no bfloat16. qgemm holds bfloat16 arrays as numpy's opaque 2-byte void, the type
# torch's __cuda_array_interface__ and ml_dtypes' bfloat16 report ('<V2'); ml_dtypes arrays, and
# torch tensors whose interface still said '<f2' for bfloat16 (torch 2.5), are viewed as it on the
# way in (`as_bf16`, qgemm.runtime). A value is the high 16 bits of a float32.
BF16_DTYPE = np.dtype("V2")
BF16 = Format("bf16", BF16_DTYPE, 1, "bfloat16 values (held as numpy's opaque 2-byte void '|V2', as torch "
              "and ml_dtypes export them)")
Q4_0 = Format("q4_0", block_q4_0, QK, "ggml Q4_0 blocks {half d; uint8 qs[16]} (18 B / 32 values)")
Q8_0 = Format("q8_0", block_q8_0, QK, "ggml Q8_0 blocks {half d; int8 qs[32]} (34 B / 32 values)")
Q8_1 = Format("q8_1", block_q8_1, QK, "ggml Q8_1 blocks {half d; half s; int8 qs[32]} (36 B / 32 values)")

FORMATS = {f.name: f for f in (F32, F16, BF16, Q4_0, Q8_0, Q8_1)}


def get_format(name: str | Format, who: str | None = None) -> Format:
    """The Format named `name` ("f32", "f16", "bf16", "q4_0", "q8_0", "q8_1", in any case); a Format is
    returned as it is. ValueError for another name or a non-string, its message starting with
    `who` (the caller the name was given to) when given."""
    if isinstance(name, Format):
        return name
    at = f"{who}: " if who else ""
    if not isinstance(name, str):
        raise ValueError(f"{at}a format is one of {', '.join(FORMATS)} (a string), got {name!r}")
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise ValueError(f"{at}unknown format {name!r}; known: {', '.join(FORMATS)}") from None


# --------------------------------------------------------------------------------------------
# bfloat16 on the host


def is_bf16(dtype) -> bool:
    """Whether `dtype` is bfloat16 as qgemm sees it: ml_dtypes' bfloat16, or the bare 2-byte void
    (not a structured type) that torch and ml_dtypes report for it."""
    try:
        dt = np.dtype(dtype)
    except TypeError:  # a name numpy does not know ("bfloat16" without ml_dtypes), a torch dtype
        return False
    return dt.itemsize == 2 and (dt.name == "bfloat16" or (dt.kind == "V" and dt.names is None and dt.subdtype is None))


def as_bf16(a: np.ndarray) -> np.ndarray:
    """A bfloat16 array (is_bf16) viewed as BF16_DTYPE, without a copy."""
    a = np.asarray(a)
    if not is_bf16(a.dtype):
        raise ValueError(f"as_bf16: expected bfloat16 values (ml_dtypes.bfloat16 or the 2-byte void '|V2'), got {a.dtype}")
    return a if a.dtype == BF16_DTYPE else a.view(BF16_DTYPE)


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """bfloat16 -> float32, exactly (the 16 bits become a float32's high half; NaN and inf kept)."""
    bits = np.ascontiguousarray(as_bf16(a)).view(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x) -> np.ndarray:
    """float32 (or anything numpy converts to it) -> bfloat16 (BF16_DTYPE), rounded to nearest
    even as torch's `.to(torch.bfloat16)` and the GPU's __float2bfloat16_rn; NaN stays NaN, values
    past bfloat16's largest finite (3.39e38) round to inf."""
    with np.errstate(over="ignore", invalid="ignore"):
        bits = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (bits >> 16) | 0x0040, rounded).astype(np.uint16)  # a NaN kept quiet, its sign kept
    return out.view(BF16_DTYPE)


def to_float32(x) -> np.ndarray:
    """Float activations of any supported type (float32, float16, bfloat16) as float32; the
    16-bit types convert exactly."""
    a = np.asarray(x)
    return bf16_to_f32(a) if is_bf16(a.dtype) else a.astype(np.float32, copy=False)


def from_float32(x: np.ndarray, fmt: "Format") -> np.ndarray:
    """float32 values in a float format (f32, f16 or bf16: each rounded to nearest even; past the
    format's range, inf)."""
    fmt = get_format(fmt)
    if fmt.quantized:
        raise ValueError(f"from_float32: {fmt.name} is a block format; use quantize")
    if fmt is BF16:
        return f32_to_bf16(x)
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(fmt.dtype)


# --------------------------------------------------------------------------------------------
# input checks shared by the quantizers


def _as_blocks(x: np.ndarray, what: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate a float array [..., K] and view it as float32 blocks [nblocks, 32]."""
    if not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__"):  # torch (CUDA), CuPy, DeviceArray
        dt = getattr(x, "dtype", None)
        try:
            bf16 = is_bf16(dt)
        except TypeError:  # torch's dtypes are not numpy's
            bf16 = "bfloat16" in str(dt)
        suffix = "_bf16" if bf16 else "_f16" if "float16" in str(dt) else ""
        kernel = what.replace("quantize_", "quantize.", 1) + suffix
        raise ValueError(f"{what}: this is the CPU (numpy) quantizer and got a device array; on the GPU, "
                         f"qgemm.get({kernel!r})(x) writes the same bytes" + (
                             " (qgemm.pack_weights(x, fmt) quantizes float weights for matmul)" if "q8_1" not in what else ""))
    x = np.asarray(x)
    if is_bf16(x.dtype):  # bfloat16 (qgemm's f32_to_bf16, torch's and ml_dtypes' form): exactly float32
        x = bf16_to_f32(x)
    if x.dtype.kind != "f":
        raise ValueError(f"{what}: expected a floating-point array (float16, bfloat16, float32 or float64), got dtype "
                         f"{x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{what}: expected an array [..., K], got a scalar")
    k = x.shape[-1]
    if k == 0 or k % QK:
        raise ValueError(f"{what}: K (last dimension) must be a positive multiple of {QK}, got K={k}")
    if not np.isfinite(x).all():
        bad = np.argwhere(~np.isfinite(x))[0]
        raise ValueError(f"{what}: input must be finite; found {x[tuple(bad)]} at index {tuple(int(i) for i in bad)}")
    if x.dtype.itemsize > 4 and np.abs(x).max(initial=0) > np.finfo(np.float32).max:
        raise ValueError(f"{what}: input {np.abs(x).max():.3g} does not fit in float32 (the quantizers compute in float32)")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        bad = np.argwhere(~np.isfinite(x))[0]
        raise ValueError(f"{what}: input must be finite; found {x[tuple(bad)]} at index {tuple(int(i) for i in bad)}")
    return x.reshape(-1, QK), x.shape[:-1] + (k // QK,)


def _to_half(values: np.ndarray, what: str, field: str) -> np.ndarray:
    """float32 -> float16 (round to nearest even, as __float2half_rn / GGML_FP32_TO_FP16)."""
    with np.errstate(over="ignore"):
        h = values.astype(np.float16)
    if not np.isfinite(h).all():
        i = int(np.argmax(~np.isfinite(h)))
        raise ValueError(
            f"{what}: block {i} has {field} = {float(values.flat[i]):.6g}, which overflows half "
            f"(max {_HALF_MAX:g}); scale the input down"
        )
    return h


def _roundf(x: np.ndarray) -> np.ndarray:
    """C roundf: round half away from zero (np.round would round half to even).

    Not floor(|x| + 0.5): in float32, 0.49999997 + 0.5 rounds up to 1.0. The fractional part
    |x| - floor(|x|) is exact, and so is doubling it, so this decides .5 without any rounding."""
    a = np.abs(x)
    fl = np.floor(a)
    return np.sign(x) * (fl + np.floor(2 * (a - fl)))


# --------------------------------------------------------------------------------------------
# quantizers


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """float [..., K] -> Q4_0 blocks [..., K/32], byte-identical to ggml's quantize_row_q4_0_ref.

    ggml takes the value of largest magnitude *with its sign* (`max`) and sets d = max / -8, so
    that value maps to exactly -8 (stored nibble 0) and the opposite side gets the range up to +7.
    A common simplified Q4_0 (d = amax/7, the tutorial's starting point) gives other bytes:
    docs/formats.md compares the two.

    ValueError for a non-float or non-finite input, K (the last dimension) not a positive
    multiple of 32, or a scale d that overflows half.
    """
    blocks, out_shape = _as_blocks(x, "quantize_q4_0")
    # first index of the largest |x| (ggml's loop uses a strict '<', so the first one wins)
    imax = np.abs(blocks).argmax(axis=1)
    vmax = blocks[np.arange(blocks.shape[0]), imax]
    d = vmax / np.float32(-8.0)
    # |max| below ~2.4e-38: 1/d overflows to inf and the products reach the integer cast as inf / NaN,
    # as in ggml (and gguf's numpy quantizer, whose bytes these stay: tested); d is half 0 there
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        # (int8_t)(x*id + 8.5f) truncates toward zero; then MIN(15, .)
        q = np.trunc(blocks * inv_d[:, None] + np.float32(8.5)).astype(np.int32)
    q = np.clip(q, 0, 15).astype(np.uint8)
    out = np.empty(blocks.shape[0], dtype=block_q4_0)
    out["d"] = _to_half(d, "quantize_q4_0", "d")
    out["qs"] = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
    return out.reshape(out_shape)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float [..., K] -> Q8_0 blocks [..., K/32], byte-identical to ggml's quantize_row_q8_0_ref.

    ValueError for a non-float or non-finite input, K (the last dimension) not a positive
    multiple of 32, or a scale d that overflows half."""
    blocks, out_shape = _as_blocks(x, "quantize_q8_0")
    amax = np.abs(blocks).max(axis=1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # tiny amax: as in quantize_q4_0
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        q = _roundf(blocks * inv_d[:, None]).astype(np.int8)
    out = np.empty(blocks.shape[0], dtype=block_q8_0)
    out["d"] = _to_half(d, "quantize_q8_0", "d")
    out["qs"] = q
    return out.reshape(out_shape)


def warp_sum_32(blocks: np.ndarray) -> np.ndarray:
    """Sum 32 float32 lanes in the order of a __shfl_xor_sync butterfly (offsets 16, 8, 4, 2, 1).

    Every lane of the butterfly ends with the same bits, and this is that tree: at offset o the
    partial sums of lanes i and i^o are added, which for the surviving lanes 0..o-1 is v[i] + v[i+o].
    Float addition is not associative, so mirroring the tree is what makes `s` byte-identical.
    """
    v = np.asarray(blocks).astype(np.float32, copy=False)
    if v.ndim != 2 or v.shape[1] != QK:
        raise ValueError(f"warp_sum_32: expected [n, {QK}] (the {QK} lanes of each sum), got shape {v.shape}")
    width = QK
    with np.errstate(over="ignore", invalid="ignore"):  # an inf sum is the GPU's too; the callers judge it
        while width > 1:
            width //= 2
            v = v[:, :width] + v[:, width : 2 * width]
    return v[:, 0]


def quantize_q8_1(x: np.ndarray) -> np.ndarray:
    """float [..., K] -> Q8_1 blocks [..., K/32], as ggml's CUDA quantize_q8_1 computes them.

    d = amax / 127, q = roundf(x / d) (a true division, as qgemm's kernel does; llama.cpp's
    -use_fast_math build divides approximately: the module's docstring), s = sum of the 32
    original float values (not of q*d): the W4A8 compensation d_w*(d_a*sumi - 8*s_a) uses it.
    A block whose largest magnitude is subnormal (below FLT_MIN, 1.18e-38) gets codes 0, as in
    llama.cpp's -use_fast_math build, which flushes it to zero; d and s are computed as usual (both
    are 0 in half there). In IEEE arithmetic its x / d could pass 127.5 and the code's sign wrap.

    ValueError for a non-float or non-finite input, K (the last dimension) not a positive
    multiple of 32, or a scale d or sum s that overflows half.
    """
    blocks, out_shape = _as_blocks(x, "quantize_q8_1")
    amax = np.abs(blocks).max(axis=1)
    s = warp_sum_32(blocks)
    d = amax / np.float32(127)
    # from FLT_MIN up d keeps >= 16 significant bits, so |x / d| rounds to <= 127 (the kernel's
    # common/quantize_q8_1.cuh); below it the block is flushed, and the division never sees d = 0
    normal = amax >= np.finfo(np.float32).tiny
    r = np.where(normal[:, None], blocks / np.where(normal, d, np.float32(1))[:, None], np.float32(0))
    q = _roundf(r).astype(np.int8)
    out = np.empty(blocks.shape[0], dtype=block_q8_1)
    out["d"] = _to_half(d, "quantize_q8_1", "d")
    out["s"] = _to_half(s, "quantize_q8_1", "s (the block sum)")
    out["qs"] = q
    return out.reshape(out_shape)


QUANTIZERS = {"q4_0": quantize_q4_0, "q8_0": quantize_q8_0, "q8_1": quantize_q8_1}


def quantize(x: np.ndarray, fmt: str | Format) -> np.ndarray:
    """Quantize float [..., K] into `fmt` ("q4_0", "q8_0", "q8_1"): quantize_q4_0, quantize_q8_0 or
    quantize_q8_1, and their ValueErrors; ValueError too for another format."""
    f = get_format(fmt, "quantize")
    if f.name not in QUANTIZERS:
        raise ValueError(f"quantize: {f.name} is not a quantized format; expected one of {', '.join(QUANTIZERS)}")
    return QUANTIZERS[f.name](x)


# --------------------------------------------------------------------------------------------
# dequantizers and raw-byte views


def block_format_of(dtype) -> str | None:
    """The block format whose structured dtype this is ('q4_0', ...), or None."""
    return next((g.name for g in FORMATS.values() if g.quantized and g.dtype == dtype), None)


def as_blocks(a: np.ndarray, fmt: str | Format, what: str = "array") -> np.ndarray:
    """View `a` as blocks of `fmt`: accepts the structured block dtype, or raw uint8 bytes
    [..., nblocks*itemsize] as gguf.quants.quantize returns them. Raises ValueError otherwise."""
    f = get_format(fmt, what)
    if not f.quantized:
        raise ValueError(f"{what}: {f.name} is not a block format")
    if isinstance(a, np.void) and a.dtype == f.dtype:  # blocks[i, j]: one block, refused below as 0-d
        a = np.asarray(a)
    if not isinstance(a, np.ndarray):  # a list of blocks (e.g. .tolist()) cannot become blocks again
        raise ValueError(f"{what}: expected a numpy array of {f.name} blocks (or raw uint8 bytes), got {type(a).__name__}")
    if a.dtype == f.dtype:
        if a.ndim == 0:  # a lone block (np.zeros((), dtype)): every user indexes the last axis
            raise ValueError(f"{what}: expected an array of {f.name} blocks [..., K/32], got a 0-d block; "
                             "a single block is shape (1,)")
        return a
    if a.dtype == np.uint8 and a.ndim >= 1:
        if a.shape[-1] % f.dtype.itemsize:
            raise ValueError(
                f"{what}: raw {f.name} bytes must have a last dimension that is a multiple of "
                f"{f.dtype.itemsize} (one block), got {a.shape[-1]}"
            )
        return np.ascontiguousarray(a).view(f.dtype)
    came = block_format_of(a.dtype) or str(a.dtype)
    raise ValueError(f"{what}: expected {f.name} blocks ({f.description}), got {came} with shape {a.shape}")


def unpack_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks [..., nb] -> stored nibbles [..., nb*32] in [0, 15] (element order)."""
    blocks = as_blocks(blocks, Q4_0, "unpack_q4_0")
    qs = blocks["qs"]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # low nibbles are 0..15, high are 16..31
    return q.reshape(blocks.shape[:-1] + (blocks.shape[-1] * QK,))


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks [..., K/32] (block_q4_0, or their raw uint8 bytes) -> float32 [..., K]:
    d * (q - 8), q the stored nibble. ValueError for anything else."""
    b = as_blocks(blocks, Q4_0, "dequantize_q4_0")
    q = np.concatenate([b["qs"] & 0x0F, b["qs"] >> 4], axis=-1).astype(np.int8) - np.int8(8)
    x = b["d"].astype(np.float32)[..., None] * q.astype(np.float32)
    return x.reshape(b.shape[:-1] + (b.shape[-1] * QK,))  # explicit: -1 cannot be inferred with zero rows


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 blocks [..., K/32] (block_q8_0, or their raw uint8 bytes) -> float32 [..., K]: d * q.
    ValueError for anything else."""
    b = as_blocks(blocks, Q8_0, "dequantize_q8_0")
    x = b["d"].astype(np.float32)[..., None] * b["qs"].astype(np.float32)
    return x.reshape(b.shape[:-1] + (b.shape[-1] * QK,))


def dequantize_q8_1(blocks: np.ndarray) -> np.ndarray:
    """Q8_1 blocks [..., K/32] (block_q8_1, or their raw uint8 bytes) -> float32 [..., K]: d * q
    (the block sum s is not needed). ValueError for anything else."""
    b = as_blocks(blocks, Q8_1, "dequantize_q8_1")
    x = b["d"].astype(np.float32)[..., None] * b["qs"].astype(np.float32)
    return x.reshape(b.shape[:-1] + (b.shape[-1] * QK,))


DEQUANTIZERS = {"q4_0": dequantize_q4_0, "q8_0": dequantize_q8_0, "q8_1": dequantize_q8_1}


def dequantize(blocks: np.ndarray, fmt: str | Format) -> np.ndarray:
    """Blocks of `fmt` ("q4_0", "q8_0", "q8_1") [..., K/32] -> float32 [..., K]: dequantize_q4_0,
    dequantize_q8_0 or dequantize_q8_1. ValueError for another format or operand."""
    f = get_format(fmt, "dequantize")
    if f.name not in DEQUANTIZERS:
        raise ValueError(f"dequantize: {f.name} is not a quantized format")
    return DEQUANTIZERS[f.name](blocks)


def nonfinite_block(blocks: np.ndarray, fields=("d", "s")):
    """(field, (row, block), value) of the first 2-D block whose scale d (or, for Q8_1, sum s) is
    inf or NaN -- a corrupt block makes its whole row of outputs inf / NaN -- else None."""
    for f in fields:
        if f in blocks.dtype.names:
            bad = ~np.isfinite(blocks[f])
            if bad.any():
                at = tuple(int(i) for i in np.argwhere(bad)[0])
                return f, at, blocks[f][at]
    return None


# float32 products of this magnitude or more round to float16 inf (max finite 65504)
F16_INF_FROM = 65520.0


def f16_dequant_overflow(blocks: np.ndarray, fmt: str):
    """(row, block, d) of the first 2-D Q4_0 / Q8_0 block whose dequantized weights d * q do not fit
    float16, else None.

    The fp16 tensor-core kernels (w4a16.* / w8a16.* .mma, .skinny, .wgmma and .wgmma_rs)
    dequantize each weight with one float16 multiply, d x (q - 8) or d x q, so a block with
    |d x q| >= 65520 turns into inf there (the products are exact in float32: an 11-bit d times
    an 8-bit q). ggml's quantizers make such blocks only from weights beyond half's range (|d| >
    8190 for Q4_0, > 515.9 for Q8_0); the int8 and fp32 paths take them."""
    f = get_format(fmt, "f16_dequant_overflow")
    if f.name not in ("q4_0", "q8_0"):
        raise ValueError(f"f16_dequant_overflow: fmt must be 'q4_0' or 'q8_0' (the weight formats), got {fmt!r}")
    b = as_blocks(blocks, f, "f16_dequant_overflow")
    qmax = np.float32(8 if f.name == "q4_0" else 128)  # the largest |q - 8| / |q| a block can hold
    # first one pass over the half bits (|d| orders as its bits do): matmul runs this on every host
    # call, and real weights never come near the limit (d ~ 1e-2)
    dmax = np.bitwise_and(b["d"].view(np.uint16), 0x7FFF).max(initial=0).view(np.float16)
    if np.float32(dmax) * qmax < np.float32(F16_INF_FROM):
        return None
    d = np.abs(b["d"].astype(np.float32))
    cand = np.argwhere(d * qmax >= np.float32(F16_INF_FROM))  # few: only these are unpacked
    for at in cand:
        blk = b[tuple(at)]
        if f.name == "q4_0":
            q = np.concatenate([blk["qs"] & 0x0F, blk["qs"] >> 4]).astype(np.float32) - np.float32(8)
        else:
            q = blk["qs"].astype(np.float32)
        if np.abs(d[tuple(at)] * q).max() >= np.float32(F16_INF_FROM):
            return int(at[0]), int(at[-1]), float(blk["d"])
    return None


def nmse(x: np.ndarray, ref: np.ndarray) -> float:
    """Normalised mean squared error ||x - ref||^2 / ||ref||^2, in float64."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:  # broadcasting would compare other elements than the caller meant
        raise ValueError(f"nmse: x and ref must have the same shape, got {x.shape} and {ref.shape}")
    den = float(np.sum(ref * ref))
    num = float(np.sum((x - ref) ** 2))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))
