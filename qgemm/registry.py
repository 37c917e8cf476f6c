"""The kernel registry: one entry per kernel, `family.variant` -> source, entry symbol, op,
launch geometry, minimum arch. Adding a kernel is one .cu file under cuda_src/<family>/ and one
KernelSpec in _SPECS here, and for a new family directory its line in pyproject.toml's packages
(README.md, "Adding a kernel": the entry's signature, the fields).
"""

from __future__ import annotations

import difflib
import re
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

from . import jit, ops
from .errors import RegistryError, UnknownNameError
from .ops import Launch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KernelSpec:
    """One registered kernel (`qgemm.spec(name)`): its name "family.variant", the Op it computes,
    the tutorial step that introduces it (1-5: a rung of that step's ladder in `qgemm tutorial`;
    6 production kernels, 7 Mustafar: "prod" in `qgemm list`), its .cu source under
    cuda_src/<family>/ and extern "C" entry, launch geometry ((M, N, K) -> ops.Launch: grid,
    block, dynamic shared memory), minimum arch, #defines, and for tunable kernels the default
    configuration and the candidates `qgemm tune` tries. The other fields say how it is launched
    (decode kernels' max_m, weight / activation layouts, programmatic dependent launch, helper
    entries, a runner for kernels outside the GEMM convention). README.md's "Adding a kernel"
    says what a new one needs."""

    name: str  # "family.variant"
    op: ops.Op
    step: int  # tutorial step that introduces it (1-5); 6: production kernels, 7: Mustafar
    source: str  # path under cuda_src/
    entry: str  # extern "C" symbol
    geometry: Callable[[int, int, int], Launch]  # (M, N, K) -> grid, block, dynamic smem
    description: str
    min_arch: int = 75  # NVRTC 13 targets sm_75 and newer
    arch_suffix: str = ""  # "a" for arch-specific features (wgmma needs sm_90a)
    defines: dict = field(default_factory=dict)
    # Kernels with launch-time configurations (tile sizes, stages, split-K as #defines):
    # config(M, N, K, sm_count) -> defines (the untuned default); geometry then takes the defines
    # as a 4th argument; candidates(M, N, K) -> the configurations `qgemm tune` tries.
    config: Callable[[int, int, int, int], dict] | None = None
    candidates: Callable[[int, int, int], list] | None = None
    max_m: int | None = None  # decode kernels handle at most this many activation rows
    unit: str | None = None  # the arithmetic unit that bounds it, when not the op's (e.g. "imma")
    # Kernels outside the GEMM launch convention: an object with validate(kernel, shape, seed, opts)
    # -> check.Result and profile(kernel, shape, warmup, iters, cold, opts) -> bench.Profile (and
    # __call__(kernel, a, w, out=, stream=)); check.validate / bench.profile delegate to it.
    runner: object = None
    # The kernel reads its weights in a layout of its own (qgemm.packing), made once from the ggml
    # blocks: Kernel.upload_weights packs, qgemm.pack_weights makes a PackedWeights for matmul.
    weight_layout: str | None = None
    # Programmatic dependent launch (cuda_src/common/pdl.cuh): above its pdl_wait() the kernel
    # reads only its weights, so it is launched with the attribute (sm_90+) and may start while the
    # kernel before it in the stream finishes -- its prologue, or the previous op of a chain.
    pdl: bool = False
    # A prologue kernel that also zeroes the split-K GEMM's output (two more arguments: float*
    # and its length), so no memset separates it from the previous op (qgemm.matmul).
    zeroes: bool = False
    # Other extern "C" entries of the same source that the launcher runs beside the kernel
    # (compiled and loaded with it: qgemm_zero_output in the skinny modules, mustafar_zero_output in the
    # Mustafar value modules).
    helpers: tuple = ()
    # The kernel reads its activations in a layout of its own (qgemm.packing.kperm16): the
    # Kernel object permutes what it is given; qgemm.matmul's prologue (convert.f16k) writes it.
    act_layout: str | None = None

    def configurations(self, m: int, n: int, k: int, sm_count: int, defaults_only: bool = False) -> list[dict]:
        """The untuned default (`config`) and, unless defaults_only, every candidate `qgemm tune`
        may try at this shape, each once, in that order; [{}] for a kernel without configurations."""
        out: list[dict] = []
        for d in ([self.config(m, n, k, sm_count)] if self.config else [{}]) + (
                self.candidates(m, n, k) if self.candidates and not defaults_only else []):
            if d not in out:
                out.append(d)
        return out

    @property
    def family(self) -> str:
        """The name's part before the dot: "w4a16" of "w4a16.tiled"."""
        return self.name.split(".", 1)[0]

    def runs_on(self, cc: int) -> bool:
        """Whether a GPU of compute capability `cc` (90 for sm_90) can run it: sm_XXa features
        (wgmma) exist on that architecture only, not on later ones."""
        return cc >= self.min_arch and not (self.arch_suffix and cc != self.min_arch)

    @property
    def arch_needed(self) -> str:
        """The GPUs it runs on, for error messages: "sm_80 or newer", or "sm_90a (only)"."""
        return f"sm_{self.min_arch}{self.arch_suffix} (only)" if self.arch_suffix else f"sm_{self.min_arch} or newer"

    @property
    def variant(self) -> str:
        """The name's part after the dot: "tiled" of "w4a16.tiled"."""
        return self.name.split(".", 1)[1]


def _thread_per_output(m: int, n: int, k: int) -> Launch:
    return Launch(grid=(cdiv(n, 16), cdiv(m, 16), 1), block=(16, 16, 1))


def _tile_64x64(m: int, n: int, k: int) -> Launch:
    return Launch(grid=(cdiv(n, 64), cdiv(m, 64), 1), block=(16, 16, 1))


def _tile_16x16(m: int, n: int, k: int) -> Launch:
    return Launch(grid=(cdiv(n, 16), cdiv(m, 16), 1), block=(16, 16, 1))


def _warp_dot(m: int, n: int, k: int) -> Launch:
    # common/warp_dot.cuh: 4 warps per CTA side by side along N, each on a 4x4 block of C
    return Launch(grid=(cdiv(n, 16), cdiv(m, 4), 1), block=(128, 1, 1))


# ---- int8 tensor-core GEMM (common/mma_gemm.cuh) -------------------------------------------
_MMA_W_ROW = {"q4_0": 80, "q8_0": 144}  # padded shared-memory row of a stage of weight blocks


def _mma_geometry(wfmt: str, a_row: int = 144):
    """a_row: padded shared-memory bytes per activation row per stage (Q8_1: 144, fp16: 272)."""
    def geometry(m: int, n: int, k: int, d: dict) -> Launch:
        bm, bn = d["MMA_BM"], d["MMA_BN"]
        threads = 32 * d["MMA_WARPS_M"] * d["MMA_WARPS_N"]
        smem = d["MMA_STAGES"] * (bm * a_row + bn * _MMA_W_ROW[wfmt])
        split = d["MMA_SPLITK"]
        return Launch(grid=(cdiv(n, bn), cdiv(m, bm), split), block=(threads, 1, 1), shmem=smem, split=split)
    return geometry


