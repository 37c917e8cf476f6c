"""numpy references. Convention everywhere: C[M,N] = A[M,K] . W[N,K]^T.

Two kinds, both in float64:
- `truth(a, w)`: the product of the original, unquantized float matrices. Quantized kernels are
  compared with it by NMSE, at quantization-level tolerance.
- `exact_*`: the arithmetic a kernel performs on its operands, exactly: integer dot products are
  computed in integers, then the per-block float formula. A kernel must agree with it to float
  rounding (tight tolerance); a disagreement there is a bug, not quantization error.
"""

from __future__ import annotations

import numpy as np

from . import formats as F


def _check_k(what: str, ka: int, kw: int, unit: str = "K") -> None:
    """The two operands must share K: a mismatch would otherwise broadcast into a wrong answer
    (per-block scales) or fail deep inside numpy."""
    if ka != kw:
        raise ValueError(f"{what}: K mismatch: A has {unit}={ka}, W has {unit}={kw}")


def truth(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 ground truth A . W^T of float matrices (ValueError for block arrays: dequantize
    them first, e.g. formats.dequantize)."""
    a, w = (F.to_float32(x) if F.is_bf16(x.dtype) else x for x in (np.asarray(a), np.asarray(w)))
    for name, x in (("A", a), ("W", w)):
        if x.dtype.names is not None or x.dtype.kind not in "fiub":
            raise ValueError(f"reference: {name} must be a float matrix, got dtype {x.dtype}"
                             + (" (quantized blocks: dequantize them first)" if x.dtype.names is not None else ""))
    a, w = a.astype(np.float64, copy=False), w.astype(np.float64, copy=False)
    if a.ndim != 2 or w.ndim != 2:
        raise ValueError(f"reference: A and W must be 2-D [M, K] and [N, K], got shapes {a.shape} and {w.shape}")
    _check_k("reference", a.shape[1], w.shape[1])
    return a @ w.T


def exact_fp32(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """FP32 GEMM: the kernel multiplies float32 values; the exact product of those values."""
    return truth(np.asarray(a, dtype=np.float32), np.asarray(w, dtype=np.float32))


def exact_w4a16(a: np.ndarray, w_q4_0: np.ndarray) -> np.ndarray:
    """W4A16: float32 activations x dequantized Q4_0 weights, d * (nibble - 8), exactly."""
    wd = F.dequantize_q4_0(w_q4_0).astype(np.float64)  # every value is exact in float32
    return truth(np.asarray(a, dtype=np.float32), wd)


def exact_w8a16(a: np.ndarray, w_q8_0: np.ndarray) -> np.ndarray:
    """W8A16: float32 activations x dequantized Q8_0 weights (d * q), exactly."""
    return truth(np.asarray(a, dtype=np.float32), F.dequantize_q8_0(w_q8_0))


def dequantize_to_f16(w: np.ndarray, fmt: str) -> np.ndarray:
    """Weights as the fp16 tensor-core kernels see them: d * (q - 8) (Q4_0) or d * q (Q8_0)
    computed from the half d and rounded once to float16 (HMUL2, round to nearest even).
    w: blocks [N, K/32] (ValueError for another rank: a 1-D array would read as one row of K)."""
    f = F.get_format(fmt)
    if f.name not in ("q4_0", "q8_0"):
        raise ValueError(f"dequantize_to_f16: fmt must be 'q4_0' or 'q8_0' (the weight formats), got {fmt!r}")
    b = _blocks_2d(w, f, "W", "dequantize_to_f16")
    q = F.unpack_q4_0(b).astype(np.float32) - 8 if f.name == "q4_0" else b["qs"].reshape(b.shape[0], -1).astype(np.float32)
    d = np.repeat(b["d"].astype(np.float32), F.QK, axis=-1).reshape(q.shape)
    return (d * q).astype(np.float16)  # the float32 product of two halves is exact; one rounding


def exact_w4a16h(a_f16: np.ndarray, w_q4_0: np.ndarray) -> np.ndarray:
    """W4A16 on fp16 tensor cores: float16 activations x fp16-rounded dequantized Q4_0, exactly."""
    return truth(np.asarray(a_f16, dtype=np.float16), dequantize_to_f16(w_q4_0, "q4_0"))


def exact_w8a16h(a_f16: np.ndarray, w_q8_0: np.ndarray) -> np.ndarray:
    """W8A16 on fp16 tensor cores: float16 activations x fp16-rounded dequantized Q8_0, exactly."""
    return truth(np.asarray(a_f16, dtype=np.float16), dequantize_to_f16(w_q8_0, "q8_0"))


def exact_w4a16s(a_f32: np.ndarray, w_q4_0: np.ndarray) -> np.ndarray:
    """The skinny kernels (w4a16.skinny): float32 activations rounded to float16 in registers
    (round to nearest even, as numpy's astype), then exactly exact_w4a16h. float16 / bfloat16
    activations (the *_f16 / *_bf16 variants) are widened to float32 exactly first."""
    return exact_w4a16h(F.to_float32(a_f32).astype(np.float16), w_q4_0)


def exact_w8a16s(a_f32: np.ndarray, w_q8_0: np.ndarray) -> np.ndarray:
    """w8a16.skinny: float32 activations rounded to float16, then exactly exact_w8a16h."""
    return exact_w8a16h(F.to_float32(a_f32).astype(np.float16), w_q8_0)


def _blocks_2d(a, fmt: F.Format, role: str, what: str) -> np.ndarray:
    """Blocks [rows, K/32]: a 1-D array of blocks would pass as one row of K and misalign the sums."""
    b = F.as_blocks(a, fmt, role)
    if b.ndim != 2:
        raise ValueError(f"{what}: {role} must be 2-D [rows, K/32] {fmt.name} blocks, got shape {b.shape}")
    return b


def block_sumi(qa: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Per-block integer dot products: qa [M, nb, 32] x qw [N, nb, 32] -> int64 [M, N, nb].

    Computed as float64 matmuls (BLAS-fast) that are still exact: every partial sum is an
    integer with |sumi| <= 32 * 128 * 128 = 2^19, far below 2^53."""
    m, nb, _ = qa.shape
    n = qw.shape[0]
    _check_k("reference", nb * F.QK, qw.shape[1] * F.QK)
    out = np.empty((m, n, nb), dtype=np.int64)
    qa64 = qa.astype(np.float64)
    qw64 = qw.astype(np.float64)
    for b in range(nb):
        out[:, :, b] = np.rint(qa64[:, b, :] @ qw64[:, b, :].T).astype(np.int64)
    return out


def exact_w4a8(a_q8_1: np.ndarray, w_q4_0: np.ndarray) -> np.ndarray:
    """W4A8 (Q8_1 x Q4_0), as llama.cpp's vec_dot_q4_0_q8_1 computes it:

        per block:  sumi = sum_i q_a[i] * q_w[i]     with the *stored* nibbles q_w in [0, 15]
                    acc += d_w * (d_a * sumi - 8 * s_a)

    The -8 offset of Q4_0 is folded into one correction per block using s_a (the sum of the
    original activations) instead of sum(q_a) * d_a; docs/compensation.md derives it.
    """
    a = _blocks_2d(a_q8_1, F.Q8_1, "A", "exact_w4a8")
    w = _blocks_2d(w_q4_0, F.Q4_0, "W", "exact_w4a8")
    qa = a["qs"]  # [M, nb, 32]
    qw = np.concatenate([w["qs"] & 0x0F, w["qs"] >> 4], axis=-1)  # [N, nb, 32] in [0, 15]
    sumi = block_sumi(qa, qw).astype(np.float64)
    da = a["d"].astype(np.float64)[:, None, :]
    sa = a["s"].astype(np.float64)[:, None, :]
    dw = w["d"].astype(np.float64)[None, :, :]
    return np.sum(dw * (da * sumi - 8.0 * sa), axis=-1)


def exact_w8a8(a_q8_1: np.ndarray, w_q8_0: np.ndarray) -> np.ndarray:
    """W8A8 (Q8_1 x Q8_0): per block d_w * d_a * sumi (s_a is not needed: Q8_0 has no offset)."""
    a = _blocks_2d(a_q8_1, F.Q8_1, "A", "exact_w8a8")
    w = _blocks_2d(w_q8_0, F.Q8_0, "W", "exact_w8a8")
    sumi = block_sumi(a["qs"], w["qs"]).astype(np.float64)
    da = a["d"].astype(np.float64)[:, None, :]
    dw = w["d"].astype(np.float64)[None, :, :]
    return np.sum(dw * da * sumi, axis=-1)


INV127_F32 = np.float32(float.fromhex("0x1.020408p-7"))  # fl32(1/127), the kernels' constant
# below this amax a block quantizes to 0, as in the kernels (skinny_i8.cuh: `amax >= 0x1p-118f`);
# 127 / amax itself overflows float32 only below ~2^-121 (127 / FLT_MAX): 3 binades of margin
I8_TINY = np.float32(2.0 ** -118)


def quantize_rows_i8(a_f32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The activation quantization of the skinny int8 kernels (w4a8.skinny, w8a8.skinny), in
    float32 exactly as the GPU does it: per block of 32, amax = max |x|,
    q = rint(x * (127 / amax)) (IEEE division; round half to even), d = amax * fl(1/127) (one
    rounding); q = 0 where amax < 2^-118. -> (q int8 [M, K/32, 32], d float32 [M, K/32]).
    Unlike Q8_1, d is not rounded to half (and no float sum is kept: the kernels sum q exactly)."""
    x0 = np.asarray(a_f32)
    if F.is_bf16(x0.dtype):  # the *_bf16 kernels: each value exactly a float32
        x0 = F.bf16_to_f32(x0)
    if x0.ndim != 2 or x0.shape[1] % F.QK:
        raise ValueError(f"reference: activations must be 2-D [M, K] with K a multiple of {F.QK}, got shape {x0.shape}")
    with np.errstate(over="ignore", invalid="ignore"):  # judged below: what float32 cannot hold is refused
        x = x0.astype(np.float32)
    if not np.isfinite(x).all():  # a NaN / inf (or a float64 past float32) would reach the int8 cast as garbage
        raise ValueError("reference: activations must be finite in float32; found inf or NaN")
    m, k = x.shape
    xb = x.reshape(m, k // F.QK, F.QK)
    amax = np.abs(xb).max(axis=-1)
    ok = amax >= I8_TINY
    inv = np.where(ok, np.float32(127) / np.where(ok, amax, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)  # float32 product, then round half to even
    d = (amax * INV127_F32).astype(np.float32)
    return q, d


def exact_w4a8s(a_f32: np.ndarray, w_q4_0: np.ndarray) -> np.ndarray:
    """w4a8.skinny: quantize_rows_i8 activations x Q4_0, the -8 compensated in integers:
    per block d_w d_a (sumi - 8 sum q_a), sumi on the stored nibbles 0..15."""
    qa, da = quantize_rows_i8(a_f32)
    w = _blocks_2d(w_q4_0, F.Q4_0, "W", "exact_w4a8s")
    qw = np.concatenate([w["qs"] & 0x0F, w["qs"] >> 4], axis=-1)
    sumi = block_sumi(qa, qw) - 8 * qa.astype(np.int64).sum(axis=-1)[:, None, :]
    return np.sum(w["d"].astype(np.float64)[None] * da.astype(np.float64)[:, None] * sumi, axis=-1)


def exact_w8a8s(a_f32: np.ndarray, w_q8_0: np.ndarray) -> np.ndarray:
    """w8a8.skinny: quantize_rows_i8 activations x Q8_0: per block d_w d_a sumi."""
    qa, da = quantize_rows_i8(a_f32)
    w = _blocks_2d(w_q8_0, F.Q8_0, "W", "exact_w8a8s")
    sumi = block_sumi(qa, w["qs"])
    return np.sum(w["d"].astype(np.float64)[None] * da.astype(np.float64)[:, None] * sumi, axis=-1)


def exact_w4a8_uncompensated(a_q8_1: np.ndarray, w_q4_0: np.ndarray) -> np.ndarray:
    """What you get if you forget the -8: d_w * d_a * sumi on the stored nibbles (wrong on purpose,
    for the tutorial and the tests that show why the compensation exists)."""
    a = _blocks_2d(a_q8_1, F.Q8_1, "A", "exact_w4a8_uncompensated")
    w = _blocks_2d(w_q4_0, F.Q4_0, "W", "exact_w4a8_uncompensated")
    qw = np.concatenate([w["qs"] & 0x0F, w["qs"] >> 4], axis=-1)
    sumi = block_sumi(a["qs"], qw).astype(np.float64)
    return np.sum(w["d"].astype(np.float64)[None] * a["d"].astype(np.float64)[:, None] * sumi, axis=-1)


EXACT = {
    "fp32": exact_fp32,
    "w4a16": exact_w4a16,
    "w8a16": exact_w8a16,
    "w4a8": exact_w4a8,
    "w8a8": exact_w8a8,
    "w4a16h": exact_w4a16h,
    "w8a16h": exact_w8a16h,
    "w4a16s": exact_w4a16s,
    "w8a16s": exact_w8a16s,
    "w4a8s": exact_w4a8s,
    "w8a8s": exact_w8a8s,
}


def relative_error(x: np.ndarray, ref: np.ndarray) -> float:
    """||x - ref|| / ||ref|| (Frobenius, float64). ValueError for operands of different shapes
    (broadcasting would compare other elements than the caller meant) or not numeric."""
    try:
        x = np.asarray(x, dtype=np.float64)
        ref = np.asarray(ref, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"relative_error: x and ref must be numeric arrays ({e})") from None
    if x.shape != ref.shape:
        raise ValueError(f"relative_error: x and ref must have the same shape, got {x.shape} and {ref.shape}")
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(x - ref))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))