def _split_k(ctas: int, k: int, sm_count: int) -> int:
    """Default K split across CTAs: while the tile grid leaves SMs idle, keeping >= 4 stages of
    128 K (4 blocks of 32) per split, at most 8 (atomics into a zeroed C)."""
    return max(1, min(sm_count // max(ctas, 1), cdiv(k // 32, 4) // 4, 8))


def _tune_splits(ctas: int, k: int) -> list[int]:
    """The K splits `qgemm tune` tries for a grid of `ctas` tiles: 1, 2, 3, 4, 8 and the split that
    fills a 132-SM GPU at one and at two CTAs per SM (`_split_k`), which is 5, 6 or 7 for some
    grids (300x1000x4096's 24 tiles: 5) -- the default's own split at such a shape would
    otherwise be missing from every other tile's candidates. 3 for grids a wave short of the SMs
    at a long K (session 53: 1100x1024x14336's 72 tiles split 3 fill two waves)."""
    return sorted({1, 2, 3, 4, 8, _split_k(ctas, k, 132), _split_k(ctas, k, 2 * 132)})


def _split_k_ok(ctas: int, k: int, split: int) -> bool:
    """A K split worth tuning: at most 6 CTAs per SM of a 132-SM GPU (a grid of up to 198 tiles
    split 4), >= 2 stages per split."""
    return split == 1 or (ctas * split <= 6 * 132 and cdiv(k // 32, 4) >= 2 * split)


def _mma_config(m: int, n: int, k: int, sm_count: int) -> dict:
    """Default tile: 128x128 for prefill, smaller M tiles for few tokens; split K when the grid
    would leave SMs idle (each split keeps >= 4 stages of 128 K)."""
    bm = 128 if m > 64 else (64 if m > 32 else 32)
    split = _split_k(cdiv(m, bm) * cdiv(n, 128), k, sm_count)
    return {"MMA_BM": bm, "MMA_BN": 128, "MMA_WARPS_M": 2, "MMA_WARPS_N": 4, "MMA_STAGES": 4, "MMA_SPLITK": split, "MMA_MINB": 1}


def _mma_candidates(m: int, n: int, k: int) -> list[dict]:
    out = []
    for bm, bn, wm, wn in ((128, 128, 2, 4), (128, 128, 4, 2), (64, 128, 2, 4), (128, 64, 4, 2), (64, 64, 2, 2), (32, 128, 2, 4)):
        ctas = cdiv(m, bm) * cdiv(n, bn)
        for stages in (3, 4):
            for split in _tune_splits(ctas, k):
                if split > 1 and ctas * split > 4 * 132:
                    continue
                if bm > 2 * max(m, 16) and bm > 32:
                    continue
                out.append({"MMA_BM": bm, "MMA_BN": bn, "MMA_WARPS_M": wm, "MMA_WARPS_N": wn, "MMA_STAGES": stages, "MMA_SPLITK": split,
                            "MMA_MINB": 1})
    # two CTAs per SM: registers capped by __launch_bounds__, two stages to fit the shared memory
    for bm, bn, wm, wn in ((128, 128, 2, 4), (64, 128, 2, 4), (128, 64, 4, 2)):
        out.append({"MMA_BM": bm, "MMA_BN": bn, "MMA_WARPS_M": wm, "MMA_WARPS_N": wn, "MMA_STAGES": 2, "MMA_SPLITK": 1, "MMA_MINB": 2})
    return out


# ---- fp16 tensor-core W4A16 / W8A16 (common/mma_f16.cuh) ------------------------------------
def _hf_geometry(wfmt: str):
    return _mma_geometry(wfmt, a_row=272)  # common/mma_f16.cuh: HF_A_ROW


def _hf_config(m: int, n: int, k: int, sm_count: int) -> dict:
    # 3 stages: four 128x128 fp16 stages (176 / 208 KiB for Q4_0 / Q8_0) exceed the 163 KiB a block
    # may use on sm_80, where this is the prefill path
    return {**_mma_config(m, n, k, sm_count), "MMA_STAGES": 3}


def _hf_candidates(m: int, n: int, k: int) -> list[dict]:
    return [d for d in _mma_candidates(m, n, k)
            if (d["MMA_BM"] * 272 + d["MMA_BN"] * 144) * d["MMA_STAGES"] * d["MMA_MINB"] <= 227 * 1024]


# ---- decode GEMV (common/gemv.cuh) ----------------------------------------------------------
def _gemv_geometry(m: int, n: int, k: int, d: dict) -> Launch:
    per_cta = d["GEMV_COLS"] * d["GEMV_WARPS"]
    return Launch(grid=(cdiv(n, per_cta), 1, 1), block=(32 * d["GEMV_WARPS"], 1, 1), pdl=bool(d.get("GEMV_PDL", 0)))


def _gemv_early(m: int) -> dict:
    """GEMV_EARLY (a chunk's first weight loads before its activations are staged) and GEMV_PDL
    (launched with programmatic dependent launch, waiting for the quantizer only before the
    staging), both up to 4 tokens. H100, whole op on ggml blocks (quantize.q8_1 + the GEMV,
    graph-batched), us, PDL + early / neither (session 30):
        1x4096x4096  Q4_0 6.45-6.67 / 8.14-8.21   Q8_0 7.42-7.43 / 9.30-9.32
        2x4096x4096  Q4_0 9.10-9.12 / 9.41-9.47   Q8_0 10.10-10.11 / 10.96-11.05
        1x4096x14336 Q4_0 17.7-18.0 / 20.9-21.0   Q8_0 32.7 / 38.7
        4x4096x4096  Q4_0 9.57-9.63 / 10.75-11.26 Q8_0 10.34-10.38 / 11.80-11.88 (16 warps)
        4x4096x14336 Q4_0 27.9-28.0 / 29.7        Q8_0 43.5 / 42.8-43.0
        8x4096x4096  Q4_0 22.1 / 15.2 (early alone 16.4), Q8_0 23.5 / 16.3
    At 8 tokens the early CTAs' staging buffers (37 KB) and waiting warps crowd the running GEMV
    (docs/perf/NOTES.md, session 30)."""
    on = 1 if m <= 4 else 0
    return {"GEMV_EARLY": on, "GEMV_PDL": on}


def _gemv_m(m: int) -> int:
    return next((v for v in (1, 2, 4, 8) if v >= m), 8)


def _gemv_config(m: int, n: int, k: int, sm_count: int) -> dict:
    # Two weight rows per warp, activations staged 128 blocks at a time (half as many CTA barriers
    # as 64; 512 at exactly two tokens, below). Session 29 (H100, `qgemm tune --dry-run`, then
    # tools/probe_defines.py, kernel alone, hot): 8 warps x 4 iterations in flight against the
    # earlier default (4 warps; 2 rows up to M = 2, then 4; 64-block chunks), us:
    #   Q8_0 1x4096x4096 7.3-7.5 -> 6.95, 2x 9.5 -> 8.5, 4x 14.6 -> 10.2, 8x 18.9 -> 15.2-15.3,
    #        8x4096x14336 92.4 -> 63.0-63.1, 1x4096x14336 37.6 -> 36.3, 7x4097x4128 26.1 -> 19.9
    #   Q4_0 1x4096x4096 6.0-6.2 -> 5.8, 2x 7.2 -> 6.9, 4x 11.3 -> 9.4, 8x 17.9 -> 14.5-14.6,
    #        8x4096x14336 62.9-66.7 -> 46.5, 1x4096x14336 17.8-17.9 -> 16.4-16.5
    # (4 rows per warp, meant to reuse each activation fragment, lost to the occupancy it costs.)
    # Session 30, whole op (quantize.q8_1 + GEMV, graph-batched; with _gemv_early's PDL and early
    # loads up to 2 tokens when measured; now up to 4), H100, us, Q4_0 / Q8_0:
    #   1 token: 8 iterations of loads in flight instead of 4 -- 1x4096x4096 6.45 -> 5.78 / 7.42 ->
    #     6.74, 1x4096x14336 17.8 -> 16.4 / 32.8 -> 30.3 (4 warps x 8: 5.65 / 6.90, 16.9 / 32.1-32.4).
    #     128-block chunks: with 512 the kernel alone is faster (Q4_0 1x4096x14336 14.9 -> 13.6) but
    #     the op slower (16.5 -> 18.8): behind PDL the first chunk's staging waits for the quantizer.
    #   2-4 tokens: 16 warps (each CTA's staging serves twice the rows) and 8 in flight --
    #     2x4096x4096 8.91 -> 7.45-7.62 / 10.06 -> 9.20, 2x4096x14336 (512-block chunks instead of
    #     128: 27.8 -> 25.7; measured at 1 and 2 tokens only, so 3-4 tokens keep 128) 25.9-26.2 ->
    #     18.9 / 35.3 -> 31.9; 4x4096x14336 30.8 -> 29.7 / 44.4 -> 43.1.
    #   5-8 tokens: 16 warps, 4 in flight -- 8x4096x4096 16.9-17.4 -> 15.4 / 18.0 -> 16.6,
    #     8x4096x14336 47.1 -> 43.5 / 60.2 -> 60.6 (8 in flight: 15.9 / 16.9, 44.9 / 64.3).
    #   Lost everywhere: 1 or 4 rows per warp with 16-32 warps, 32- and 64-block chunks at 4-8 tokens.
    warps, unroll = (8, 8) if m == 1 else ((16, 8) if m <= 4 else (16, 4))
    # Narrow weights (session 51, kernel alone, hot / weights cold): where 16 warps x 2 rows leave
    # at most half the SMs a CTA (N <= 2048 on a 132-SM GPU), 8 warps -- twice the CTAs:
    # Q4_0 2x1024x4096 6.14 -> 4.96 us, 4x 8.53 -> 7.14, 8x 12.49 -> 11.35 (cold 13.67 -> 12.83),
    # 4x2048x4096 8.56 -> 7.27; Q8_0 4x1024x4096 9.37 -> 7.55, 8x 13.49 -> 11.98. (At one token, 4
    # warps instead of 8: Q4_0 1x1024x4096 3.73 -> 3.38 but Q8_0 cold 5.91 -> 6.11: not taken.)
    while warps > 8 and cdiv(n, 2 * warps) <= sm_count // 2:
        warps //= 2
    return {"GEMV_M": _gemv_m(m), "GEMV_COLS": 2, "GEMV_WARPS": warps, "GEMV_UNROLL": unroll,
            "GEMV_CHUNK": 512 if m == 2 else 128} | _gemv_early(m)


def _gemv_candidates(m: int, n: int, k: int) -> list[dict]:
    return [{"GEMV_M": _gemv_m(m), "GEMV_COLS": c, "GEMV_WARPS": w, "GEMV_UNROLL": u, "GEMV_CHUNK": ch} | _gemv_early(m)
            for c in (1, 2, 4) for w in (4, 8, 16) for u in (4, 8) for ch in ((128, 512) if m <= 2 else (64, 128))]


# ---- skinny fp16 MMA for decode and small batches (common/skinny_f16.cuh) --------------------
SKINNY_MAX_M = 64  # what the kernels handle (path= / a single-kernel call); matmul picks them up to dispatch.SKINNY_MAX_M


def _skinny_xsmem(m: int, k: int, d: dict) -> int:
    """Dynamic shared memory of SK_XSMEM: a CTA's activations as fp16 B fragments, 64 B per
    token row per block, over the most blocks any CTA of the K split gets."""
    if not d.get("SK_XSMEM"):
        return 0
    groups = cdiv(k // 32, 4)
    return 4 * cdiv(groups, d.get("SK_GSPLIT", 1)) * 64 * min(m, 8)


def _skinny_geometry(m: int, n: int, k: int, d: dict) -> Launch:
    split = d.get("SK_GSPLIT", 1)  # K split across CTAs (gridDim.y): atomics into a zeroed C
    return Launch(grid=(cdiv(cdiv(n, 16), d["SK_R"]), split, 1), block=(32 * d["SK_WARPS"], 1, 1),
                  shmem=_skinny_xsmem(m, k, d), split=split)


def _skinny_ok(d: dict, wfmt: str, m: int, k: int) -> bool:
    pieces = 2 if wfmt == "q4_0" else 4
    red = d["SK_WARPS"] * d["SK_R"] * d["SK_MT"] * 512  # the split-K reduction buffer (static)
    return (red <= 48 * 1024 and red + _skinny_xsmem(m, k, d) <= 227 * 1024
            and (not d.get("SK_XSMEM") or d["SK_MT"] == 1)
            # registers: two pipelined sets of uint4 weights in flight, and the accumulators
            # (larger configurations spill under the 255-register cap: checked with `qgemm compile`)
            and d["SK_UNROLL"] * d["SK_R"] * (pieces + 1) <= 12 and d["SK_R"] * d["SK_MT"] <= 8
            and d["SK_UNROLL"] * d["SK_MT"] <= 8 and d["SK_WARPS"] * d["SK_MT"] * pieces <= 128
            and (d.get("SK_ACC", 1) == 1 or d["SK_R"] * d["SK_MT"] <= 4)  # a second accumulator set
            # 16 warps (512 threads) leave 128 registers per thread: half the weights in flight
            and (d["SK_WARPS"] < 16 or (d["SK_UNROLL"] * d["SK_R"] * (pieces + 1) <= 6 and d["SK_R"] * d["SK_MT"] <= 2)))


def _skinny_fill_split(n: int, k: int, r: int, split: int, sm_count: int, per_sm: int = 2, warps: int = 8,
                       reach: int | None = None) -> int:
    """The decode kernels' K split across CTAs (SK_GSPLIT) for narrow weights: where the grid of
    16-row tiles (r per CTA) times the split would occupy at most half the SMs -- N <= 1024 at one
    tile per CTA on a 132-SM GPU, as the k / v projections of grouped-query attention -- the split
    doubles (up to 8) toward `per_sm` CTAs per SM (2 at up to 8 tokens, 1 above, where a CTA holds
    two 8-token tiles), each part keeping >= 4 groups of 128 K and half a group per warp (the
    CTA's warps split its part of K: at a quarter, w4a16.skinny 4x1024x4096 with 16 warps and a
    split of 8 took 5.01 us against 2.93 at 4). Elsewhere the measured per-shape choice stands.
    Kernel alone, H100, session 51 (tools/probe_defines.py, hot / weights cold), the split before
    -> this rule's:
      w4a16.skinny 4x1024x4096 3.60 -> 2.93 us (split 4; 8: 5.01), 4x512x4096 3.42 -> 3.00 (8),
                   16x1024x4096 6.40 -> 3.63 (4; 2: 4.84), 16x2048x4096 6.59 -> 5.39 (2; 4: 6.36),
                   8x1024x14336 11.48 (2) -> 5.22 (8)
      w8a16.skinny 8x1024x4096 4.58 -> 3.55 (4), cold 5.12 -> 3.65; 16x2048x4096 6.43 -> 5.62 (2);
                   8x1024x14336 9.34 (2) -> 5.96 (8)
      w4a8.skinny  1x1024x14336 8.42 -> 4.06 (4) (below K = 8192 its narrow configuration is
                   another: `_skinny_i8_config`)
      w8a8.skinny  1x1024x4096 2.94 -> 2.37 (4), 1x1024x14336 8.73 -> 5.19, cold 9.54 -> 7.00
    At N = 2048 and up to 8 tokens (128 tiles) a split of 2 measured 9-18% faster for the fp16
    kernels but level or 4% slower for the int8 one at one token: not taken here (nor at N = 4096,
    whose defaults were measured shape by shape); the fp16 kernels take it in `_skinny_config`
    since session 57, by calling this with `reach` = the SM count (the most CTAs the grid may
    have for the split to grow; half the SMs by default)."""
    tiles, groups = cdiv(cdiv(n, 16), r), cdiv(k // 32, 4)
    if tiles * split > (sm_count // 2 if reach is None else reach):
        return split
    while (split < 8 and tiles * split * 2 <= per_sm * sm_count and groups >= 4 * split * 2
           and 2 * groups >= warps * split * 2):
        split *= 2
    return split


# CTAs of 4 warps of the Q8_0 decode kernel at 9-16 tokens that one SM holds: 166 registers a
# thread (`qgemm compile w8a16.skinny --shape 16x6144x4096 -D SK_WARPS=4`, sm_80 and sm_90) leave
# room for three in 64 K registers; with 8 warps, one.
_SKINNY_Q8_MT2_CTAS_PER_SM = 3
# The same for Q4_0's two-tile CTAs of 4 warps at 9-16 tokens (`qgemm compile w4a16.skinny --arch sm_90
# --shape 16x14336x4096 -D SK_WARPS=4`: 127 registers; the float16 variant 126): four per SM.
_SKINNY_Q4_MT2_CTAS_PER_SM = 4
# and of its two-tile CTAs of 8 warps (the same 127 registers): two per SM
_SKINNY_Q4_MT2_8W_CTAS_PER_SM = 2


def _skinny_q8_wide_split(tiles: int, k: int, sm_count: int) -> int:
    """The K split for CTAs of 4 warps of the Q8_0 decode kernel at 9-16 tokens, where its grid of
    8-warp CTAs (two 16-row tiles each, one per SM: 166 registers a thread) spills past one wave:
    a 2-way split where it fills the last wave of the 4-warp slots (three per SM) better, by a
    tenth of a wave or more, than no split. The caller takes 4 warps only where that grid puts
    more than two CTAs on an SM on average: with two or fewer an SM holds no more warps than one
    8-warp CTA (at 256 tiles, 4 warps unsplit measured 3-6% faster kernel alone but level to 5%
    slower whole op). Session 56, H100, kernel alone, hot / weights cold, 8 warps -> 4 warps
    (split 1 / 2); `tools/probe_defines.py`:
      16x4608x3584  (144 CTAs) 13.09 / 15.58 -> 13.56 / 9.36 us, cold 13.99 / 10.59 (split 2)
      16x6144x4096  (192)      15.55 / 17.14 -> 13.72 / 11.31, cold 15.16 / 14.09 (2)
      16x6144x14336 (192)      51.80 / 51.58 -> 46.42 / 37.08, cold 46.04 / 37.22 (2)
      16x8192x8192  (256)      33.52 / 33.52 -> 32.65 / 36.01, cold 32.70 / 36.40 (8 warps kept)
      16x8192x28672 (256)      111.3 / 111.4 -> 104.8 / 111.1, cold 104.5 / 113.3 (8 warps kept)
      16x10240x8192 (320)      47.18 / 47.01 -> 34.09 / 38.03, cold 34.06 / 38.53 (1)
      16x14336x4096 (448)      34.34 / 34.34 -> 33.87 / 30.71, cold 33.86 / 31.27 (2)
      16x18944x3584 (592)      39.77 / 39.89 -> 32.86 / 32.35, cold 32.56 / 33.55 (2)
      16x28672x8192 (896)      112.7 / 113.8 -> 99.77 / 93.60, cold 103.4 / 98.0 (2)
      12x6144x4096  (192)      14.13 / 16.39 -> 13.18 / 11.00, cold 14.82 / 13.74 (2)
    At one wave or less (16x4096x14336, 128 CTAs; 16x3584x18944, 112) 8 warps stay: 4 warps
    there are 43% slower (half the warps per SM), 4 warps split 2 level."""
    slots = _SKINNY_Q8_MT2_CTAS_PER_SM * sm_count

    def last_wave_fill(ctas: int) -> float:
        return ctas / (cdiv(ctas, slots) * slots)
    groups = cdiv(k // 32, 4)
    if groups >= 8 and last_wave_fill(2 * tiles) >= last_wave_fill(tiles) + 0.1:
        return 2
    return 1


class _OneWaveCta(NamedTuple):
    """A 4-warp CTA of the decode kernels for wide weights at 2-8 tokens below K = 8192
    (`_SKINNY_WIDE_ONE_WAVE`)."""
    r: int       # 16-row weight tiles per CTA (SK_R)
    unroll: int  # load groups in flight per warp (SK_UNROLL)
    acc: int     # accumulator sets (SK_ACC)
    minb: int    # SK_MINB: registers capped so that this many CTAs fit an SM (0: not capped)
    per_sm: int  # CTAs of 128 threads one SM of sm_90 holds (its registers: `qgemm compile`)


# The ladder of 4-warp CTAs that the decode kernels take on wide weights, lightest grid first:
# registers a thread on sm_90 (`qgemm compile w4a16.skinny --arch sm_90 --shape 8x14336x4096 -D
# SK_WARPS=4 [-D SK_UNROLL=2 [-D SK_MINB=6] | -D SK_R=2 | -D SK_R=4]`; the float16 / bfloat16
# variants alike) -- Q4_0 one tile with two load groups 96 (5 per SM), the same capped at 80 by
# SK_MINB = 6 (6 per SM; ptxas spills 28 bytes a thread, to the L1), one group 64 (8), two tiles
# 96 (5), four tiles 167 (3); Q8_0 one tile with two groups and two sets 128 (4), two tiles with
# one and one 128 (4). On 132 SMs one wave of each holds Q4_0 660 / 792 / 1056 / 1320 / 1584
# tiles and Q8_0 528 / 1056: each rung starts where the one before stops, at 75-83% of its own
# wave (Q8_0's two rungs leave 529-791 tiles to `_skinny_q8_lighter_in_waves`). On sm_80 the
# one-tile one-group Q4_0 CTA takes 66 registers, 7 per SM: the table is sm_90's, where it was
# measured.
_SKINNY_WIDE_ONE_WAVE = {
    "q4_0": (_OneWaveCta(1, 2, 1, 0, 5), _OneWaveCta(1, 2, 1, 6, 6), _OneWaveCta(1, 1, 1, 0, 8),
             _OneWaveCta(2, 1, 1, 0, 5), _OneWaveCta(4, 1, 1, 0, 3)),
    "q8_0": (_OneWaveCta(1, 2, 2, 0, 4), _OneWaveCta(2, 1, 1, 0, 4)),
}
_ONE_WAVE_LEAST_FILL = 0.75  # of the rung's wave, where it starts (below, the SMs hold too few warps)


def _skinny_one_wave_tiles(wfmt: str, tiles: int, sm_count: int) -> _OneWaveCta | None:
    """The 4-warp CTA for a decode kernel at 2-8 tokens on weights wider than session 57's windows
    (`_skinny_config`: more than 4 tiles per SM for Q4_0, 3 for Q8_0): the first rung of
    `_SKINNY_WIDE_ONE_WAVE` whose whole grid runs in one wave of its CTA slots, filling it to at least
    75%; else None (the default stays, or `_skinny_config`'s many-wave choice). The default's CTAs
    (Q4_0 16 warps, Q8_0 8 warps with two groups and two sets) fit two per SM, so where this fires
    their grid takes 2-6 waves and ends in a partial one; a lighter CTA whose whole grid runs at once
    has no tail. Below the fill too few warps keep the loads in flight, past one wave a second starts.
    H100, `tools/probe_defines.py`, kernel alone, float32 x, hot / weights cold, default -> this
    choice, us (K = 4096 unless named):
    session 58 (the rungs of one group and of two and four tiles, at 80-100% of their wave):
      Q4_0 one tile     2x14336 15.72 / 15.56 -> 13.48 / 13.65, 8x 17.02 / 19.54 -> 15.29 / 16.37;
                        8x16384 19.91 / 20.43 -> 17.12 / 17.57; 4x13824x5120 20.19 / 20.44 ->
                        18.32 / 18.41
      Q4_0 two tiles    2x18944 19.63 / 19.80 -> 17.05 / 17.27, 8x 24.26 / 24.40 -> 19.40 / 19.40;
                        8x20480 25.25 / 25.29 -> 20.61 / 20.22; 4x18944x3584 19.31 / 18.93 ->
                        16.03 / 16.02; 2x17408 18.71 / 18.67 -> 17.02 / 16.85
      Q4_0 four tiles   2x22016 22.55 / 23.07 -> 19.10 / 19.51, 8x 27.37 / 27.92 -> 19.90 / 20.32
      Q8_0 two tiles    2x14336 23.23 / 23.47 -> 20.88 / 21.20, 4x 23.92 / 23.69 -> 21.46 / 21.08,
                        8x 29.20 / 28.97 -> 21.65 / 21.70; 4x16384 26.16 / 25.88 -> 23.62 / 23.51
    session 59 (the rungs below those, and one group's rung from 75%):
      Q4_0 one tile, two groups (544-640 tiles: 82-97%)  2x8704 10.88 / 11.25 -> 8.85 / 9.61,
                        8x 11.48 / 14.20 -> 9.72 / 11.21; 2x9728 11.00 / 11.94 -> 8.80 / 9.96;
                        8x10240 13.06 / 14.84 -> 9.91 / 12.13
      the same capped (672-768: 85-97%)  2x11008 12.17 / 12.97 -> 12.24 / 12.38, 8x 13.54 /
                        15.42 -> 13.54 / 14.13; 8x12288 14.53 / 15.95 -> 14.11 / 15.07
      Q4_0 one tile, one group at 76% and 79%  2x12800 14.08 / 14.12 -> 13.22 / 13.36; 8x13312
                        17.76 / 18.37 -> 14.47 / 14.78
      Q8_0 one tile, 2-4 tokens (432-528 tiles: 82-100%)  2x6912 11.54 / 14.28 -> 9.80 / 12.37,
                        4x7680 12.74 / 15.44 -> 10.67 / 13.38, 2x8448 12.26 / 16.05 -> 11.31 / 14.26;
                        at 6-8 tokens whole op 0.86-0.93 (6x7680, 8x8192 cold; docs/production.md)
    Outside its window each lost or tied: one tile of two groups at 102-121% of its wave (2x / 8x
    10752-13312: 1.06-1.28), the capped one at 101-105% (1.32-1.44); one group at 73% in session 58
    (2x / 8x12288: 0.96-1.11) and at 103% (8x17408: 1.26); two tiles at 104% (8x22016: 1.16-1.17);
    four at 113% (8x28672: 0.99-1.00); Q8_0's two tiles at 65% at two tokens (2x11008: 0.99; at eight
    0.82, where `_skinny_q8_lighter_in_waves` takes 0.84-0.85) and past one wave (2x / 4x17408: 1.27);
    Q8_0 one tile of one group (71 registers, 7 per SM) at 768-832 tiles: 1.11-1.17."""
    for cta in _SKINNY_WIDE_ONE_WAVE[wfmt]:
        slots = cta.per_sm * sm_count
        if cdiv(tiles, cta.r) <= slots:
            return cta if cdiv(tiles, cta.r) >= _ONE_WAVE_LEAST_FILL * slots else None
    return None


def _skinny_q8_lighter_in_waves(m: int, tiles: int, k: int, sm_count: int) -> bool:
    """Whether the float32 Q8_0 decode kernel at 5-8 tokens below K = 8192, on wide weights outside
    `_skinny_one_wave_tiles`' window, takes the lighter CTA of one load group and one accumulator set (79
    registers, three CTAs per SM) instead of two and two (128, two per SM): where the grid has more
    than four 16-row tiles per SM, the lighter grid takes at least one wave fewer. Session 58, H100:
      kernel alone (`tools/probe_defines.py`), hot / weights cold, default -> this, us:
        6x11008x4096 22.23 / 22.06 -> 19.81 / 19.48, 8x 22.95 / 22.44 -> 19.32 / 18.98,
        5x18944x4096 33.65 / 32.73 -> 29.97 / 29.15, 8x 36.60 / 36.48 -> 30.88 / 30.82,
        6x22016x4096 39.42 / 39.57 -> 34.79 / 35.32, 8x28672x4096 51.28 / 51.25 -> 45.68 / 46.11
      whole op (`tools/gpu_check.sh` ab), 0.82-0.96 of before: 6x11008x4096 22.13 -> 20.03,
        8x18944x3584 33.51 -> 28.11, 7x28672x4096 50.66 -> 45.72, cold 8x11008x5120 30.07 -> 24.53,
        6x8704x4096 15.60 -> 14.95; level at 5x9216x4096 (576 tiles), 14.62 -> 14.88
    Not at 2-4 tokens (0.97-1.07 of the default), nor at four tiles per SM or fewer (5x / 8x8192x4096,
    512 tiles, whose default grid fills two waves: whole op 1.06-1.08x slower), nor for the float16 /
    bfloat16 variants, whose two groups measured faster there (whole op 1.02-1.19x slower with one;
    `_x16_config` keeps them)."""
    return 5 <= m <= 8 and k < 8192 and tiles > 4 * sm_count


def _wave_cost(ctas: int, split: int, warps: int, per_sm: int, sm_count: int) -> float:
    """Session 60's cost of a decode grid at 9-16 tokens: the waves its `ctas` CTAs split `split`
    ways take in slots of `per_sm` per SM, over split x warps (a warp's serial share of K). These
    kernels are latency-bound there, so an SM's warps run at about the same rate whatever the fill;
    the rules below compare grids by it (`_skinny_q4_mt2_long_cta`, `_skinny_q4_mt2_short_split`,
    `_skinny_q8_mt2_split`)."""
    return cdiv(ctas * split, per_sm * sm_count) / (split * warps)


def _skinny_q4_mt2_long_cta(ctas: int, k: int, sm_count: int) -> tuple[int, int]:
    """(SK_WARPS, SK_GSPLIT) of the Q4_0 decode kernel's two-tile CTAs at 9-16 tokens of a long K
    (`ctas` of them unsplit), by `_wave_cost`. 4 warps (`_SKINNY_Q4_MT2_CTAS_PER_SM` per SM) with the
    split of 1-4 of least cost, ties to the smaller split, none that makes more than two waves (each
    part costs its own activations' latency, the zeroing and the atomics: past two waves the finer
    grain has not paid); unless 8 warps unsplit (`_SKINNY_Q4_MT2_8W_CTAS_PER_SM` per SM) cost less,
    as where the 4-warp grid spills a little past one wave and the 8-warp one fills three (529-792
    CTAs on 132 SMs), or the 4-warp grid takes more than two waves (measured level at 3.4: the cost
    alternates from there with every 264 CTAs by less than its own error). `_skinny_config` asks
    from 133 CTAs on 132 SMs (N > 4224), where the 8-warp grid split 2 passes one wave; below, that
    grid fills one wave as 4 warps split 4 would, at the same cost (which measured 0.95-0.99 of it:
    below), so it stays. On 132 SMs: 4 warps split 3 up to 176 CTAs (N <= 5632), 2 up to 264 (8448),
    3 up to 352 (11264), unsplit up to 528 (16896) and at 793-1056 (25376-33792); 8 warps unsplit at
    529-792 and from 1057.
    Session 60, H100, `tools/probe_defines.py`, kernel alone, float32 x, hot / weights cold, the
    default before (8 warps split 2; from 528 CTAs unsplit) -> this choice, us:
      16x5120x14336 (160 CTAs, split 3)  31.10 / 31.65 -> 22.34 / 22.88; 12x 29.48 / 28.41 ->
                                          21.33 / 21.60; 9x 27.78 / 27.77 -> 20.52 / 20.53
      16x5120x8192 (160, 3)               18.24 / 19.69 -> 13.17 / 14.51
      16x10240x8192 (320, 3)              31.35 / 31.77 -> 26.92 / 27.54; 10x 20.29 / 29.07 ->
                                          21.60 / 25.08
      16x11008x8192 (344, 3)              31.03 / 30.99 -> 26.68 / 28.13
      16x9216x8192 (288, 3)               29.70 / 30.62 -> 25.04 / 25.68
      16x7168x8192 (224, 2)               23.63 / 24.06 -> 17.30 / 18.32
      16x6144x8192 (192, 2)               19.01 / 20.38 -> 17.09 / 18.09; 16x6144x14336 33.05 /
                                          32.83 -> 29.53 / 29.06
      16x8192x8192 (256, 2)               22.63 / 23.43 -> 20.03 / 20.67 (8 warps unsplit 18.48
                                          / 18.63: the one shape where the cost's tie went wrong)
      16x8192x28672 (256, 2)              64.35 / 65.19 -> 59.68 / 60.65
      16x14336x8192 (448, 1)              39.19 / 40.69 -> 30.96 / 31.70
      16x16384x8192 (512, 1)              40.87 / 41.96 -> 31.83 / 31.56
      16x12288x8192 (384, 1)              32.23 / 32.65 -> 30.48 / 30.54
      16x28672x8192 (896, 1)              66.38 / 67.15 -> 60.21 / 61.18 (split 4, 7 waves: 67.08
                                          / 68.33)
      16x32768x8192 (1024, 1)             68.00 / 69.40 -> 61.11 / 63.40
    Kept: at up to 132 CTAs 8 warps split 2 (4 warps split 4: 16x4096x14336 (128) 19.14 / 20.03
    against 19.39 / 20.29, 16x3584x18944 (112) 21.82 / 22.08 against 23.01 / 23.43, 16x3072x8192
    (96) 10.20 / 10.99 against 10.28 / 11.09); 8 warps unsplit where they cost less (4 warps
    unsplit: 16x20480x8192 (640) 52.84 / 53.58 against 49.54 / 49.85, 16x24576x8192 (768) 55.83 /
    57.21 against 51.88 / 51.97, 16x20480x14336 91.49 / 96.25 against 84.48 / 86.59;
    16x57344x8192 (1792) 119.97 / 123.55 against 121.02 / 122.08, level).
    The other choices of the same calls, against the default before (nine shapes, hot and cold)
    -- 8 warps split 3 (0.82-1.25) or 4 (0.91-1.11), two accumulator sets (4 warps split 4:
    0.93-1.64), four tiles per CTA (4 warps split 4: 0.96-1.08) -- were behind this choice wherever
    it applies."""
    slots = _SKINNY_Q4_MT2_CTAS_PER_SM * sm_count
    best_cost, best = float("inf"), 1
    for split in range(1, 5):
        waves = cdiv(ctas * split, slots)
        if split > 1 and (waves > 2 or cdiv(k // 32, 4) < 4 * split):
            break
        cost = _wave_cost(ctas, split, 4, _SKINNY_Q4_MT2_CTAS_PER_SM, sm_count)
        if cost < best_cost:
            best_cost, best = cost, split
    if cdiv(ctas, slots) > 2 or _wave_cost(ctas, 1, 8, _SKINNY_Q4_MT2_8W_CTAS_PER_SM, sm_count) < best_cost:
        return 8, 1
    return 4, best


# The shortest K at which Q8_0's 9-16-token two-tile CTAs take `_skinny_q8_mt2_split`'s 4-warp split:
# each part's warps then walk 16 blocks (session 61: split 3 at 16x4096x6144 0.87 / 1.01 of before,
# hot / weights cold; at 16x4096x5120 1.03 / 1.09 and 16x4096x4096 1.05 / 1.11 -- slower).
_SKINNY_Q8_MT2_SPLIT_MIN_K = 6144


def _skinny_q8_mt2_split(ctas: int, sm_count: int) -> int:
    """SK_GSPLIT of 4-warp CTAs (`_SKINNY_Q8_MT2_CTAS_PER_SM` per SM) for Q8_0's decode kernel at
    9-16 tokens, in place of its two-tile CTAs of 8 warps unsplit (`ctas` of them, one per SM, 166
    registers), or 0 to keep those: the split of 1-4 whose grid takes at most two waves and costs
    strictly less by `_wave_cost` -- ties to the smaller split. The
    8-warp grid stays unsplit where `_skinny_config` gives it (up to 132 CTAs on 132 SMs: N <= 4224,
    past the narrow weights' fill splits; and 199-264 CTAs, where `_skinny_q8_wide_split` fills no
    better with a split), so only those are asked. On 132 SMs: split 4 at 67-99 CTAs (N 2144-3168),
    3 at 100-132 (3200-4224) and at 199-264 (6368-8448).
    Session 61, H100, `tools/probe_defines.py`, kernel alone, float32 x, hot / weights cold, 8 warps
    unsplit -> this choice, us:
      16x2560x8192 (80 CTAs, split 4)    15.38 / 16.50 -> 10.52 / 12.09 (split 3 13.20 / 14.64)
      16x3072x8192 (96, 4)               16.12 / 16.96 -> 11.73 / 14.28 (split 3 13.33 / 14.93)
      16x3584x18944 (112, 3)             38.71 / 38.73 -> 30.76 / 31.10; 12x 34.62 / 34.68 -> 29.85
                                         / 29.76 (split 4, two waves: 40.78 / 41.24)
      16x3584x6144 (112, 3)              13.00 / 14.05 -> 10.84 / 12.23
      16x4096x14336 (128, 3)             29.58 / 29.41 -> 26.95 / 26.81; 12x 27.59 / 27.44 -> 26.39
                                         / 26.43; 9x 26.97 / 26.50 -> 26.54 / 26.32
      16x4096x8192 (128, 3)              16.94 / 17.40 -> 16.35 / 17.35
      16x4096x6144 (128, 3)              13.16 / 14.37 -> 11.50 / 14.48
      16x7168x8192 (224, 3)              31.44 / 31.52 -> 28.73 / 28.96
      16x8192x8192 (256, 3)              33.65 / 34.14 -> 30.44 / 31.47 (call 3); 12x 31.80 / 31.48
                                         -> 30.42 / 30.37; 9x 30.77 / 30.80 -> 30.03 / 30.43
      16x8192x6144 (256, 3)              27.85 / 27.91 -> 25.23 / 25.59
      16x8192x28672 (256, 3)             111.11 / 111.84 -> 92.55 / 96.36
    and float16 x (`w8a16.skinny_f16`, whose default is float32's there): 16x3584x18944 0.84 / 0.85,
    16x7168x8192 0.93 / 0.95, 16x8192x8192 0.95 / 0.98, 16x4096x14336 0.99 / 1.01. The cost's ties
    measured as ties or losses: 4 warps split 2 at 112-256 CTAs 1.00-1.15, split 4 at 224-256 (three
    waves) 1.00-1.04, 16x2048x14336 (64 CTAs, already split 2 on 8 warps) split 4 1.04 / 1.05."""
    slots = _SKINNY_Q8_MT2_CTAS_PER_SM * sm_count
    best_cost, best = _wave_cost(ctas, 1, 8, 1, sm_count), 0  # 8 warps unsplit, one per SM
    for split in range(1, 5):
        if cdiv(ctas * split, slots) > 2:
            break
        cost = _wave_cost(ctas, split, 4, _SKINNY_Q8_MT2_CTAS_PER_SM, sm_count)
        if cost < best_cost:
            best_cost, best = cost, split
    return best


# The shortest K at which Q4_0's 9-16-token two-tile CTAs take `_skinny_q4_mt2_short_split`'s split 3:
# each of a part's 4 warps then still walks 8 of its 32-wide blocks (session 61: at K = 2048, 5 and
# a third, split 3 measured 1.03-1.07x slower; at K = 3072 the 8-warp grid was 1.04-1.18x slower
# than it, kernel alone, and split 3 gained at every K measured above).
_SKINNY_Q4_MT2_SHORT_SPLIT_MIN_K = 3072


def _skinny_q4_mt2_short_split(ctas: int, k: int, sm_count: int) -> bool:
    """Whether Q4_0's decode kernel at 9-16 tokens below K = 8192, on two-tile CTAs of 8 warps
    unsplit (`ctas` of them, two per SM), takes 4 warps split 3 instead: where that grid costs
    strictly less by `_wave_cost`, in at most two
    waves. At a short K a split's parts are short, and each pays the zeroing, the atomics and its
    activations' latency, so it is taken only on a strict gain, never on the tie that a long K
    takes (4 warps split 2 against 8 warps unsplit at 177-264 CTAs: session 60, kernel alone,
    1.05-1.40x slower at 16x6144x4096, 12x6144x4096 and 16x8192x4096). On 132 SMs: 133-176 CTAs
    (one wave of 8 warps against one of 4 warps split 3: 1/8 against 1/12; N 4256-5632) and 265-352
    (two against two: 1/4 against 1/6; N 8480-11264, where `_skinny_config` has already given
    4 warps unsplit to 344 CTAs and more, session 59's rule, which split 3 did not beat).
    `_skinny_config` asks only past 132 CTAs; within the SMs, where the 8-warp grid runs two
    accumulator sets, `_skinny_q4_mt2_split4_within_sms` decides.
    Session 61, H100, `tools/probe_defines.py`, kernel alone, float32 x, hot / weights cold,
    8 warps unsplit -> 4 warps split 3, us:
      16x4608x3584 (144 CTAs)  8.95 / 9.43 -> 7.73 / 8.45;  12x 8.33 / 8.41 -> 7.62 / 8.17;
                               9x 7.82 / 8.13 -> 7.60 / 8.09
      16x4352x4096 (136)       9.47 / 9.90 -> 8.02 / 8.86
      16x5120x4096 (160)       9.70 / 10.14 -> 8.25 / 8.75;  12x 9.09 / 9.24 -> 8.01 / 8.81
      16x5120x5120 (160)       12.30 / 12.94 -> 9.90 / 10.92
      16x4608x6144 (144)       14.44 / 14.87 -> 10.31 / 11.50
      16x5632x4096 (176)       9.57 / 10.30 -> 9.47 / 10.27 (level)
      16x9216x4096 (288)       15.96 / 17.46 -> 13.92 / 15.20;  12x 13.93 / 15.73 -> 13.33 / 14.83
      16x9216x3584 (288)       15.21 / 16.72 -> 13.35 / 14.69
      16x10240x4096 (320)      16.90 / 18.03 -> 14.61 / 15.96
      16x10240x5120 (320)      21.47 / 22.45 -> 17.70 / 19.21
    and float16 x (`w4a16.skinny_f16`, whose default is float32's there): 0.85-0.96 of before at
    16x4608x3584, 12x5120x4096, 16x5120x5120, 16x9216x4096 and 16x10240x4096. Not taken: split 2
    (0.95-1.13) and 4 (0.95-1.21) at 133-176 CTAs; 4 warps unsplit at 265-342 (0.89-1.05, behind
    split 3 but at 12x9216x4096); split 3 at 344 CTAs, on session 59's 4 warps (16x11008x4096 1.01
    / 1.09, 12x 0.97 / 1.03); split 3 at K = 2048 (16x5120x2048 1.07 / 1.03)."""
    return (k >= _SKINNY_Q4_MT2_SHORT_SPLIT_MIN_K and cdiv(3 * ctas, _SKINNY_Q4_MT2_CTAS_PER_SM * sm_count) <= 2
            and _wave_cost(ctas, 3, 4, _SKINNY_Q4_MT2_CTAS_PER_SM, sm_count)
            < _wave_cost(ctas, 1, 8, _SKINNY_Q4_MT2_8W_CTAS_PER_SM, sm_count))


# The share of its slots (four per SM) up to which the 4-warp grid split 4 of
# `_skinny_q4_mt2_split4_within_sms` is taken: 120 CTAs x 4 of 528 on 132 SMs (91%) gained, 128 x 4
# (97%) measured level.
_SKINNY_Q4_MT2_SPLIT4_FILL = 0.91


def _skinny_q4_mt2_split4_within_sms(ctas: int, k: int, sm_count: int) -> bool:
    """Whether Q4_0's decode kernel at 9-16 tokens below K = 8192, on two-tile CTAs of 8 warps
    unsplit with two accumulator sets (`ctas` of them, at most one per SM: 134 registers), takes 4
    warps split 4 instead (one set, four per SM): a quarter of a warp's serial work in the same one
    wave, `_wave_cost` 1/16 against 1/8 -- where that grid fills at most
    `_SKINNY_Q4_MT2_SPLIT4_FILL` of its slots, from K = 3072 (`_SKINNY_Q4_MT2_SHORT_SPLIT_MIN_K`).
    Near a full wave of four per SM the cost does not hold: at 128 CTAs (N = 4096, the bench's row)
    the 8-warp grid fills 97% of the SMs and measured level. Below 67 CTAs on 132 SMs the default
    splits already (`_skinny_fill_split`), so only 67-120 CTAs (N 2144-3840) are asked.
    Session 61, H100, `tools/probe_defines.py`, kernel alone, hot / weights cold, 8 warps unsplit
    with two sets -> 4 warps split 4, us:
      16x2560x4096 (80 CTAs)   7.38 / 8.06 -> 6.00 / 6.55
      16x3072x3072 (96)        6.71 / 7.12 -> 5.56 / 5.82; float16 x 6.76 / 6.95 -> 5.83 / 6.09
      16x3584x3584 (112)       7.86 / 8.42 -> 6.21 / 6.52; float16 x 7.74 / 8.27 -> 6.88 / 7.07
      16x3584x5120 (112)       10.21 / 10.83 -> 7.57 / 8.35
      16x3840x4096 (120)       7.50 / 8.28 -> 6.64 / 7.09 (call 11)
    and at 9 and 12 tokens (call 11): 9x3584x3584 7.07 / 7.91 -> 5.79 / 6.20, 12x 7.43 / 8.13 ->
    6.09 / 6.44, 12x3072x3072 6.10 / 6.69 -> 5.54 / 5.71, 9x2560x4096 7.03 / 7.49 -> 6.06 / 6.53;
    at the lower edge 16x2176x4096 (68) 7.41 / 7.79 -> 6.34 / 6.60. Whole op, old -> new, float32
    x / float16 x: 16x3584x3584 7.80 -> 6.48 / 7.75 -> 6.84, 16x3584x5120 10.40 -> 7.75 / 9.34 ->
    7.89, 9x3584x3584 cold 7.94 -> 6.18 / 6.79 -> 6.20 (all six shapes 0.75-0.91;
    docs/production.md).
    Not taken, at 128 CTAs: 16x4096x4096 7.48 / 8.35 -> 7.70 / 8.28 (12x 1.02 / 0.98, 9x 1.01 /
    0.95; float16 x 1.08 / 1.02), 16x4096x3072 1.07 / 1.02, though 16x4096x6144 11.94 / 12.70 ->
    9.95 / 10.59; split 3 (one set 0.85-1.08, two sets 0.78-1.01) and split 2 (1.09-1.41) behind
    split 4 at 80-112 CTAs."""
    slots = _SKINNY_Q4_MT2_CTAS_PER_SM * sm_count
    return (k >= _SKINNY_Q4_MT2_SHORT_SPLIT_MIN_K and ctas <= sm_count
            and 4 * ctas <= _SKINNY_Q4_MT2_SPLIT4_FILL * slots)


def _skinny_splits(n: int, k: int, r: int, warps: int) -> tuple:
    """The K splits `qgemm tune` tries for the decode kernels: 1, 2, 4, 3 from K = 3072
    (`_skinny_q4_mt2_long_cta`, `_skinny_q4_mt2_short_split`) and the fill splits of a 132-SM GPU
    (8 for the narrowest weights)."""
    return tuple(sorted({1, 2, 4} | ({3} if k >= _SKINNY_Q4_MT2_SHORT_SPLIT_MIN_K else set())
                        | {_skinny_fill_split(n, k, r, 1, 132, p, warps) for p in (1, 2)}))


def _skinny_config(wfmt: str):
    def config(m: int, n: int, k: int, sm_count: int) -> dict:
        # The untuned default follows `qgemm tune` on the H100 (docs/perf/NOTES.md): 8 warps per
        # CTA splitting K; one 16-row tile per CTA for M <= 8 at K = 4096 (the most CTAs), more
        # tiles for long K or more tokens (the B fragments are reused), with a second K split
        # across CTAs for several tokens at long K; activations staged in shared memory only for
        # M = 1 (at M = 8 the 64 KB of staging costs occupancy).
        mt = cdiv(min(m, SKINNY_MAX_M), 8)
        long_k = k >= 8192
        tiles = cdiv(n, 16)  # 16-row weight tiles
        # Q4_0 at 2-8 tokens of a long K: two 16-row tiles per CTA of 4 warps, K split 4 ways, two
        # accumulator sets, where the four tiles x 8 warps split 2 below fill more than half the SMs
        # and fewer than 4 CTAs per SM of two tiles would drop the split (N 2113-16864 on 132 SMs;
        # wider: split 2, below).
        # Session 52, H100, `tools/probe_defines.py` kernel alone, hot / weights cold: 2 / 4 / 8
        # x4096x14336 15.85 / 16.21 / 16.43 -> 13.28 / 13.54 / 13.66 us, cold 15.96 / 16.14 / 16.76
        # -> 13.29 / 13.83 / 14.15, 4x4096x8192 8.67 -> 7.62; whole op, `tools/compare_paths.py`,
        # float32 x: 13.13 / 13.45 / 14.09 -> 11.26 / 11.77 / 12.66, 4x4096x8192 8.63 -> 7.54. Not
        # on narrow weights, where the split below grows to 8 (8x1024x14336 5.24 against 6.89 for
        # this, 4x2048x14336 9.09 against 9.41), nor for Q8_0 (0-4% at N = 4096, 4% slower at
        # 4x2048x14336). From N = 16896, where the split of 4 would be dropped (four CTAs of two
        # tiles per SM and more), the same CTA split 2 (session 57, H100, kernel alone, hot / weights
        # cold, against 4 tiles x 8 warps split 2: 2x18944x8192 42.17 / 42.91 -> 35.01 / 36.00 us,
        # 4x18944x8192 42.86 / 44.16 -> 35.08 / 36.74, 8x28672x8192 60.73 / 63.23 -> 49.01 / 51.81;
        # split 4 there 0.81-0.84 too).
        q4_long_decode = (wfmt == "q4_0" and mt == 1 and m > 1 and long_k and cdiv(tiles, 4) * 2 > sm_count // 2)
        q4_wide_long_decode = q4_long_decode and cdiv(tiles, 2) >= 4 * sm_count
        if mt == 1 and not long_k:
            r, split, unroll = 1, 1, 1 if m == 1 else 2
        elif mt == 1 and m == 1:
            r, split, unroll = 2 if wfmt == "q4_0" else 1, 1, 2
        elif q4_long_decode:
            r, split, unroll = 2, 2 if q4_wide_long_decode else 4, 1
        elif mt == 1:
            r, split, unroll = 4 if wfmt == "q4_0" else 2, 2, 1
        elif mt <= 4:
            # Q8_0 at 9-16 tokens: no second K split (H100, session 49, kernel alone, zero kernel in
            # front of the split: 12x4096x14336 27.6 against 30.8 us, 16x 29.7 against 33.9,
            # 16x4096x8192 16.1 against 21.3; Q4_0 keeps it: 16x4096x14336 19.1 against 26.4)
            r, split, unroll = 2, 2 if long_k and not (wfmt == "q8_0" and mt == 2) else 1, 1
        else:
            r, split, unroll = 1, 1, 1
        warps = 8 if mt <= 4 and not q4_long_decode else 4
        if wfmt == "q4_0" and mt == 1 and not long_k and m > 1:
            # re-tuned in session 10 (after the LOP3 dequantization and the 32-bit split point): 16 warps
            # with one group in flight each, 8x4096x4096 4.7 us against 5.2 for 8 warps x 2 groups,
            # 4x4096x4096 4.4 against 4.8 (H100, kernel alone, docs/perf/NOTES.md)
            warps, unroll = 16, 1
        if cdiv(tiles, r) >= 4 * sm_count and not q4_wide_long_decode:  # plenty of CTAs already
            split = 1
        before_fill = split
        split = _skinny_fill_split(n, k, r, split, sm_count, 2 if mt == 1 else 1, warps)
        # Narrow weights, where a configuration with fewer warps (Q4_0) or more tiles per CTA reaches
        # a deeper fill split over as many CTAs, take it (session 56, H100, kernel alone, hot /
        # weights cold, `tools/probe_defines.py`; whole op in docs/perf/NOTES.md):
        #   Q4_0, 2-8 tokens, K < 8192: 8 warps of two load groups instead of 16 of one, whose
        #     half group per warp caps the split (2x512x4096 2.99 / 3.08 -> 2.59 / 2.66 us, split 4
        #     -> 8; 8x512x4096 3.06 / 3.20 -> 2.76 / 2.83; 2x1024x2048 3.04 / 3.14 -> 2.64 / 2.68,
        #     2 -> 4); where the split stays, 8 warps are level or slower (8x1024x4096 3.01 -> 3.35)
        #   Q8_0, 2-8 tokens, K < 8192: two 16-row tiles per CTA with one accumulator set, split
        #     twice as deep (1024x4096: 2 / 3 / 4 / 8 tokens 3.44 / 3.51 / 3.54 / 3.50 -> 3.03 /
        #     2.81 / 3.05 / 3.14, cold 3.40 / 3.61 / 3.55 / 3.74 -> 3.55 / 3.36 / 3.59 / 3.44;
        #     6x1024x6144 4.14 / 4.74 -> 3.65 / 4.35); where the split cannot deepen (N = 512 at
        #     split 8, 1024x2048) level or slower
        #   Q4_0, 9-16 tokens, K >= 8192, a grid of at most one CTA per SM: four 16-row tiles per
        #     CTA of 4 warps, split 4 (16x2048x14336 17.13 / 17.59 -> 16.09 / 16.96, split 2 -> 4;
        #     whole op 16x1536x14336 14.72 / 15.28 -> 13.40 / 14.86); where that split would reach
        #     8 (N <= 1024) the whole op measured 5-11% slower cold (12 / 16 x1024x14336), and above
        #     one CTA per SM (16x4096x14336, 256 CTAs) hot 3% faster but cold level and 3-4% slower
        #     at 10-12 tokens: not taken
        def same_ctas(r2: int, split2: int) -> bool:  # as many CTAs, up to a tile count's odd end
            return abs(cdiv(tiles, r2) * split2 - cdiv(tiles, r) * split) < split2
        narrow_acc1 = False
        if mt == 1 and m > 1 and not long_k and wfmt == "q4_0":
            s8 = _skinny_fill_split(n, k, r, before_fill, sm_count, 2, 8)
            if s8 > split:
                warps, unroll, split = 8, 2, s8
        elif mt == 1 and m > 1 and not long_k and wfmt == "q8_0" and r == 1:
            s2 = _skinny_fill_split(n, k, 2, before_fill, sm_count, 2, warps)
            if s2 > split and same_ctas(2, s2):
                r, unroll, split, narrow_acc1 = 2, 1, s2, True
        elif wfmt == "q4_0" and mt == 2 and long_k and r == 2 and cdiv(tiles, r) * split <= sm_count:
            s4 = _skinny_fill_split(n, k, 4, before_fill, sm_count, 1, 4)
            if s4 == 4 > split and same_ctas(4, s4):
                r, warps, split = 4, 4, s4
        elif wfmt == "q8_0" and mt == 2 and cdiv(tiles, r) > sm_count:
            # wide weights, the other way round: one 8-warp CTA per SM spills past a wave
            split4 = _skinny_q8_wide_split(cdiv(tiles, r), k, sm_count)
            if cdiv(tiles, r) * split4 > 2 * sm_count:
                warps, split = 4, split4
        if mt == 1 and m > 1 and r == 1 and split == 1:
            # one tile per CTA filling at most one CTA per SM (N 1072-2112 on 132 SMs), where the
            # fill split above stops: the same split reaching up to the SM count, i.e. split 2, two
            # CTAs per SM, each part of K keeping its four groups and half a group per warp --
            # `_skinny_fill_split`'s note
            # measured 9-18% for these kernels in session 51; session 57, H100, kernel alone, hot /
            # weights cold, Q8_0: 2x2048x3584 4.71 / 5.46 -> 4.09 / 4.81 us, 8x2048x3584 5.20 / 5.94
            # -> 4.42 / 5.06, 4x2048x4096 4.89 / 5.91 -> 4.00 / 5.06 (split 4: 1.04-1.23x slower;
            # past one CTA per SM, 4x2560x4096 and 8x3072x3584, split 2 1.17-1.23x slower)
            split = _skinny_fill_split(n, k, r, split, sm_count, 2, warps, reach=sm_count)
        # Wide weights at 2-8 tokens below K = 8192: one 16-row tile per CTA makes a grid past the
        # two CTAs per SM the default holds (Q8_0's two load groups x two accumulator sets: 128
        # registers; Q4_0's 16 warps: 64), so it runs a second, partial wave; where a lighter CTA
        # holds the whole grid in one wave, take it -- Q8_0 one group and one set (79 registers,
        # three CTAs per SM), Q4_0 8 warps (four per SM). Session 57, H100, `tools/probe_defines.py`
        # kernel alone, float32 x, hot / weights cold, us:
        #   Q8_0 4x4608x3584 9.83 / 11.52 -> 6.59 / 8.26, 2x6144x4096 13.23 / 13.57 -> 9.66 / 10.11,
        #        4x 13.39 / 13.81 -> 9.45 / 10.24, 8x 14.10 / 14.58 -> 9.94 / 10.97; past one wave of
        #        three: 4x11008x4096 0.98 of before, 2x14336x4096 1.05 (not taken)
        #   Q4_0 4x4608x3584 6.75 / 7.94 -> 5.98 / 6.83, 2x6144x4096 7.42 / 8.78 -> 6.98 / 7.53, 4x
        #        8.11 / 9.01 -> 6.65 / 7.71, 8x 9.00 / 10.06 -> 7.69 / 8.81; past one wave of four:
        #        4x11008x4096 1.00 hot, 1.10 cold (not taken)
        #   within two CTAs per SM (N = 4096: 256 tiles) the defaults stay: 8 warps 1.47-1.66x, Q8_0's
        #   one set 1.1-1.2x slower hot
        #   wider still (sessions 58-59): 4-warp CTAs whose whole grid runs in one wave, where one
        #   does (`_skinny_one_wave_tiles`); elsewhere Q8_0 at 5-8 tokens (`_skinny_q8_lighter_in_waves`)
        #   and Q4_0 past the ladder's last rung (1584 tiles on 132 SMs: N > 25344, as a vocabulary's
        #   output matrix) 8 warps again -- then every grid takes waves, and four 8-warp CTAs per SM
        #   beat two of 16 warps. Session 59, H100, kernel alone, hot / weights cold, 16 -> 8 warps,
        #   us: 2x25600x4096 25.22 / 25.23 -> 23.53 / 23.64, 4x28672x4096 27.87 / 28.25 -> 26.07 /
        #   26.47, 8x30720x4096 35.28 / 35.52 -> 32.50 / 32.57, 2x32768x4096 31.13 / 31.67 -> 28.24
        #   / 28.83 (0.90-0.98 at 1600-2048 tiles and 2, 4 and 8 tokens; 4 warps 0.90-1.08, 4 warps
        #   of two groups 0.89-1.05)
        wide_acc1 = False
        wide_cta = None
        if mt == 1 and m > 1 and not long_k and r == 1 and split == 1 and tiles > 2 * sm_count:
            past_window = tiles > (4 if wfmt == "q4_0" else 3) * sm_count
            wide_cta = _skinny_one_wave_tiles(wfmt, tiles, sm_count) if past_window else None
            if wide_cta is not None:
                r, warps, unroll = wide_cta.r, 4, wide_cta.unroll
            elif (wfmt == "q8_0" and unroll == 2
                  and (not past_window or _skinny_q8_lighter_in_waves(m, tiles, k, sm_count))):
                unroll, wide_acc1 = 1, True
            elif wfmt == "q4_0" and warps == 16:
                warps = 8
        # Q4_0 at 9-16 tokens below K = 8192, where the grid of two-tile 8-warp CTAs (127 registers,
        # two per SM) takes more than one wave: 4 warps (`_SKINNY_Q4_MT2_CTAS_PER_SM` per SM), so it
        # takes half the waves -- from where that grid fills 65% of a wave of four per SM (687 tiles on
        # 132 SMs). Session 59, H100, kernel alone, hot / weights cold, 8 -> 4 warps, us: 12x11008x4096
        # 16.09 / 17.22 -> 14.74 / 15.39, 16x14336x4096 18.62 / 19.36 -> 16.09 / 16.38, 16x28672x4096
        # 36.98 / 37.64 -> 31.20 / 31.92; whole op 0.85-0.96 (docs/production.md); level at 1184 tiles
        # (16x18944: 1.00-1.01, 1.12 waves of four); slower below: 12x9216x4096 (576 tiles, 55%) whole
        # op 1.07-1.08, 6144 and 8192 x4096 (192-256 CTAs) kernel alone 1.5-1.6. One tile per CTA of 4
        # warps lost everywhere (1.10-2.05x).
        q4_two_tile_8w = wfmt == "q4_0" and mt == 2 and not long_k and r == 2 and split == 1 and warps == 8
        if q4_two_tile_8w and cdiv(tiles, 2) >= 0.65 * _SKINNY_Q4_MT2_CTAS_PER_SM * sm_count:
            warps = 4
        # Where that grid stays and passes one wave of one CTA per SM, 4 warps split 3 where they
        # take fewer waves per unit of a warp's work (`_skinny_q4_mt2_short_split`: N 4256-5632 and
        # 8480-10976 on 132 SMs)
        elif (q4_two_tile_8w and cdiv(tiles, 2) > sm_count
                and _skinny_q4_mt2_short_split(cdiv(tiles, 2), k, sm_count)):
            warps, split = 4, 3
        # Within the SMs, where that grid runs two accumulator sets, 4 warps split 4 where they fill
        # at most 91% of their slots (`_skinny_q4_mt2_split4_within_sms`: N 2144-3840 on 132 SMs)
        elif q4_two_tile_8w and _skinny_q4_mt2_split4_within_sms(cdiv(tiles, 2), k, sm_count):
            warps, split = 4, 4
        # The same at a long K, where the two-tile 8-warp grid (split 2) takes more than one wave: 4
        # warps and the K split whose grid takes the fewest waves per unit of a warp's work, or 8
        # warps unsplit where those take fewer (`_skinny_q4_mt2_long_cta`).
        if (wfmt == "q4_0" and mt == 2 and long_k and r == 2 and warps == 8
                and cdiv(tiles, 2) > sm_count):
            warps, split = _skinny_q4_mt2_long_cta(cdiv(tiles, 2), k, sm_count)
        # Q8_0 at 9-16 tokens from K = 6144, where the two-tile 8-warp grid (one per SM) stays
        # unsplit: 4 warps (three per SM) split where that costs less (`_skinny_q8_mt2_split`)
        if (wfmt == "q8_0" and mt == 2 and r == 2 and warps == 8 and split == 1
                and k >= _SKINNY_Q8_MT2_SPLIT_MIN_K):
            split4 = _skinny_q8_mt2_split(cdiv(tiles, 2), sm_count)
            if split4:
                warps, split = 4, split4
        # two accumulator sets (two independent MMA chains) for Q4_0 at 9-16 tokens: 9.1 -> 7.9 us at
        # 16x4096x4096 on the H100; for Q4_0 no gain at M = 1 and a loss at M = 8, and a loss at long K
        # with the K split across CTAs (12x4096x14336: 21.6 -> 27.8) (docs/perf/NOTES.md, session 8);
        # Q8_0 at 2-8 tokens below K = 8192 gains (next line)
        # Q4_0's second set costs registers: 134 at 9-16 tokens, one CTA of 8 warps per SM (127 and
        # two with one set), so it is taken there only where the grid fits one wave of one CTA
        # per SM (16x4096x4096: 128 CTAs). Wider, one set (session 56, H100, kernel alone, hot /
        # weights cold): 16x6144x4096 13.84 / 15.37 -> 9.35 / 10.13 us, 16x14336x4096 28.25 /
        # 30.32 -> 18.77 / 19.66, 16x4608x3584 13.41 -> 8.75, 16x18944x3584 36.52 -> 25.76,
        # 12x6144x4096 13.52 -> 8.74.
        q4_two_sets = mt == 2 and not long_k and cdiv(tiles, r) * split <= sm_count
        acc = 2 if wfmt == "q4_0" and (q4_two_sets or q4_long_decode) else 1
        if wide_cta is not None:
            acc = wide_cta.acc  # the rung's own
        elif wfmt == "q8_0" and mt == 1 and m > 1 and not long_k and not (narrow_acc1 or wide_acc1):
            acc = 2  # Q8_0 8x4096x4096: 6.68 against 6.80 us (session 8), 6.3 against 6.4 (session 10)
        d = {"SK_R": r, "SK_MT": mt, "SK_WARPS": warps, "SK_UNROLL": unroll, "SK_GSPLIT": split, "SK_XSMEM": int(m == 1),
             "SK_ACC": acc}
        if wide_cta is not None and wide_cta.minb:
            d["SK_MINB"] = wide_cta.minb
        if not _skinny_ok(d, wfmt, m, k):  # activations of a long K do not fit in shared memory
            d["SK_XSMEM"] = 0
        while not _skinny_ok(d, wfmt, m, k) and d["SK_UNROLL"] > 1:
            d = {**d, "SK_UNROLL": d["SK_UNROLL"] // 2}
        if not _skinny_ok(d, wfmt, m, k):
            d = {**d, "SK_WARPS": 4}
        return d
    return config


def _skinny_candidates(wfmt: str):
    def candidates(m: int, n: int, k: int) -> list[dict]:
        mt = cdiv(min(m, SKINNY_MAX_M), 8)
        out = [{"SK_R": r, "SK_MT": mt, "SK_WARPS": w, "SK_UNROLL": u, "SK_GSPLIT": s, "SK_XSMEM": x, "SK_ACC": a}
               for r in (1, 2, 4) for w in (4, 8, 16) for u in (1, 2, 4) for s in _skinny_splits(n, k, r, w)
               for x in ((0, 1) if mt == 1 else (0,))
               for a in ((1, 2) if mt <= 2 else (1,))]
        # the register-capped rungs of the wide-weight ladder (`_SKINNY_WIDE_ONE_WAVE`), compiled for
        # their CTAs per SM
        out += [{**d, "SK_MINB": cta.minb} for cta in _SKINNY_WIDE_ONE_WAVE[wfmt] if cta.minb and mt == 1
                for d in out if (d["SK_R"], d["SK_WARPS"], d["SK_UNROLL"], d["SK_ACC"]) == (cta.r, 4, cta.unroll, cta.acc)]
        return [d for d in out if _skinny_ok(d, wfmt, m, k)]
    return candidates


# ---- skinny int8 MMA for decode (common/skinny_i8.cuh) ----------------------------------------
# what the kernels handle (SK_MQ <= 8; path= / a single-kernel call); qgemm.matmul runs them at
# M = 1 only (dispatch.SKINNY_I8_MAX_M)
SKINNY_I8_MAX_M = 8


def _skinny_i8_mq(m: int) -> int:
    """Tokens the kernel is compiled for: the power of two >= M (1, 2, 4, 8)."""
    return 1 << max(0, (min(m, SKINNY_I8_MAX_M) - 1).bit_length())


def _skinny_i8_ok(d: dict, wfmt: str, m: int, k: int) -> bool:
    pieces = 2 if wfmt == "q4_0" else 4
    mq, w, u, r = d["SK_MQ"], d["SK_WARPS"], d["SK_UNROLL"], d["SK_R"]
    # static shared memory: the reduction (512 B per warp and tile) and the per-warp double buffer
    # of quantized activations (32 B + 8 B of scales per block, token, step)
    smem = w * r * 512 + w * 2 * u * 4 * (32 * mq + 8 * max(mq, 2))
    return (mq >= min(m, SKINNY_I8_MAX_M) and smem <= 48 * 1024
            # registers: two pipelined sets of weights and of float4 activations, the accumulators
            and u * r * (pieces + 1) <= 12 and u * mq <= 8 and r <= 4
            and (w < 16 or u * r * (pieces + 1) <= 6))


def _skinny_i8_config(wfmt: str):
    def config(m: int, n: int, k: int, sm_count: int) -> dict:
        # The untuned default follows measurement on the H100 (docs/perf/NOTES.md). qgemm.matmul runs
        # this kernel at M = 1 only (M > 1 measured slower than the fp16 kernel; path= for the rest).
        # M = 1 (session 13): one 16-row tile per CTA, 8 warps splitting K, compiled for two resident
        # CTAs per SM (SK_MINB = 2, common/skinny_common.cuh; not Q8_0 at K >= 8192), which changes ptxas's schedule more
        # than the occupancy (a group's four MMAs stay independent); Q4_0 with two groups in flight
        # per lane, Q8_0 with one below K = 8192 and two above (DRAM-bound there). probe_defines,
        # kernel alone, 3 repetitions, against the session-9/11 defaults (Q4_0 two tiles x 16 warps
        # x one group, Q8_0 one tile x 8 warps x two groups, SK_MINB = 1):
        #   Q4_0 1x4096x4096   hot 3.61-3.70 -> 3.39-3.51 us, cold 4.76-4.86 -> 4.04-4.14
        #   Q4_0 1x4096x14336  hot 9.79-9.94 -> 9.23-9.31, cold 11.6 -> 11.2
        #   Q8_0 1x4096x4096   hot 4.68-4.73 -> 3.89-3.94, cold 6.53-6.56 -> 6.42
        #   Q8_0 1x4096x14336  one group 20.5-20.6 against two 19.8-20.0 (kept)
        # M > 1 (session 9): Q4_0 two tiles sharing each quantized activation block x 16 warps, Q8_0
        # (twice the weight registers) two tiles x 8 warps, one group each.
        minb = 1
        if wfmt == "q4_0" and m == 1:
            r, warps, unroll, minb = 1, 8, 2, 2
        elif wfmt == "q4_0":
            r, warps, unroll = 2, 16, 1
        elif m == 1 and k < 8192:
            r, warps, unroll, minb = 1, 8, 1, 2
        else:
            r, warps, unroll = 1 if m == 1 else 2, 8, 2 if m == 1 else 1
        d = {"SK_R": r, "SK_WARPS": warps, "SK_UNROLL": unroll, "SK_GSPLIT": _skinny_fill_split(n, k, r, 1, sm_count, 2, warps),
             "SK_MQ": _skinny_i8_mq(m),
             "SK_PDL_EARLY": _skinny_i8_pdl_early(m), "SK_MINB": minb, "SK_PRIME": _skinny_i8_prime(m, unroll)}
        while not _skinny_i8_ok(d, wfmt, m, k) and d["SK_WARPS"] > 4:
            d = {**d, "SK_WARPS": d["SK_WARPS"] // 2}
        tiles = cdiv(n, 16)
        if m == 1 and minb == 2 and tiles > 2 * sm_count:
            # wide weights, one token: the grid of one 16-row tile per CTA spills past the two CTAs
            # of 8 warps an SM holds (N > 4224 on 132 SMs), and the tail wave streams with few
            # CTAs. Q4_0 (118 registers: four CTAs of 4 warps per SM) takes 4 warps where those
            # need at most half the waves; Q8_0 below K = 8192 two tiles per CTA (half the CTAs;
            # 128 registers, still two per SM) up to four waves of them, where the tail still
            # counts (whole op: 1x11008x4096 16.65 / 16.48 -> 15.81 / 15.98 us hot / cold;
            # 1x18944x3584 0.99, 1x28672x4096 1.005). Session 56, H100, `tools/probe_defines.py`
            # kernel alone, weights cold / hot, us:
            #   Q4_0 1x4608x3584 6.08 / 5.29 -> 5.38 / 5.19, 1x6144x4096 7.23 / 5.72 -> 5.79 / 5.36,
            #        1x14336x4096 14.75 / 13.29 -> 12.82 / 10.96, 1x8192x8192 13.41 / 11.82 ->
            #        12.70 / 11.62; where the 4-warp grid needs more than half the waves slower or
            #        level: 1x10240x8192 18.34 -> 19.82 (640 CTAs), 1x28672x8192 45.22 -> 45.28
            #   Q8_0 1x4608x3584 8.96 / 6.36 -> 7.29 / 5.44, 1x6144x4096 10.03 / 7.38 -> 8.70 /
            #        6.25, 1x14336x4096 21.02 / 20.95 -> 19.95 / 20.04; at K = 8192 (its
            #        configuration of two load groups) level or slower: 1x8192x8192 22.69 ->
            #        22.68, 1x10240x8192 28.71 -> 31.51
            if wfmt == "q4_0" and d["SK_WARPS"] == 8 and 2 * cdiv(tiles, 4 * sm_count) <= cdiv(tiles, 2 * sm_count):
                d = {**d, "SK_WARPS": 4}
            elif wfmt == "q8_0" and d["SK_R"] == 1 and d["SK_UNROLL"] == 1 and tiles <= 8 * sm_count:
                d = {**d, "SK_R": 2}
        if wfmt == "q4_0" and m == 1 and k < 8192 and cdiv(n, 16) <= sm_count:
            # narrow weights (N <= 2048 on a 132-SM GPU: at most one 16-row tile per SM): the
            # configuration of the 16-bit-activation variant (`_x16_config`), no K split. Session
            # 51, kernel alone, hot / weights cold, against the one above (with its split):
            # 1x1024x4096 2.86 -> 2.49 us, cold 3.01 -> 2.47; 1x2048x4096 3.15 -> 2.55, cold 3.27 ->
            # 2.61; 1x512x4096 2.62 -> 2.49. At N = 4096 it is slower (session 41: 3.44 -> 3.60), and
            # at 1x1024x14336 cold too (4.53 -> 4.82).
            d = {**d, **_I8_Q4_0_ONE_TOKEN_TWO_TILES, "SK_GSPLIT": 1}
        return d
    return config


# Q4_0 at one token: two 16-row tiles per CTA x 16 warps x one group in flight, the first two
# requested before the PDL wait -- the 16-bit-activation variants' configuration (`_x16_config`),
# and float32's on narrow weights below K = 8192 (`_skinny_i8_config`)
_I8_Q4_0_ONE_TOKEN_TWO_TILES = {"SK_R": 2, "SK_WARPS": 16, "SK_UNROLL": 1, "SK_MINB": 1, "SK_PRIME": 1}
# the same two tiles with 8 warps, compiled for two CTAs per SM (111 registers): the 16-bit
# variants' choice where the 16-warp grid, one CTA per SM, would take more than 1.25 waves
_I8_Q4_0_ONE_TOKEN_WIDE = {**_I8_Q4_0_ONE_TOKEN_TWO_TILES, "SK_WARPS": 8, "SK_MINB": 2}


def _skinny_i8_pdl_early(m: int) -> int:
    """1: the kernel lets the next one launch at its entry (programmatic dependent launch), so the
    next op's CTAs stream their weights while this one's last CTAs finish. Measured at M = 1 on
    the H100 (session 11, tools/probe_defines.py, kernel alone, against the trigger after the main
    loop): Q8_0 1x4096x4096 cold 7.47 -> 6.93 us, 1x4096x14336 hot 20.57 -> 19.67, cold 20.9 -> 19.9;
    Q4_0 1x4096x4096 cold 5.00 -> 4.86; hot 1x4096x4096 within 1% (Q4_0 3.69 / 3.69, Q8_0 4.85 /
    4.90). Not measured above M = 1 (path= only there): the trigger after the loop stays."""
    return 1 if m == 1 else 0


def _skinny_i8_prime(m: int, unroll: int) -> int:
    """SK_PRIME (common/skinny_i8.cuh): at M = 1 with one group per step, request the first two
    steps' weights before the PDL wait. Measured on the H100 (session 29, Q8_0 1x4096x4096, the
    default's one group per step; tools/probe_defines.py kernel alone and tools/sweep_order.py
    whole op, old vs new tree alternating): cold 6.41-6.43 -> 5.79-5.84 us; hot right after the
    torch peers (the bench's order) 4.93-4.94 -> 4.60-4.65; hot with the weights left resident by
    qgemm rows only 3.89 -> 4.05-4.06. Decode weights come from DRAM in a model (they exceed the
    L2), so the first two count. With two groups per step (Q4_0, Q8_0 at K >= 8192) the same idea
    requests four groups per warp before the wait (at K = 4096 a warp's whole slice) and measured
    slower (Q4_0 1x4096x4096 cold 4.05 -> 4.38, Q8_0 1x4096x14336 19.7 -> 20.3): off there. The
    rule follows the step width only; a candidate whose warps hold just one or two groups (many
    warps, or K split across CTAs) primes its whole slice too -- `qgemm tune` times it as it is."""
    return int(m == 1 and unroll == 1)


def _skinny_i8_candidates(wfmt: str):
    def candidates(m: int, n: int, k: int) -> list[dict]:
        mq = _skinny_i8_mq(m)
        # SK_MINB = 2 only up to 8 warps: at 16 it caps the registers at 64 and spills
        out = [{"SK_R": r, "SK_WARPS": w, "SK_UNROLL": u, "SK_GSPLIT": s, "SK_MQ": mq, "SK_PDL_EARLY": _skinny_i8_pdl_early(m),
                "SK_MINB": b, "SK_PRIME": _skinny_i8_prime(m, u)}
               for r in (1, 2, 4) for w in (4, 8, 16) for u in (1, 2, 4) for s in _skinny_splits(n, k, r, w)
               for b in ((1, 2) if w <= 8 else (1,))]
        return [d for d in out if _skinny_i8_ok(d, wfmt, m, k)]
    return candidates


# ---- skinny int8 MMA on Q8_1 activations (common/skinny_q8_1.cuh) ---------------------------
SKINNY_Q8_1_MAX_M = 32


def _skinny_q8_1_mt(m: int) -> int:
    """8-token tiles the kernel is compiled for: 1, 2 or 4 (M <= 8, 16, 32)."""
    return 1 if m <= 8 else (2 if m <= 16 else 4)


def _skinny_q8_1_ok(d: dict, wfmt: str, m: int, k: int) -> bool:
    pieces = 2 if wfmt == "q4_0" else 4
    mt, w, u, r = d["SK_MT"], d["SK_WARPS"], d["SK_UNROLL"], d["SK_R"]
    # static shared memory: the cross-warp reduction (512 B per warp, tile and 8 tokens);
    # registers: two pipelined sets of weights (uint4s) and of activation words (4 per block and
    # 8-token tile), the accumulators. u r mt > 4 spills under the 255-register cap, and 16 warps
    # leave 128 registers per thread (both from `qgemm compile`, sm_90, NVRTC 13)
    return (8 * mt >= min(m, SKINNY_Q8_1_MAX_M) and w * r * mt * 512 <= 48 * 1024
            and u * r * (pieces + 1) <= 12 and u * r * mt <= 4
            and (w < 16 or (u * r * (pieces + 1) <= 6 and u * mt <= 1)))


def _skinny_q8_1_config(wfmt: str):
    def config(m: int, n: int, k: int, sm_count: int) -> dict:
        # `qgemm tune --dry-run` on the H100 (docs/perf/NOTES.md, session 10): Q4_0 two 16-row tiles
        # per CTA and 16 warps (8x4096x4096 4.3 us), 8 warps where two 8-token tiles need the
        # registers; Q8_0 one tile and 8 warps up to 4 tokens (2x 4.2, 4x 4.6), two tiles above
        # (8x 5.0 against 5.8, 16x 7.6 against 12.2).
        mt = _skinny_q8_1_mt(m)
        r, warps = (2, 16) if wfmt == "q4_0" else (1 if m <= 4 else 2, 8)
        d = {"SK_R": r, "SK_WARPS": warps, "SK_UNROLL": 1, "SK_GSPLIT": 1, "SK_MT": mt}
        while not _skinny_q8_1_ok(d, wfmt, m, k) and d["SK_WARPS"] > 8:
            d = {**d, "SK_WARPS": d["SK_WARPS"] // 2}
        while not _skinny_q8_1_ok(d, wfmt, m, k) and d["SK_R"] > 1:
            d = {**d, "SK_R": d["SK_R"] // 2}
        return d
    return config


def _skinny_q8_1_candidates(wfmt: str):
    def candidates(m: int, n: int, k: int) -> list[dict]:
        mt = _skinny_q8_1_mt(m)
        out = [{"SK_R": r, "SK_WARPS": w, "SK_UNROLL": u, "SK_GSPLIT": s, "SK_MT": mt}
               for r in (1, 2, 4) for w in (4, 8, 16) for u in (1, 2) for s in (1, 2, 4)]
        return [d for d in out if _skinny_q8_1_ok(d, wfmt, m, k)]
    return candidates


# ---- Hopper wgmma prefill (common/wgmma_f16.cuh) -------------------------------------------
def _wgmma_geometry(m: int, n: int, k: int, d: dict) -> Launch:
    # 128 x 128 tiles; WG_STAGES buffers of two 32 KB fp16 tiles, +1 KB to align them to 1024 B
    # (+64 B: the producer/consumer mbarriers of WG_SPEC)
    split = d.get("WG_SPLITK", 1)
    return Launch(grid=(cdiv(n, 128), cdiv(m, 128), split), block=(512 if d.get("WG_SPEC") else 256, 1, 1),
                  shmem=d["WG_STAGES"] * 64 * 1024 + 1024 + 64, split=split)


def _wgmma_config(m: int, n: int, k: int, sm_count: int) -> dict:
    return {"WG_STAGES": 3, "WG_SPLITK": _split_k(cdiv(n, 128) * cdiv(m, 128), k, sm_count), "WG_SPEC": 0}


def _wgmma_candidates(m: int, n: int, k: int) -> list[dict]:
    # warp specialization needs 3 stages: with 2 the producer would wait for a release that needs
    # the stage it has not signalled yet
    ctas = cdiv(n, 128) * cdiv(m, 128)
    return [{"WG_STAGES": s, "WG_SPLITK": sp, "WG_SPEC": spec} for s in (2, 3) for sp in _tune_splits(ctas, k) for spec in (0, 1)
            if _split_k_ok(ctas, k, sp) and not (spec and s < 3)]


# ---- Hopper wgmma, weights as the register A operand (common/wgmma_rs_f16.cuh) ----------------
_RS_PIECES = {"q4_0": 2, "q8_0": 4}


def _rs_stage_bytes(wfmt: str, d: dict) -> int:
    """One pipeline buffer: the activation tile [RS_BN][128] fp16, the CTA's raw quants and scales
    (4 tiles of 16 rows per warpgroup), rounded up to the 1024-byte swizzle alignment."""
    w = 4 * d["RS_WGS"] * (_RS_PIECES[wfmt] * 32 * 16 + 128)
    return cdiv(d["RS_BN"] * 256 + w, 1024) * 1024


def _rs_geometry(wfmt: str):
    def geometry(m: int, n: int, k: int, d: dict) -> Launch:
        split = d.get("RS_SPLITK", 1)  # RS_MINB only bounds registers (launch bounds): no launch change
        ws = d.get("RS_WS", 0)  # warp-specialized: + a copying warpgroup and 2 mbarriers per buffer
        return Launch(grid=(cdiv(n, 64 * d["RS_WGS"]), cdiv(m, d["RS_BN"]), split), block=(128 * (d["RS_WGS"] + ws), 1, 1),
                      shmem=_rs_shmem(wfmt, d), split=split)
    return geometry


def _rs_shmem(wfmt: str, d: dict) -> int:
    # the buffers, 1 KB of slack for their 1024-byte alignment, and the mbarriers when warp-specialized
    return d["RS_STAGES"] * _rs_stage_bytes(wfmt, d) + 1024 + (128 if d.get("RS_WS", 0) else 0)


_MiB = 1 << 20


def _rs_wef(wfmt: str, m: int, n: int, k: int) -> int:
    """RS_WEF (common/wgmma_rs_f16.cuh): copy the weights with an L2 evict-first policy when the
    op's activations and output (float32 x, its fp16 copy that every N tile re-reads, float32 C)
    fit the 50 MB L2 of the H100 / H200 with room to spare (<= 32 MiB) but the weights on top of
    them would not (>= 30 MiB in all), so the once-per-wave weight stream stops evicting them.
    Measured whole op on the H100 (tools/compare_paths.py, old vs new tree alternating, docs/perf/
    NOTES.md session 14), us, without -> with the policy:
      faster: 512x4096x4096 Q8_0 31.2-31.4 -> 29.6, 384 Q8_0 31.4-31.5 -> 31.0-31.1, 640 Q8_0
              60.1-60.3 -> 57.6-58.5, 768 Q8_0 57.6-57.7 -> 55.2-55.3 / Q4_0 55.2-55.4 -> 53.9-54.7,
              256x4096x14336 Q4_0 54.5 -> 51.3-52.1 / Q8_0 58.5 -> 54.5-54.9, 128x4096x14336
              (split-K 4) Q4_0 30.9-31.1 -> 29.4-29.7 / Q8_0 36.7-37.0 -> 32.6-32.7
      slower (all outside the rule): 64 and 128 tokens at K = 4096 (weights that fit stay resident
              without it),
              256x4096x4096, 1024x4096x4096, 2048x4096x4096 (+4%: token tiles in later waves
              re-read the weights), 384 and 512 x4096x14336 (activations alone over 32 MiB)
      at the edge (rule: off): 512x4096x4096 Q4_0 (29.0 MiB in all) 28.7-29.2 -> 28.4-28.6.
    Only above 64 tokens: at 17-64 tokens of a long K, where the size test would fire, it was
    never measured."""
    if m <= 64:
        return 0
    act = m * k * (4 + 2) + m * n * 4
    weights = n * (k // 32) * (18 if wfmt == "q4_0" else 34)
    return int(act <= 32 * _MiB and act + weights >= 30 * _MiB)


def _rs_ok(wfmt: str, d: dict) -> bool:
    return _rs_shmem(wfmt, d) <= 227 * 1024


def _rs_config(wfmt: str):
    def config(m: int, n: int, k: int, sm_count: int) -> dict:
        # H100 tuning (docs/perf/NOTES.md): above M = 64, 2 MMA warpgroups, 4 buffers, 128-token tiles
        # (for Q4_0 256 measured no faster once the copies were cheap; Q8_0 from 256 tokens: below)
        # and 1 copying warpgroup (warp-specialized: 8% faster at 512 and 2048 tokens).
        #
        # Up to M = 64 (session 10, after the split-K end became vector reductions): one MMA warpgroup
        # per CTA (64 weight rows), two CTAs per SM (85-101 KiB of shared memory each: Q4_0 / Q8_0), so the split-K
        # default counts two CTA slots per SM: 64x4096x4096 Q4_0 9.5 us against 9.7 for two
        # warpgroups, 32x4096x4096 9.0 / 9.1, Q8_0 10.5 / 10.5 and 9.9 / 10.0; at long K the copying
        # warpgroup too (64x4096x14336 Q4_0 20.4 against 21.5, Q8_0 30.1 against 31.8).
        if m <= 64 and cdiv(n, 64) * cdiv(m, 64) >= sm_count:
            # wide weights (N >= 8448 on a 132-SM GPU: the tiles fill the SMs without a K split), the
            # copying warpgroup at any K, and for Q4_0 two MMA warpgroups (session 51, H100, kernel
            # alone, `qgemm tune --dry-run`): Q4_0 32 / 48 / 64 x14336x4096 21.8 / 21.9 / 20.6 ->
            # 17.5 / 17.7 / 17.6 us; Q8_0 (one warpgroup) 27.5 / 28.1 / 28.3 -> 24.3 / 25.2 / 25.9.
            wgs = 2 if wfmt == "q4_0" else 1
            return {"RS_BN": 64, "RS_WGS": wgs, "RS_STAGES": 4, "RS_MINB": 1, "RS_WS": 1,
                    "RS_SPLITK": _split_k(cdiv(n, 64 * wgs) * cdiv(m, 64), k, sm_count), "RS_WEF": _rs_wef(wfmt, m, n, k)}
        if m <= 64:
            d = {"RS_BN": 64, "RS_WGS": 1, "RS_STAGES": 4, "RS_MINB": 1, "RS_WS": int(k >= 8192)}
            d["RS_SPLITK"] = _split_k(cdiv(n, 64) * cdiv(m, 64), k, 2 * sm_count)
            two = _split_k(cdiv(n, 128) * cdiv(m, 64), k, 2 * sm_count)
            if m <= 32 and (wfmt == "q4_0" or k < 8192) and cdiv(n, 128) * two >= 1.15 * cdiv(n, 64) * d["RS_SPLITK"]:
                # Where the split of 64-row tiles truncates badly (N = 4225-4736 and 5633-6656 on 132
                # SMs, e.g. a fused qkv of 6144: 96 tiles split 2 fill 192 of 264 CTA slots), two MMA
                # warpgroups of 128 rows split 5 fill 240 (session 52, H100). Whole op (`tools/compare_paths.py`,
                # float32 x): Q4_0 17 / 32 x6144x4096 13.18 / 13.11 -> 11.23 / 11.51 us, 32x6144x14336
                # 38.3 -> 33.3; Q8_0 (three buffers, two CTAs per SM) 14.19 / 14.10 -> 13.34 / 13.79. Up
                # to 32 tokens: at 64 the kernel alone is faster (Q4_0 13.5 -> 11.6, Q8_0 14.4 -> 13.3)
                # but the whole op slower (13.1 -> 13.3-13.7, 14.3 -> 16.2-16.4; not looked into); and
                # Q8_0 at a short K only (32x6144x14336 level kernel alone).
                d["RS_WGS"], d["RS_SPLITK"] = 2, two
                if wfmt == "q8_0":
                    d["RS_STAGES"], d["RS_MINB"] = 3, 2
            d["RS_WEF"] = _rs_wef(wfmt, m, n, k)
            return d
        d = {"RS_BN": 128, "RS_WGS": 2, "RS_STAGES": 4, "RS_MINB": 1, "RS_WS": 1}
        whole = cdiv(n, 128) * cdiv(m, 128)  # 128 x 128 tiles
        # A short K is one where a K split costs more than it fills: there one MMA warpgroup per CTA
        # (twice the CTAs) fills the GPU instead of a split. For a grid spilling into a second wave
        # session 54 moved the bound from 8192 to 5120 (`_rs_long_k_split` splits instead; H100,
        # whole op, old -> new: 450x5120x5120 Q4_0 62.9 -> 57.9 us, 700x4096x6144 78.1 -> 74.9).
        # Few tiles keep 8192, but not where one warpgroup's grid cannot split (`_rs_split_fills_more`).
        short_k = k < 5120
        few_tiles = k < 8192 and 2 * whole <= sm_count and not _rs_split_fills_more(m, n, k, sm_count)
        if whole * 8 <= sm_count or few_tiles:
            # narrow weights (N <= 2048 at 65-128 tokens on a 132-SM GPU): even an 8-way K split
            # leaves SMs idle, so one MMA warpgroup of 64 rows per CTA (twice the CTAs). Session 51,
            # H100, kernel alone: 128x1024x4096 Q4_0 7.9 -> 6.7 us, Q8_0 8.5 -> 7.0; 128x2048x4096
            # 9.6 -> 8.4, 10.5 -> 8.7.
            # At a short K the same wherever the 128 x 128 grid fills at most half the SMs: the
            # tiles of 64 rows need half the K split, and at K = 4096 a split costs more than the
            # one MMA warpgroup's lower rate (session 52, H100, kernel alone, `qgemm tune
            # --dry-run`, split 4 / 2 -> 2 / 1): 128x4096x4096 Q4_0 12.6 -> 11.8 us, Q8_0 13.4 ->
            # 12.3; 160x4096x4096 17.4 -> 16.4, 18.5 -> 16.4; 192 17.5 -> 15.3, 18.8 -> 16.2; 256
            # Q4_0 18.4 -> 15.7, Q8_0 (256-token tiles, split 2) 18.7 -> 16.6; 96 level (11.9 ->
            # 11.7). At K = 14336 the split two warpgroups stay ahead (192x4096x14336 46.3 against
            # > 50.8, 96x4096x14336 26.3 against 30.8).
            d["RS_WGS"] = 1
        if wfmt == "q8_0" and m >= 256 and cdiv(m, 128) % 2 == 0 and not few_tiles:
            # Q8_0 from 256 tokens (session 12, after the kperm16 activations): one MMA warpgroup
            # with 256-token wgmma, so each dequantized fragment serves twice the tokens -- half
            # the shared loads and dequantization per FLOP, which is what limits Q8_0 (twice
            # Q4_0's quant bytes). Kernel alone, H100: 512x4096x4096 28.0 -> 27.1-27.7 us,
            # 2048x4096x4096 113.8 -> 109.5, 512x4096x14336 92.6 -> 89.2, 256x4096x4096 19.9 ->
            # 19.1. Q4_0 ties at 512 (25.6 / 25.5) and loses at 2048 (103.8 / 101.5): unchanged.
            # Only where 256-token tiles pad no more tokens than 128-token ones (an even number
            # of 128-token tiles, session 51): with a half-empty last tile the CTAs are as many
            # (64 x 256 and 128 x 128 tiles have the same area) but more of them compute padding,
            # re-read activations and leave a partial wave. Kernel alone, H100, 256-token tiles
            # -> 128: 384x4096x14336 100.2 -> 84.8 us, 640x14336x4096 177.6 -> 150.1, 513x1024x8192
            # 30.2 -> 22.4, 4097x4096x4096 244.1 -> 228.7, 384x4096x4096 28.4 -> 26.4, 640 and 896
            # x4096x4096 3% faster; level at 513, 769 and 1100 (within 1%); 2100x4096x4096 135.7
            # -> 138.1 (the one loss measured).
            d = {"RS_BN": 256, "RS_WGS": 1, "RS_STAGES": 3, "RS_MINB": 1, "RS_WS": 1}
        elif d["RS_WGS"] == 2 and _rs_half_tiles_fewer_waves(m, n, k, sm_count):
            # Q4_0 without the copying warpgroup only where the half tiles make two waves or more: two
            # such CTAs (~100 KiB of shared memory each) then share an SM and hide each other's
            # latency; one per SM below a wave runs 1.8x slower without it (session 54, H100, kernel
            # alone, Q4_0 300x3072x7168 53.9 against 30.0 us, 100x5120x5120 37.3 against 21.2)
            d = {"RS_BN": 64, "RS_WGS": 2, "RS_STAGES": 4, "RS_MINB": 1, "RS_WS": int(wfmt == "q8_0" or whole < sm_count)}
        elif d["RS_WGS"] == 2 and short_k and _rs_half_rows_fewer_waves(whole, sm_count):
            d["RS_WGS"] = 1
        while not _rs_ok(wfmt, d):
            d["RS_STAGES"] -= 1
        ctas = cdiv(n, 64 * d["RS_WGS"]) * cdiv(m, d["RS_BN"])
        d["RS_SPLITK"] = _split_k(ctas, k, sm_count)
        if not short_k and sm_count // 2 < ctas <= 3 * sm_count // 2:
            d["RS_SPLITK"] = _rs_long_k_split(ctas, k, sm_count)
        d["RS_WEF"] = _rs_wef(wfmt, m, n, k)
        return d
    return config


def _fewer_waves(ctas: int, alt_ctas: int, alt_share: float, alt_efficiency: float, sm_count: int) -> bool:
    """The wave count behind `wgmma_rs`'s grid rules (one CTA per SM): whether a grid of `alt_ctas`
    CTAs, each doing `alt_share` of a CTA's work of the grid of `ctas` at `alt_efficiency` of its
    rate, finishes sooner -- its waves times the cost of one, against the whole grid's waves."""
    return cdiv(alt_ctas, sm_count) * alt_share / alt_efficiency < cdiv(ctas, sm_count)


# wgmma_rs's cost model (sessions 51-54, H100): a wave of CTAs, one per SM, costs the K each CTA
# walks plus RS_SPLIT_OVERHEAD_K when K is split (its pipeline's fill and drain and the reduction
# into a zeroed C), times the CTA's share of a 128 x 128 tile's work over its rate relative to one
# (tools/split_model.py sets these against `qgemm tune --json` timings)
RS_SPLIT_OVERHEAD_K = 768
RS_TILE_RATES = {(128, 2): 1.0,   # 128 tokens x two MMA warpgroups (128 weight rows): the unit
                 (128, 1): 0.78,  # 64 weight rows (`_rs_half_rows_fewer_waves`, session 52)
                 (64, 2): 0.72}   # 64 tokens (`_rs_half_tiles_fewer_waves`, session 51)


def rs_grid_cost(m: int, n: int, k: int, bn: int, wgs: int, split: int, sm_count: int,
                 overhead: float = RS_SPLIT_OVERHEAD_K, rates: dict | None = None) -> float | None:
    """The modelled time of a wgmma_rs grid (tokens per tile `bn`, `wgs` MMA warpgroups, K split
    `split` ways) in K-steps of a 128 x 128 tile, or None for a tile without a measured rate;
    `overhead` and `rates` stand in for RS_SPLIT_OVERHEAD_K and RS_TILE_RATES."""
    rate = (RS_TILE_RATES if rates is None else rates).get((bn, wgs))
    if rate is None:
        return None
    ctas = cdiv(n, 64 * wgs) * cdiv(m, bn)
    return _rs_split_cost(ctas, k, split, sm_count, overhead) * (bn * wgs / 256) / rate


def _rs_split_fills_more(m: int, n: int, k: int, sm_count: int) -> bool:
    """Whether two MMA warpgroups over the 128 x 128 tiles (at most half the SMs), K split to fill the
    wave, fill more SMs than one warpgroup's grid of 64-row tiles, which at more than half the SMs
    takes no split: 34-44 tiles on 132 SMs (68-88 CTAs unsplit against 102-132 split 3). Session 54,
    H100, whole op, one warpgroup -> two split 3: 100x5120x4096 Q4_0 17.1 -> 15.7 us, Q8_0 17.9 ->
    16.3; 250x2304x4096 18.2 -> 15.4, 18.9 -> 16.3; 100x5120x5120 21.3 -> 17.4, 22.7 -> 18.6;
    600x1024x4096 18.5 -> 15.5, 19.3 -> 16.6; 1200x512x4096 22.2 -> 19.3, 23.2 -> 20.2. Where one
    warpgroup's grid fills as well, it stays (K = 5120, one -> two split 4 / 2: 128x4096x5120 Q4_0
    14.9 -> 15.7, 256x4096x5120 21.7 -> 23.1). On 132 SMs: 65-128 tokens at N = 5120, 513-640 at
    1024, 1025-1408 at 512; never at N = 4096."""
    whole = cdiv(n, 128) * cdiv(m, 128)
    one = cdiv(n, 64) * cdiv(m, 128)
    return one > sm_count // 2 and whole * _split_k(whole, k, sm_count) > one


def _rs_half_tiles_fewer_waves(m: int, n: int, k: int, sm_count: int) -> bool:
    """Whether 64-token tiles (two MMA warpgroups, so 64 x 128 outputs per CTA) finish in less time
    than 128-token ones (below one wave too since session 54: the end of this function) where the
    128-token grid fills the GPU (no K split) but spills a few CTAs into one more wave: one CTA per
    SM either way, a wave of half tiles costing 0.5 / 0.72 of a wave of whole ones (their
    efficiency, session 51: H100, kernel alone, 300x6144x4096 Q4_0 47.6 us in two waves of 144 whole
    tiles against 33.0 in two of 240 half tiles; Q8_0 52.3 against 41.1, its copying warpgroup
    kept). Where the half tiles need as many waves as whole ones take (300x4096x4096: 96 whole
    tiles, one wave, 23.7 against >= 30.7) or more, the whole tiles stay. Whole op, H100, whole
    tiles -> half: Q4_0 300x6144x4096 50.1 -> 36.7 us, 150x11008x4096 50.7 -> 36.3, 680x3072x4096
    52.5 -> 37.9, 680x6144x4096 80.2 -> 72.7, 800x5120x4096 81.9 -> 74.5, 2080x2048x4096 91.1 ->
    84.5; Q8_0 300x6144x4096 54.9 -> 42.8, 150x11008x4096 53.9 -> 44.6, 800x5120x4096 and
    2080x2048x4096 level. On a 132-SM GPU it fires in narrow bands of M: 257-320 and 641-704 tokens
    at N = 6144, 129-192 at 11008, 641-704 at 3072, 769-832 at 5120, 2049-2112 at 1024 and 2048;
    never at N = 4096 or 14336."""
    whole = cdiv(n, 128) * cdiv(m, 128)
    half = cdiv(n, 128) * cdiv(m, 64)
    if whole >= sm_count:
        return _fewer_waves(whole, half, 0.5, RS_TILE_RATES[(64, 2)], sm_count)
    # Below one wave, where the half tiles still make one (tokens in the first half of a 128-token
    # tile: half < 2 * whole) -- against the whole grid at its best K split, in
    # `_rs_long_k_split`'s cost. Session 54, H100, kernel alone: 300x3072x7168 (72 whole tiles,
    # 120 half) Q4_0 30.0 us against 34.9 split 3 and 40.2 whole, Q8_0 33.2 against 38.0 / 42.3;
    # 300x4096x6144 (96 / 160, two waves) stays whole: 34.9 against 48.1. Whole op (`gpu_check.sh
    # ab`), whole -> half, Q4_0 / Q8_0: 300x3072x4096 26.2 -> 20.3 / 27.7 -> 22.8 (cold 27.1 ->
    # 22.3 / 29.2 -> 24.2), 160x5120x4096 25.8 -> 20.3 / 27.4 -> 23.5, 2080x512x4096 39.6 -> 34.6 /
    # 41.4 -> 37.9, 300x3072x7168 43.3 -> 33.5 / 45.9 -> 36.7; against split 3, 300x3072x14336
    # 67.3 -> 64.5 / 71.9 -> 71.5. On 132 SMs it fires at 257-320 tokens at N = 3072, 129-192 at
    # 5120 and 2049-2112 at 512 (any K); never at N = 4096.
    if sm_count // 2 < whole and half <= sm_count:
        split = _rs_long_k_split(whole, k, sm_count)
        return rs_grid_cost(m, n, k, 64, 2, 1, sm_count) < rs_grid_cost(m, n, k, 128, 2, split, sm_count)
    return False


def _rs_half_rows_fewer_waves(whole: int, sm_count: int) -> bool:
    """Whether tiles of 64 weight rows (one MMA warpgroup, 128 tokens: twice the CTAs of the
    128 x 128 grid of `whole` tiles) finish in less time at a short K, where that grid spills a few
    CTAs into one more wave: a wave of half tiles costs 0.5 / 0.78 of a wave of whole ones (their
    efficiency, session 52: H100, kernel alone, `qgemm tune --dry-run`, Q4_0 whole -> half:
    544x4096x4096 49.8 -> 47.4 us, 640 48.5 -> 46.2, 768 49.0 -> 47.6, 512x6144x4096 50.0 -> 47.2,
    256x11008x4096 49.3 -> 46.9; Q8_0 544 52.8 -> 51.1, 640 52.1 -> 50.4). On a 132-SM GPU: 133-198
    whole tiles (two waves, the second short); at 224 (896x4096x4096) and 288 (1152) the whole tiles
    stay ahead, as this says. Q8_0's 256-token tiles (64 rows already) and the 64-token tiles of
    `_rs_half_tiles_fewer_waves` are chosen before this."""
    return whole > sm_count and _fewer_waves(whole, 2 * whole, 0.5, RS_TILE_RATES[(128, 1)], sm_count)


def _rs_long_k_split(ctas: int, k: int, sm_count: int) -> int:
    """The K split (1-4) of a grid of `ctas` CTAs (one per SM) at a long K that finishes first,
    where the grid leaves SMs idle in its last wave and `_split_k` (which only fills one wave)
    keeps it whole: half the SMs up to one and a half waves. A CTA of a `s`-way split costs
    K / s + 768 (the split's fixed cost in K, ~6 stages of 128: its pipeline's fill and drain and
    the fp32 reduction into a zeroed C; with 768 the model meets 64 timings at 3.5% rms, 11% at
    worst, and picks the fastest split measured at every shape but one, a tie), times the waves.
    Session 53, H100, kernel alone, `qgemm tune --dry-run` (Q4_0; Q8_0 alike), split 1 ->
    the one chosen: 96 CTAs, 300x4096x14336 81.3 -> 73.6 us (split 4), 300x4096x11008 63.1 ->
    60.1 (4), 200x6144x14336 81.5 -> 73.8 (4); 72, 1100x1024x14336 80.2 -> 63.4 (3),
    1100x1024x8192 46.9 -> 40.3 (3); 86, 100x11008x14336 82.2 -> 67.1 (3); 160, 576x4096x14336
    166.7 -> 123.8 (4; split 2, session 52's rule, 139.1), 2500x1024x14336 166.6 -> 127.7 (4),
    600x4096x11008 128.6 -> 102.8 (4; 3 102.7); 172, 256x11008x14336 167.9 -> 138.2 (3; split 2 140.8);
    192, 768x4096x14336 160.1 -> 145.2 (2; split 3 164.2). Kept whole, as measured: 96 CTAs at
    K = 8192 (384x4096x8192 45.3 against 49.2 split 4, 2048 K per CTA) and 112 at K = 4096. Past
    one and a half waves not measured (at 224 and 288 CTAs no split stays ahead, session 52).
    From K = 5120 since session 54 (8192 before; at K = 4096 the model splits no grid of this
    band). Whole op, H100, `gpu_check.sh ab`, split 1 -> the one chosen: 1100x1024x6144 Q4_0 48.6
    -> 45.5 us (3), Q8_0 49.8 -> 47.4; 450x5120x5120 Q8_0 (256-token tiles) 70.1 -> 64.2 (3);
    700x4096x6144 Q8_0 87.8 -> 82.8 (2); 200x5120x5120 Q4_0 31.2 -> 30.1 (3), Q8_0 level (33.3 /
    33.6 -> 33.7 / 33.1 in two calls, cold 34.9 -> 35.3)."""
    return min(range(1, 5), key=lambda split: (_rs_split_cost(ctas, k, split, sm_count), split))


def _rs_split_cost(ctas: int, k: int, split: int, sm_count: int, overhead: float = RS_SPLIT_OVERHEAD_K) -> float:
    """`_rs_long_k_split`'s model: the waves of the split grid times a CTA's K, plus the fixed
    cost of a split (RS_SPLIT_OVERHEAD_K, 768) when split."""
    return cdiv(ctas * split, sm_count) * (k / split + (overhead if split > 1 else 0))


def _rs_candidates(wfmt: str):
    def candidates(m: int, n: int, k: int) -> list[dict]:
        out = []
        # RS_WEF is not a tuning dimension: `qgemm tune` times the kernel alone, and what the policy
        # changes is what the op leaves in L2 for its prologue and the next op; every candidate
        # carries the per-shape value
        wef = _rs_wef(wfmt, m, n, k)
        for bn in (64, 128, 256):
            for wgs in (1, 2):  # 4 (256 weight rows per activation tile) measured 1.8x slower at 512 tokens: not tried
                ctas = cdiv(n, 64 * wgs) * cdiv(m, bn)
                for st in (3, 4, 5):
                    for sp in _tune_splits(ctas, k):
                        for ws in (0, 1):
                            d = {"RS_BN": bn, "RS_WGS": wgs, "RS_STAGES": st, "RS_SPLITK": sp, "RS_MINB": 1, "RS_WS": ws,
                                 "RS_WEF": wef}
                            if _rs_ok(wfmt, d) and _split_k_ok(ctas, k, sp):
                                out.append(d)
                                # two CTAs per SM (16 warps to hide the dequantization's latency) where their
                                # shared memory fits and 128 registers hold a 64 x 64 accumulator
                                if bn == 64 and wgs == 2 and not ws and 2 * _rs_geometry(wfmt)(m, n, k, d).shmem <= 228 * 1024:
                                    out.append({**d, "RS_MINB": 2})
        return out
    return candidates


def _quantize_rows(m: int, n: int, k: int) -> Launch:
    # 8 warps x 4 blocks of 32 per CTA along K; a CTA row per token, row = y + 65535 z past CUDA's
    # 65535 along y (common/quantize_q8_1.cuh)
    return Launch(grid=(cdiv(k, 1024), min(m, 65535), cdiv(m, 65535)), block=(256, 1, 1))


def _block_per_thread(m: int, n: int, k: int) -> Launch:
    # the weight quantizers: a thread per block of 32 over the M x K/32 blocks in one line
    # (common/quantize_weights.cuh)
    return Launch(grid=(cdiv(m * (k // 32), 256), 1, 1), block=(256, 1, 1))


def _convert_values(m: int, n: int, k: int) -> Launch:
    # convert.*: 8 values per thread, 256 threads per CTA, over the M x K values in one line (common/convert.cuh)
    return Launch(grid=(cdiv(m * k, 2048), 1, 1), block=(256, 1, 1))


def _pack_geometry(n: int, _unused: int, k: int) -> Launch:
    """pack.*: a CTA per tile of 16 rows x 16 groups of 4 blocks (cuda_src/pack/skinny.cu), for the
    weights [N, K] of an MxNxK product -- called as geometry(N, 0, K); grid.y is the tile, so one
    call repacks at most 65535 x 16 rows. The same for both formats (only the bytes per block differ)."""
    from . import packing

    n16, nb4 = packing.padded(n, k)
    return Launch(grid=(cdiv(nb4 // 4, 16), n16 // 16, 1), block=(256, 1, 1))


# the skinny kernels' modules carry qgemm_zero_output (common/zero_output.cuh; ops.Kernel.launch runs it
# before a launch that splits K across CTAs, instead of a memset)
_SKINNY_HELPERS = (ops.ZERO_ENTRY,)

_SPECS = [
    KernelSpec("fp32.naive", ops.FP32, 1, "fp32/naive.cu", "fp32_naive", _thread_per_output,
               "FP32 GEMM, one thread per output, operands straight from global memory"),
    KernelSpec("fp32.tiled", ops.FP32, 1, "fp32/tiled.cu", "fp32_tiled", _tile_64x64,
               "FP32 GEMM, 64x64 shared-memory tiles, 4x4 outputs per thread"),
    KernelSpec("quantize.q8_1", ops.QUANTIZE_Q8_1, 2, "quantize/q8_1.cu", "quantize_q8_1", _quantize_rows,
               "float32 activations -> Q8_1 blocks (d, s = sum x), as ggml-cuda's quantize_q8_1", pdl=True),
    KernelSpec("convert.f16", ops.CONVERT_F16, 2, "convert/f32_to_f16.cu", "convert_f32_to_f16",
               _convert_values,
               "float32 activations -> float16 (round to nearest even), the prologue of the fp16 tensor-core path",
               pdl=True, zeroes=True),
    KernelSpec("convert.f16k", ops.CONVERT_F16K, 2, "convert/f32_to_f16.cu", "convert_f32_to_f16",
               _convert_values,
               "float32 activations -> float16 in the kperm16 layout (k deinterleaved inside every 16), the prologue "
               "of the Hopper prefill kernels", defines={"CV_KPERM": 1}, pdl=True, zeroes=True),
    KernelSpec("convert.f16k_f16", ops.PERMUTE_F16K, 2, "convert/f16_kperm.cu", "convert_f16_kperm",
               _convert_values,
               "float16 activations -> the kperm16 layout of the Hopper prefill kernels (the values unchanged)",
               pdl=True, zeroes=True),
    KernelSpec("convert.f16_bf16", ops.CONVERT_F16_BF16, 2, "convert/bf16_to_f16.cu", "convert_bf16_to_f16",
               _convert_values,
               "bfloat16 activations -> float16 (round to nearest even), the prologue of the fp16 tensor-core path",
               pdl=True, zeroes=True),
    KernelSpec("convert.f16k_bf16", ops.CONVERT_F16K_BF16, 2, "convert/bf16_to_f16.cu", "convert_bf16_to_f16",
               _convert_values,
               "bfloat16 activations -> float16 in the kperm16 layout, the prologue of the Hopper prefill kernels",
               defines={"CV_KPERM": 1}, pdl=True, zeroes=True),
    KernelSpec("pack.q4_0", ops.PACK_Q4_0, 6, "pack/skinny.cu", "pack_skinny", _pack_geometry,
               "ggml Q4_0 blocks -> the skinny layout of the decode and Hopper prefill kernels, on the GPU "
               "(qgemm.pack_weights; qgemm.matmul on ggml blocks where a packed kernel is faster)",
               defines={"PK_Q8": 0}),
    KernelSpec("pack.q8_0", ops.PACK_Q8_0, 6, "pack/skinny.cu", "pack_skinny", _pack_geometry,
               "ggml Q8_0 blocks -> the skinny layout of the decode and Hopper prefill kernels, on the GPU "
               "(qgemm.pack_weights; qgemm.matmul on ggml blocks where a packed kernel is faster)",
               defines={"PK_Q8": 1}),
    KernelSpec("quantize.q8_1_f16", ops.QUANTIZE_Q8_1_F16, 2, "quantize/q8_1_f16.cu", "quantize_q8_1_f16", _quantize_rows,
               "float16 activations -> Q8_1 blocks (same bytes as quantize.q8_1 of the values as float32)", pdl=True),
    KernelSpec("quantize.q8_1_bf16", ops.QUANTIZE_Q8_1_BF16, 2, "quantize/q8_1_bf16.cu", "quantize_q8_1_bf16",
               _quantize_rows, "bfloat16 activations -> Q8_1 blocks (same bytes as quantize.q8_1 of the values as float32)",
               pdl=True),
    *[KernelSpec(f"quantize.{fmt}{suffix}", op, 2, f"quantize/{fmt}.cu", f"quantize_{fmt}{suffix}", _block_per_thread,
                 f"{what} weights -> {fmt.upper()} blocks, byte for byte ggml's quantize_row_{fmt}_ref "
                 "(qgemm.pack_weights of float weights)")
      for fmt, variants in (("q4_0", (ops.QUANTIZE_Q4_0, ops.QUANTIZE_Q4_0_F16, ops.QUANTIZE_Q4_0_BF16)),
                            ("q8_0", (ops.QUANTIZE_Q8_0, ops.QUANTIZE_Q8_0_F16, ops.QUANTIZE_Q8_0_BF16)))
      for op, suffix, what in zip(variants, ("", "_f16", "_bf16"), ("float32", "float16", "bfloat16"))],
    KernelSpec("w4a16.naive", ops.W4A16, 3, "w4a16/naive.cu", "w4a16_naive", _thread_per_output,
               "Q4_0 weights x float32 activations, one thread per output, unpacked on the fly"),
    KernelSpec("w4a16.tiled", ops.W4A16, 3, "w4a16/tiled.cu", "w4a16_tiled", _tile_64x64,
               "Q4_0 weights x float32 activations, W tile dequantized into shared memory"),
    KernelSpec("w8a16.naive", ops.W8A16, 3, "w8a16/naive.cu", "w8a16_naive", _thread_per_output,
               "Q8_0 weights x float32 activations, one thread per output"),
    KernelSpec("w8a16.tiled", ops.W8A16, 3, "w8a16/tiled.cu", "w8a16_tiled", _tile_64x64,
               "Q8_0 weights x float32 activations, W tile dequantized into shared memory"),
    KernelSpec("w4a8.naive", ops.W4A8, 4, "w4a8/naive.cu", "w4a8_naive", _thread_per_output,
               "Q8_1 x Q4_0, one thread per output, byte-by-byte sumi + d_w(d_a sumi - 8 s_a)"),
    KernelSpec("w4a8.tiled", ops.W4A8, 4, "w4a8/tiled.cu", "w4a8_tiled", _tile_16x16,
               "Q8_1 x Q4_0, 16x16 shared-memory tiles, byte-by-byte integer math"),
    KernelSpec("w4a8.dp4a", ops.W4A8, 4, "w4a8/dp4a.cu", "w4a8_dp4a", _warp_dot,
               "Q8_1 x Q4_0, DP4A on the stored nibbles, a warp per 4x4 outputs, coalesced loads"),
    KernelSpec("w4a8.tiled_dp4a", ops.W4A8, 4, "w4a8/tiled_dp4a.cu", "w4a8_tiled_dp4a", _tile_64x64,
               "Q8_1 x Q4_0, 64x64 shared-memory tiles, 4x4 outputs per thread, DP4A"),
    KernelSpec("w4a8.vec_dp4a", ops.W4A8, 4, "w4a8/vec_dp4a.cu", "w4a8_vec_dp4a", _tile_64x64,
               "tiled_dp4a + 16-byte vector loads of the Q8_1 activations, 4 blocks per stage"),
    KernelSpec("w8a8.naive", ops.W8A8, 4, "w8a8/naive.cu", "w8a8_naive", _thread_per_output,
               "Q8_1 x Q8_0, one thread per output, byte-by-byte sumi + d_w d_a sumi"),
    KernelSpec("w8a8.dp4a", ops.W8A8, 4, "w8a8/dp4a.cu", "w8a8_dp4a", _warp_dot,
               "Q8_1 x Q8_0, DP4A, a warp per 4x4 outputs, coalesced loads"),
    KernelSpec("w8a8.tiled_dp4a", ops.W8A8, 4, "w8a8/tiled_dp4a.cu", "w8a8_tiled_dp4a", _tile_64x64,
               "Q8_1 x Q8_0, 64x64 shared-memory tiles, 4x4 outputs per thread, DP4A"),
    KernelSpec("w4a8.mma", ops.W4A8, 6, "w4a8/mma.cu", "w4a8_mma", _mma_geometry("q4_0"),
               "production: Q8_1 x Q4_0 on int8 tensor cores (mma.sync m16n8k32), cp.async stages, split-K",
               min_arch=80, config=_mma_config, candidates=_mma_candidates, unit="imma"),
    KernelSpec("w8a8.mma", ops.W8A8, 6, "w8a8/mma.cu", "w8a8_mma", _mma_geometry("q8_0"),
               "production: Q8_1 x Q8_0 on int8 tensor cores (mma.sync m16n8k32), cp.async stages, split-K",
               min_arch=80, config=_mma_config, candidates=_mma_candidates, unit="imma"),
    KernelSpec("w4a16.mma", ops.W4A16H, 6, "w4a16/mma.cu", "w4a16_mma", _hf_geometry("q4_0"),
               "production: f16 activations x Q4_0 on fp16 tensor cores (mma.sync m16n8k16), scales folded into the dequant",
               min_arch=80, config=_hf_config, candidates=_hf_candidates, unit="hmma"),
    KernelSpec("w8a16.mma", ops.W8A16H, 6, "w8a16/mma.cu", "w8a16_mma", _hf_geometry("q8_0"),
               "production: f16 activations x Q8_0 on fp16 tensor cores (mma.sync m16n8k16), scales folded into the dequant",
               min_arch=80, config=_hf_config, candidates=_hf_candidates, unit="hmma"),
    KernelSpec("w4a16.skinny", ops.W4A16S, 6, "w4a16/skinny.cu", "w4a16_skinny", _skinny_geometry,
               "production decode / small batch (M <= 64): f32 x Q4_0 (repacked once, 16-byte loads) on fp16 tensor "
               "cores, tokens on the MMA's N side", min_arch=80, config=_skinny_config("q4_0"),
               candidates=_skinny_candidates("q4_0"), max_m=SKINNY_MAX_M, weight_layout="skinny", pdl=True,
               helpers=_SKINNY_HELPERS),
    KernelSpec("w8a16.skinny", ops.W8A16S, 6, "w8a16/skinny.cu", "w8a16_skinny", _skinny_geometry,
               "production decode / small batch (M <= 64): f32 x Q8_0 (repacked once, 16-byte loads) on fp16 tensor "
               "cores, tokens on the MMA's N side", min_arch=80, config=_skinny_config("q8_0"),
               candidates=_skinny_candidates("q8_0"), max_m=SKINNY_MAX_M, weight_layout="skinny", pdl=True,
               helpers=_SKINNY_HELPERS),
    KernelSpec("w4a8.skinny", ops.W4A8S, 6, "w4a8/skinny.cu", "w4a8_skinny", _skinny_geometry,
               "production decode (M <= 8): f32 activations quantized to int8 by the kernel x Q4_0 (repacked once) "
               "on int8 tensor cores, tokens on the MMA's N side, the -8 compensated in integers", min_arch=80,
               config=_skinny_i8_config("q4_0"), candidates=_skinny_i8_candidates("q4_0"), max_m=SKINNY_I8_MAX_M,
               unit="imma", weight_layout="skinny", pdl=True, helpers=_SKINNY_HELPERS),
    KernelSpec("w8a8.skinny", ops.W8A8S, 6, "w8a8/skinny.cu", "w8a8_skinny", _skinny_geometry,
               "production decode (M <= 8): f32 activations quantized to int8 by the kernel x Q8_0 (repacked once) "
               "on int8 tensor cores, tokens on the MMA's N side, the weight words as the A fragments", min_arch=80,
               config=_skinny_i8_config("q8_0"), candidates=_skinny_i8_candidates("q8_0"), max_m=SKINNY_I8_MAX_M,
               unit="imma", weight_layout="skinny", pdl=True, helpers=_SKINNY_HELPERS),
    KernelSpec("w4a8.skinny_q8_1", ops.W4A8, 6, "w4a8/skinny_q8_1.cu", "w4a8_skinny_q8_1", _skinny_geometry,
               "production small batch (M <= 32): Q8_1 activations (quantize.q8_1, once per op) x Q4_0 (repacked "
               "once) on int8 tensor cores, up to 8 tokens per MMA on its N side, llama.cpp's per-block math",
               min_arch=80, config=_skinny_q8_1_config("q4_0"), candidates=_skinny_q8_1_candidates("q4_0"),
               max_m=SKINNY_Q8_1_MAX_M, unit="imma", weight_layout="skinny", pdl=True, helpers=_SKINNY_HELPERS),
    KernelSpec("w8a8.skinny_q8_1", ops.W8A8, 6, "w8a8/skinny_q8_1.cu", "w8a8_skinny_q8_1", _skinny_geometry,
               "production small batch (M <= 32): Q8_1 activations (quantize.q8_1, once per op) x Q8_0 (repacked "
               "once) on int8 tensor cores, up to 8 tokens per MMA on its N side, the weight words as the A fragments",
               min_arch=80, config=_skinny_q8_1_config("q8_0"), candidates=_skinny_q8_1_candidates("q8_0"),
               max_m=SKINNY_Q8_1_MAX_M, unit="imma", weight_layout="skinny", pdl=True, helpers=_SKINNY_HELPERS),
    KernelSpec("w4a16.wgmma", ops.W4A16H, 6, "w4a16/wgmma.cu", "w4a16_wgmma", _wgmma_geometry,
               "production prefill on Hopper: f16 x Q4_0 (repacked once) through asynchronous wgmma, dequantized into "
               "swizzled shared memory while the previous stage multiplies", min_arch=90, arch_suffix="a",
               config=_wgmma_config, candidates=_wgmma_candidates, unit="hmma", weight_layout="skinny"),
    KernelSpec("w8a16.wgmma", ops.W8A16H, 6, "w8a16/wgmma.cu", "w8a16_wgmma", _wgmma_geometry,
               "production prefill on Hopper: f16 x Q8_0 (repacked once) through asynchronous wgmma, dequantized into "
               "swizzled shared memory while the previous stage multiplies", min_arch=90, arch_suffix="a",
               config=_wgmma_config, candidates=_wgmma_candidates, unit="hmma", weight_layout="skinny"),
    KernelSpec("w4a16.wgmma_rs", ops.W4A16H, 6, "w4a16/wgmma_rs.cu", "w4a16_wgmma_rs", _rs_geometry("q4_0"),
               "production prefill on Hopper: f16 x Q4_0 (repacked once) through wgmma with the weights dequantized "
               "into registers as the A operand (no shared-memory round trip), activations (kperm16 layout) as the swizzled B "
               "operand",
               min_arch=90, arch_suffix="a", config=_rs_config("q4_0"), candidates=_rs_candidates("q4_0"), unit="hmma",
               weight_layout="skinny", act_layout="kperm16", pdl=True),
    KernelSpec("w8a16.wgmma_rs", ops.W8A16H, 6, "w8a16/wgmma_rs.cu", "w8a16_wgmma_rs", _rs_geometry("q8_0"),
               "production prefill on Hopper: f16 x Q8_0 (repacked once) through wgmma with the weights dequantized "
               "into registers as the A operand (no shared-memory round trip), activations (kperm16 layout) as the swizzled B "
               "operand",
               min_arch=90, arch_suffix="a", config=_rs_config("q8_0"), candidates=_rs_candidates("q8_0"), unit="hmma",
               weight_layout="skinny", act_layout="kperm16", pdl=True),
    KernelSpec("w4a8.gemv", ops.W4A8, 6, "w4a8/gemv.cu", "w4a8_gemv", _gemv_geometry,
               "production decode (M <= 8): Q8_1 x Q4_0, each weight row streamed once by one warp",
               config=_gemv_config, candidates=_gemv_candidates, max_m=8, pdl=True),
    KernelSpec("w8a8.gemv", ops.W8A8, 6, "w8a8/gemv.cu", "w8a8_gemv", _gemv_geometry,
               "production decode (M <= 8): Q8_1 x Q8_0, each weight row streamed once by one warp",
               config=_gemv_config, candidates=_gemv_candidates, max_m=8, pdl=True),
]


# ---- Mustafar: attention on a bitmap-sparse fp16 / 4-bit / 2-bit KV cache (qgemm/kvcache.py) ----
def _mustafar_geometry(b: int, s: int, d: int) -> Launch:
    """(B, S, D) with groups=4, Lq=1 (the launch itself is planned by qgemm.kvcache.plan_for)."""
    from . import kvcache

    p = kvcache.plan_for("key", 16, (b, s, d if d in kvcache.HEAD_DIMS else 128), 4)
    return Launch(grid=p.grid, block=p.block, shmem=p.shmem)


def _mustafar_specs() -> list:
    from . import kvcache

    layouts = {"fp16": (16, False, "fp16 non-zeros (cumulative counts + packed values)"),
               "q4": (4, False, "4-bit codes, float32 scale/zero and int32 offsets per tile"),
               "q2": (2, False, "2-bit codes, float32 scale/zero and int32 offsets per tile"),
               "q4c": (4, True, "4-bit codes, compact metadata (fp16 dequant constants, one offset per 16 tiles)"),
               "q2c": (2, True, "2-bit codes, compact metadata (fp16 dequant constants, one offset per 16 tiles)")}
    out = []
    for kind, op, what in (("key", ops.MUSTAFAR_KEY, "scores q.K^T"), ("value", ops.MUSTAFAR_VALUE, "output p.V")):
        for lay, (bits, compact, desc) in layouts.items():
            out.append(KernelSpec(f"mustafar.{kind}_{lay}", op, 7, f"mustafar/{kind}_{lay}.cu", f"mustafar_{kind}_{lay}",
                                  _mustafar_geometry, f"{what} on a bitmap-sparse KV cache: {desc}",
                                  defines={"MF_R": 4, "MF_D": 128, "MF_WARPS": 8} | ({"MF_REP": 16} if kind == "key" else {}),
                                  runner=kvcache.MustafarRunner(kind, bits, compact), pdl=True,
                                  helpers=(kvcache.ZERO_ENTRY,) if kind == "value" else ()))
    return out


def _skinny_x_variants() -> list:
    """_SPECS with, after each skinny decode kernel, its variants reading float16 / bfloat16
    activations themselves: the float32 kernel's source with SK_X (common/skinny_common.cuh), named
    `<name>_f16` and `<name>_bf16`, so a half-precision model's decode step needs no conversion
    kernel before the GEMM."""
    variant_ops = {"w4a16.skinny": (ops.W4A16S_F16, ops.W4A16S_BF16), "w8a16.skinny": (ops.W8A16S_F16, ops.W8A16S_BF16),
                   "w4a8.skinny": (ops.W4A8S_F16, ops.W4A8S_BF16), "w8a8.skinny": (ops.W8A8S_F16, ops.W8A8S_BF16)}
    out = []
    for s in _SPECS:
        out.append(s)
        for suffix, op, sk_x, what in zip(("_f16", "_bf16"), variant_ops.get(s.name, ()), (1, 2), ("float16", "bfloat16")):
            out.append(replace(s, name=s.name + suffix, op=op, defines=dict(s.defines, SK_X=sk_x),
                               description=s.description.replace("f32", what, 1),
                               config=_x16_config(s.name, s.config)))
    return out


def _x16_config(base: str, config):
    """The default configuration of a 16-bit-activation variant: its float32 kernel's, but where
    the variant measured faster with another (kernel alone, alternating rounds; chosen in session
    41 on an H200 and an H100 among `qgemm tune --dry-run`'s candidates, and measured again on an
    H100 in session 42, with the 16-bit types' plain loads, by `QGEMM_CHECK=xtypes bash
    tools/gpu_check.sh`, i.e. `tools/probe_defines.py VARIANT SHAPE base f32cfg=@KERNEL`;
    docs/production.md has the table). Variant's / float32's configuration, float16 x, µs:
    - w4a16.skinny_* at 9-16 tokens without the K split: two weight groups in flight and one
      accumulator set instead of one group and two sets -- 9x4096x4096 6.6 / 7.6, 12x 7.5 / 8.5,
      16x 6.9 / 8.1 (bfloat16: level at 9 tokens, 1.5-4% faster at 12 and 16; float32's kernel:
      level); with the K split (K >= 8192) 29.6 / 22.6 (session 41), so not there.
    - w4a8.skinny_* at one token: two 16-row tiles per CTA, 16 warps, one group in flight and the
      first two requested before the wait -- 1x4096x4096 3.4 / 3.6, 1x4096x14336 8.4-8.5 /
      9.3-9.4, bfloat16 alike (the float32 kernel with it: 3.44 -> 3.60, slower).
    - w8a16.skinny_* at two tokens below K = 8192: the activations staged in shared memory, one
      group in flight, one accumulator set -- 2x4096x4096 5.1-5.2 / 5.7 (bfloat16 5.1-5.2 / 5.9;
      at 4 tokens 6.52 / 6.07, so not there; the float32 kernel with it: 6.2 against 5.9, slower).
      Cold (weights from DRAM) this one costs 1-4% (8.4 / 8.1); the other two hold cold too.
    Q4_0's variants at 2-8 tokens: float32's configuration is the fastest candidate (session 41,
    with the `__ldg` loads of then; at 8 tokens again in session 43, with plain loads in both:
    `QGEMM_CHECK=tune-dry`, 180 candidates).
    With the K split that narrow weights take (`_skinny_fill_split`; H100, session 51, float16 x,
    kernel alone, hot / weights cold, this choice against the others):
    - the first one holds below K = 8192 whatever the split: 9x2048x4096 4.64 / 5.09 us against
      5.84 / 6.14 without it, 12x1024x4096 3.24 / 3.42 against 3.61 / 3.98 (16x1024x4096 3.52 /
      3.73 against 3.42 / 3.54).
    - the second only without a split: 2x1024x4096 cold 4.09 with it against 3.33 (hot 3.23 /
      3.33), 2x512x4096 2.89 / 2.72.
    - the third keeps float32's split only from K = 8192 (1x1024x14336 3.80 against 7.03 without);
      below, its 16 warps take no split (1x1024x4096 2.37 against 2.41 at float32's 4, 1x512x4096
      2.38 against 2.71 at 8).
    On wide weights (session 57, H100, float16 x, kernel alone, hot / weights cold, against the
    choices above; float16 x had been slower than float32 x there, whole op):
    - the first only where its grid fits one wave: two groups in flight take 174 registers, one
      8-warp CTA per SM, so a grid past the SMs runs in waves; beyond them float32's configuration
      (one group, one set: 126 registers, two CTAs per SM): 16x6144x4096 12.41 / 13.64 -> 9.23 /
      9.94 us, 9x6144x4096 11.94 / 13.12 -> 8.27 / 8.83, 12x14336x4096 22.15 / 23.98 -> 16.76 /
      17.73, 16x18944x3584 27.55 / 27.53 -> 24.27 / 24.39 (16x4096x4096, 128 CTAs, keeps it: 7.13
      against 8.31).
    - the third where its 16-warp grid (98 registers, one CTA per SM) takes more than 1.25 waves:
      two tiles x 8 warps, two CTAs per SM (`_I8_Q4_0_ONE_TOKEN_WIDE`): 1x6144x4096 6.06 / 6.88
      -> 4.46 / 6.01, 1x8192x4096 6.87 / 7.79 -> 5.26 / 6.70, 1x14336x4096 13.96 / 13.86 -> 11.91
      / 11.89, 1x16384x4096 15.27 / 15.16 -> 12.64 / 12.63, 1x8192x8192 12.48 / 13.24 -> 10.98 /
      12.28, 1x28672x4096 24.24 / 24.10 -> 23.52 / 23.78; at 1.03-1.21 waves hot faster but cold
      up to 3.5% slower (1x4608x4096 5.18 / 5.50 -> 4.23 / 5.69, 1x5120x4096 5.56 / 5.77 -> 4.31
      / 5.97), so not there. float32's four 4-warp CTAs per SM, which that kernel takes there,
      measured slower than this on float16 x (1x6144x4096 5.56 / 6.24, 1x14336x4096 13.00 /
      12.69), and this one on float32 x 0.94-1.06 of that kernel's own cold: float32 keeps its
      own."""
    def x16(m: int, n: int, k: int, sm_count: int) -> dict:
        d = config(m, n, k, sm_count)
        if (base == "w4a16.skinny" and d["SK_MT"] == 2 and (d["SK_GSPLIT"] == 1 or k < 8192) and d["SK_UNROLL"] == 1
                and cdiv(cdiv(n, 16), d["SK_R"]) * d["SK_GSPLIT"] <= sm_count):
            alt = {**d, "SK_UNROLL": 2, "SK_ACC": 1}
            return alt if _skinny_ok(alt, "q4_0", m, k) else d
        if (base == "w8a16.skinny" and d["SK_R"] == 1 and d["SK_GSPLIT"] == 1
                and _skinny_q8_lighter_in_waves(m, cdiv(n, 16), k, sm_count)):
            return {**d, "SK_UNROLL": 2, "SK_ACC": 2}  # float32 x's lighter CTA is slower here
        if base == "w8a16.skinny" and m == 2 and k < 8192 and d["SK_GSPLIT"] == 1 and d["SK_R"] == 1:
            # (measured at K = 4096 only; not on the two-tile CTAs of `_skinny_one_wave_tiles`: session
            # 58, 2x14336x4096 whole op, float16 x, 22.60 us with one tile staged, 23.46 with two tiles
            # staged, 21.18 with two tiles not staged. Its one-tile 4-warp CTA gives way to this one's
            # 8 warps: session 59, whole op, float16 x, 2x6912x4096 9.58-9.72 us staged against 9.74 /
            # 10.06-10.19 for the 4-warp CTA, though 2x8192x4096 11.94-12.29 against 11.00)
            alt = {**d, "SK_XSMEM": 1, "SK_UNROLL": 1, "SK_ACC": 1, "SK_WARPS": 8}
            return alt if _skinny_ok(alt, "q8_0", m, k) else d
        if base == "w4a8.skinny" and m == 1:
            wide = 4 * cdiv(cdiv(n, 16), 2) > 5 * sm_count
            alt = {**d, **(_I8_Q4_0_ONE_TOKEN_WIDE if wide else _I8_Q4_0_ONE_TOKEN_TWO_TILES),
                   "SK_GSPLIT": d["SK_GSPLIT"] if k >= 8192 else 1}
            return alt if _skinny_i8_ok(alt, "q4_0", m, k) else d
        return d
    return x16


_SPECS = _skinny_x_variants()
_SPECS += _mustafar_specs()


def _check_specs(specs: list) -> dict[str, KernelSpec]:
    """The registry by name; RegistryError naming every bad entry -- a name that is not
    "family.variant" (lower case, digits, _), a name registered twice (a plain assert said only
    "duplicate kernel names", and nothing at all under python -O, where the later entry replaced
    the earlier one), a source not under a family directory of cuda_src/ or not a .cu file."""
    bad = [f"{s.name!r}: a kernel name is 'family.variant' in lower case, digits and _ (e.g. 'w4a8.naive')"
           for s in specs if not re.fullmatch(r"[a-z0-9_]+\.[a-z0-9_]+", s.name)]
    bad += [f"{name!r} is registered {n} times (sources: "
            f"{', '.join(s.source for s in specs if s.name == name)}); each kernel needs its own name"
            for name, n in Counter(s.name for s in specs).items() if n > 1]
    bad += [f"{s.name!r}: source {s.source!r} is not a path 'family/file.cu' under cuda_src/"
            for s in specs if not re.fullmatch(r"[A-Za-z0-9_]+/[A-Za-z0-9_.]+\.cu", s.source)]
    if bad:
        raise RegistryError("qgemm/registry.py: " + "; ".join(bad))
    return {s.name: s for s in specs}


REGISTRY: dict[str, KernelSpec] = _check_specs(_SPECS)

_kernels: dict[str, ops.Kernel] = {}
_kernels_lock = threading.Lock()


def names() -> list[str]:
    return list(REGISTRY)


def spec(name: str) -> KernelSpec:
    """The registry entry of kernel `name` (e.g. "w4a8.mma"). UnknownNameError (a KeyError and a
    ValueError) naming the closest names if there is no such kernel."""
    if not isinstance(name, str):
        raise UnknownNameError(f"a kernel name is a string such as 'w4a8.mma' (qgemm list shows all {len(REGISTRY)}), "
                               f"got {name!r}")
    try:
        return REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name.lower(), REGISTRY, n=3, cutoff=0.4)  # (the names are lower case)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UnknownNameError(f"no kernel named {name!r}{hint} (qgemm list shows all {len(REGISTRY)})"
                               + _unregistered_source(name)) from None


def get(name: str) -> ops.Kernel:
    """The callable kernel `name` (memoized: a second get() returns the same object, no I/O).
    UnknownNameError (a KeyError and a ValueError) naming the closest names if there is none."""
    if not isinstance(name, str):
        spec(name)  # the same error as for an unknown name, not the cache's "unhashable type"
    k = _kernels.get(name)
    if k is None:
        s = spec(name)
        with _kernels_lock:
            k = _kernels.setdefault(name, ops.Kernel(s))
    return k


def _unregistered_source(name: str) -> str:
    """For an unknown kernel or family name: the source file or family directory under cuda_src/
    that it would be, when that exists but no KernelSpec registers it ("" otherwise)."""
    fam, _, variant = name.partition(".")
    try:
        root = jit.cuda_src_dir()
    except OSError:
        return ""
    if not re.fullmatch(r"[a-z0-9_]+", fam) or (variant and not re.fullmatch(r"[a-z0-9_]+", variant)):
        return ""
    if fam in ("common", "bench"):  # shared headers; the bench's read kernels, launched by qgemm.bench itself
        return ""
    if variant and (root / fam / f"{variant}.cu").is_file():
        return (f"; cuda_src/{fam}/{variant}.cu exists, but no KernelSpec in qgemm/registry.py's _SPECS "
                f"registers it (README.md, 'Adding a kernel')")
    if not variant and fam not in families() and sorted((root / fam).glob("*.cu")):
        return (f"; cuda_src/{fam}/ holds {', '.join(p.name for p in sorted((root / fam).glob('*.cu')))}, but no "
                f"KernelSpec in qgemm/registry.py's _SPECS names a kernel '{fam}.*' (README.md, 'Adding a kernel')")
    return ""


def families() -> list[str]:
    return sorted({s.family for s in REGISTRY.values()})


def list_kernels(family: str | None = None, op: str | None = None) -> list[KernelSpec]:
    """The registered kernels, optionally of one family (ValueError naming the families if it
    has none) or one op."""
    out = list(REGISTRY.values())
    if family is not None:
        if family not in families():
            raise UnknownNameError(f"no kernel family {family!r}; the families: {', '.join(families())}"
                                   + _unregistered_source(family))
        out = [s for s in out if s.family == family]
    if op:
        out = [s for s in out if s.op.name == op]
    return out


def resolve(names_or_all: list[str] | None, all_: bool) -> list[KernelSpec]:
    """CLI helper: explicit names (or family names like 'w4a16') or --all."""
    if all_:
        if names_or_all:
            raise ValueError(f"pass kernel names or --all, not both (got --all and {' '.join(names_or_all)})")
        return list(REGISTRY.values())
    if not names_or_all:
        raise ValueError("name at least one kernel, or pass --all")
    out: list[KernelSpec] = []
    for n in names_or_all:
        fam = list_kernels(family=n) if n in families() else []
        out.extend(fam if fam and n not in REGISTRY else [spec(n)])
    return out
