"""GGUF files in: list a model's tensors and load its weights as qgemm operands, through a
memory map (nothing is read until it is used).

    import qgemm
    from qgemm import gguf_io

    for t in gguf_io.list_tensors("model.gguf"):          # name, ggml type, shape [N, K], bytes
        print(t.name, t.type, t.shape, t.nbytes)
    w = qgemm.load_gguf("model.gguf", "blk.0.ffn_down.weight")   # Q4_0 -> block_q4_0 [N, K/32]
    n, k, fmt = gguf_io.weight_shape("model.gguf", "blk.0.ffn_down.weight")   # (N, K, "q4_0")

Shape convention. ggml lists a tensor's dimensions innermost first: ne[0] is the row length, the
reduction dimension K of a weight matrix, and ne[1] the number of rows N. The `gguf` package keeps
that order in `GGUFReader.tensors[i].shape` (so a 4096 x 14336 ffn_down weight reads [14336, 4096]),
while `GGUFReader.tensors[i].data.shape` is numpy order (rows first) and, for quantized types,
counts the last axis in *bytes* ([4096, 14336/32*18] for Q4_0). qgemm uses numpy order in values:
`TensorInfo.shape` is (..., N, K) = reversed(ne), the convention of C[M,N] = A[M,K] . W[N,K]^T.

What loads: Q4_0 and Q8_0 as qgemm's block dtypes (`qgemm.block_q4_0` / `block_q8_0`,
[N, K/32], the bytes ggml wrote, untouched), F16 and F32 as plain [N, K] arrays. All are read-only
views of the file's memory map: no copy, and pages come from disk only when something touches
them. Other ggml types (K-quants, Q5_0, BF16, ...) raise ValueError naming the type.

Bad files: anything that is not a complete, well-formed GGUF file (wrong magic, truncated header
or tensor data, impossible counts or lengths, an unknown ggml type) raises ValueError naming the
file and what is wrong. The header is checked with bounds on every read before `gguf.GGUFReader`
parses it (the reader trusts the lengths it reads and can spin on a corrupt one).
"""

from __future__ import annotations

import difflib
import hashlib
import mmap
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import formats as F
from .errors import UnknownNameError

# ggml type name -> qgemm format name, for the types qgemm loads
SUPPORTED = {"Q4_0": "q4_0", "Q8_0": "q8_0", "F16": "f16", "F32": "f32"}
_SUPPORTED_TEXT = "Q4_0, Q8_0 (as qgemm blocks [N, K/32]) and F16, F32 (as [N, K] arrays)"

GGUF_MAGIC = b"GGUF"
GGML_MAX_DIMS = 4


def _gguf():
    try:
        import gguf
    except ImportError as e:  # gguf is an optional dependency (the `test` extra)
        raise ImportError("reading GGUF files needs the `gguf` package: python -m pip install gguf") from e
    return gguf


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file. `shape` is qgemm's (numpy) order, (..., N, K) = reversed(ne)."""

    name: str
    type: str  # ggml type name: "Q4_0", "Q8_0", "F16", "Q4_K", ...
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute byte offset of the tensor's data in the file

    @property
    def ne(self) -> tuple[int, ...]:
        """ggml's order: ne[0] = K (row length) first."""
        return tuple(reversed(self.shape))

    @property
    def fmt(self) -> str | None:
        """qgemm's format name ("q4_0", "q8_0", "f16", "f32"), or None if qgemm cannot load it."""
        return SUPPORTED.get(self.type)

    @property
    def supported(self) -> bool:
        """Whether qgemm loads this ggml type (Q4_0, Q8_0, F16, F32)."""
        return self.type in SUPPORTED

    @property
    def shape_str(self) -> str:
        """The shape for listings: "N x K"."""
        return " x ".join(str(d) for d in self.shape)

    def loads_as(self) -> str:
        """How load_gguf returns it, in words (for listings)."""
        f = self.fmt
        if f is None:
            return "unsupported"
        if F.get_format(f).quantized:
            return f"{f} blocks [{', '.join(map(str, self.shape[:-1] + (self.shape[-1] // F.QK,)))}]"
        return f"{np.dtype(F.get_format(f).dtype).name} [{', '.join(map(str, self.shape))}]"


# ---------------------------------------------------------------------------------------------
# the bounds-checked header scan


class _Cursor:
    """Little-endian reads from a buffer, each checked against its end."""

    def __init__(self, buf, size: int, path: str):
        self.buf, self.size, self.pos, self.path = buf, size, 0, path

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: not a valid GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, but the file ends at byte {self.size} "
                            "(truncated or corrupt)")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, what: str) -> str:
        n = self.unpack("Q", f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {self.pos - n} is not UTF-8: {raw[:40]!r}") from None


# GGUF metadata value types: id -> (struct code or None, name)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _skip_value(c: _Cursor, vtype: int, key: str, depth: int = 0) -> None:
    if vtype in _SCALARS:
        c.skip(struct.calcsize(_SCALARS[vtype]), f"the value of {key!r}")
    elif vtype == _STRING:  # skipped, not decoded: a vocabulary holds 100k+ of them
        n = c.unpack("Q", f"the length of a string in {key!r}")
        c.skip(n, f"a string of {n} bytes in {key!r}")
    elif vtype == _ARRAY:
        if depth > 8:
            raise c.fail(f"metadata {key!r}: arrays nested more than 8 deep")
        itype = c.unpack("I", f"the item type of {key!r}")
        count = c.unpack("Q", f"the length of {key!r}")
        if itype in _SCALARS:
            c.skip(count * struct.calcsize(_SCALARS[itype]), f"the {count} items of {key!r}")
        elif itype in (_STRING, _ARRAY):
            # every string or array item takes at least 8 bytes: a bound before looping
            c.need(8 * count, f"the {count} items of {key!r}")
            for _ in range(count):
                _skip_value(c, itype, key, depth + 1)
        else:
            raise c.fail(f"metadata {key!r}: unknown array item type {itype}")
    else:
        raise c.fail(f"metadata {key!r}: unknown value type {vtype}")


def _scan(path: str) -> None:
    """Walk the header with a bound on every read; ValueError on anything a GGUFReader would
    misread, crash on, or loop over. Touches the header's pages only, not the tensor data."""
    size = os.path.getsize(path)  # a missing file is named before a missing package
    gguf = _gguf()
    if size == 0:
        raise ValueError(f"{path}: not a GGUF file: the file is empty")
    with open(path, "rb") as fh:
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf, size, path)
            c.need(4, "the magic")
            if bytes(buf[:4]) != GGUF_MAGIC:
                raise ValueError(f"{path}: not a GGUF file: it starts with {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r}")
            c.pos = 4
            version = c.unpack("I", "the version")
            if version & 0xFFFF == 0 and version:
                raise ValueError(f"{path}: a big-endian GGUF file; qgemm reads little-endian GGUF only")
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version} is not supported (expected 2 or 3)")
            n_tensors = c.unpack("Q", "the tensor count")
            n_kv = c.unpack("Q", "the metadata count")
            # a metadata entry takes at least 13 bytes, a tensor entry at least 24
            if n_kv * 13 + n_tensors * 24 > size - c.pos:
                raise c.fail(f"the header claims {n_kv} metadata entries and {n_tensors} tensors, "
                             f"more than the file's {size} bytes can hold")
            alignment = 32
            for i in range(n_kv):
                key = c.string(f"metadata key #{i}")
                vtype = c.unpack("I", f"the type of {key!r}")
                start = c.pos
                _skip_value(c, vtype, key)
                if key == "general.alignment":
                    if vtype != 4:
                        raise c.fail(f"general.alignment must be a uint32 (type 4), got type {vtype}")
                    alignment = struct.unpack_from("<I", buf, start)[0]
                    if alignment == 0 or alignment & (alignment - 1):
                        raise c.fail(f"general.alignment must be a power of two, got {alignment}")
            tensors = []
            for i in range(n_tensors):
                name = c.string(f"the name of tensor #{i}")
                n_dims = c.unpack("I", f"the dimension count of {name!r}")
                if n_dims > GGML_MAX_DIMS:
                    raise c.fail(f"tensor {name!r} has {n_dims} dimensions; ggml allows at most {GGML_MAX_DIMS}")
                ne = [c.unpack("Q", f"the dimensions of {name!r}") for _ in range(n_dims)]
                raw_type = c.unpack("I", f"the type of {name!r}")
                offset = c.unpack("Q", f"the data offset of {name!r}")
                tensors.append((name, ne, raw_type, offset))
            data_start = -(-c.pos // alignment) * alignment
    for name, ne, raw_type, offset in tensors:
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has ggml type id {raw_type}, which the installed gguf package "
                             f"({_gguf_version()}) does not know: corrupt, or a newer ggml type") from None
        if qtype not in gguf.GGML_QUANT_SIZES:
            raise ValueError(f"{path}: tensor {name!r} has ggml type {qtype.name}, whose block size the installed "
                             "gguf package does not know")
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        k = ne[0] if ne else 1
        if block > 1 and k % block:
            shape = " x ".join(map(str, reversed(ne)))
            raise ValueError(f"{path}: tensor {name!r} is {qtype.name} [{shape}] with K (ne[0], the row length) = {k}, "
                             f"which is not a multiple of the {qtype.name} block size {block}: the file is corrupt")
        if offset % alignment:  # ggml rejects such files: the data would be read from the wrong bytes
            raise ValueError(f"{path}: tensor {name!r} has data offset {offset}, not a multiple of the file's alignment "
                             f"({alignment}): the file is corrupt")
        n_elem = 1
        for d in ne:
            n_elem *= d
        nbytes = n_elem // block * type_size
        end = data_start + offset + nbytes
        if end > size:
            raise ValueError(f"{path}: truncated: tensor {name!r} ({qtype.name}, {nbytes} bytes) ends at byte {end}, "
                             f"but the file has {size} bytes")


def _gguf_version() -> str:
    """The installed gguf package's version (it has no __version__ attribute)."""
    try:
        from importlib.metadata import version

        return "gguf " + version("gguf")
    except Exception:
        return "gguf, version unknown"


# ---------------------------------------------------------------------------------------------
# files


class GGUFFile:
    """An opened GGUF file: its tensors (TensorInfo) and metadata; `load(name)` maps one tensor.

    Opening checks the header and parses it with `gguf.GGUFReader` (memory-mapped, read-only);
    no tensor data is read. Keep one GGUFFile to load many tensors without re-parsing."""

    def __init__(self, path: str | os.PathLike):
        self.path = _path_str(path)
        if Path(self.path).is_dir():
            raise IsADirectoryError(f"{self.path}: is a directory, expected a .gguf file")
        _scan(self.path)  # FileNotFoundError / PermissionError pass through as OSError
        gguf = _gguf()
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # anything the reader trips on is a bad file, said with its name
            raise ValueError(f"{self.path}: not a readable GGUF file: {type(e).__name__}: {e}") from e
        self.version = int(self.reader.fields["GGUF.version"].parts[-1][0])
        self.tensors: list[TensorInfo] = [
            TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.n_bytes),
                       int(t.data_offset))
            for t in self.reader.tensors
        ]
        self._by_name = {t.name: i for i, t in enumerate(self.tensors)}

    def __repr__(self) -> str:
        return f"<GGUFFile {self.path}: GGUF v{self.version}, {len(self.tensors)} tensors, {len(self.metadata_keys)} metadata keys>"

    # -- metadata ------------------------------------------------------------------------------
    @property
    def metadata_keys(self) -> list[str]:
        """The file's metadata keys (without the reader's GGUF.version/tensor_count/kv_count)."""
        return [k for k in self.reader.fields if not k.startswith("GGUF.")]

    def metadata(self, key: str, default=None):
        """One metadata value as a Python object (str, int, float, bool or a list)."""
        field = self.reader.get_field(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:  # e.g. a string that is not UTF-8
            raise ValueError(f"{self.path}: metadata {key!r} cannot be read: {type(e).__name__}: {e}") from e

    # -- tensors -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The tensors' names, in file order."""
        return [t.name for t in self.tensors]

    def info(self, name: str) -> TensorInfo:
        """The TensorInfo of tensor `name`; UnknownNameError (a KeyError and a ValueError) naming
        close names if the file has none."""
        if not isinstance(name, str):
            raise UnknownNameError(f"{self.path}: a tensor name is a string (`qgemm gguf {self.path}` lists them), got {name!r}")
        i = self._by_name.get(name)
        if i is None:
            names = self.names()
            close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
            close += [n for n in names if name and name in n and n not in close][: 5 - len(close)]
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UnknownNameError(f"{self.path}: no tensor named {name!r}{hint} ({len(names)} tensors; "
                           f"`qgemm gguf {self.path}` lists them)")
        return self.tensors[i]

    def _require_supported(self, t: TensorInfo) -> str:
        if t.fmt is None:
            raise ValueError(f"{self.path}: tensor {t.name!r} is {t.type} [{t.shape_str}], which qgemm cannot load; "
                             f"supported ggml types: {_SUPPORTED_TEXT}. Quantize the model to Q4_0 or Q8_0 with "
                             "llama.cpp, from its F16 / BF16 / F32 GGUF: `llama-quantize --pure MODEL-F16.gguf "
                             "OUT.gguf Q4_0` (--pure: every tensor, not only most; an already quantized file also "
                             "needs --allow-requantize, at some cost in quality)")
        return t.fmt

    def load(self, name: str) -> np.ndarray:
        """The tensor as qgemm operands, a read-only view of the memory map (no copy):
        Q4_0 -> block_q4_0 [..., N, K/32], Q8_0 -> block_q8_0 [..., N, K/32], F16/F32 -> [..., N, K]."""
        t = self.info(name)
        fmt = F.get_format(self._require_supported(t))
        data = np.asarray(self.reader.tensors[self._by_name[name]].data)  # ndarray view, base: the np.memmap
        if fmt.quantized:
            k = t.shape[-1]
            if k % F.QK:  # the header scan already refuses this; kept for a file edited under us
                raise ValueError(f"{self.path}: tensor {name!r} is {t.type} with K = {k}, not a multiple of {F.QK}")
            out = data.view(fmt.dtype)
            expected = t.shape[:-1] + (k // F.QK,)
        else:
            out = data if data.dtype == fmt.dtype else data.view(fmt.dtype)
            expected = t.shape
        if out.shape != expected:
            raise ValueError(f"{self.path}: tensor {name!r} maps to shape {out.shape}, expected {expected}")
        return out

    def weight_shape(self, name: str) -> tuple[int, int, str]:
        """(N, K, fmt) of a 2-D weight matrix W[N, K], fmt a qgemm format name ("q4_0", ...)."""
        t = self.info(name)
        fmt = self._require_supported(t)
        if len(t.shape) != 2:
            what = ("a vector" if len(t.shape) == 1 else "a scalar" if not t.shape
                    else f"{len(t.shape)}-D (stacked matrices: load it and index one)")
            raise ValueError(f"{self.path}: tensor {name!r} has shape [{t.shape_str}], {what}; expected a 2-D weight [N, K]")
        n, k = t.shape
        if n == 0 or k == 0:  # an empty GEMM would "pass" every check with nothing computed
            raise ValueError(f"{self.path}: tensor {name!r} has shape [{t.shape_str}], an empty matrix; expected a 2-D "
                             "weight [N, K] with N, K > 0")
        return n, k, fmt


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open (check and parse the header of) a GGUF file. Reuse it to load several tensors.
    The errors for a bad or missing file are load_gguf's."""
    return GGUFFile(path)


_CACHE: "OrderedDict[tuple, GGUFFile]" = OrderedDict()
_CACHE_SIZE = 4
_cache_lock = threading.Lock()


def _path_str(path) -> str:
    """A file path as str: str, os.PathLike or bytes (decoded as the OS does); a TypeError otherwise
    (str(None) would have looked for a file named 'None', str(b'x') for one named "b'x'")."""
    if isinstance(path, (str, bytes, os.PathLike)):
        p = os.fsdecode(path)
        if isinstance(p, str):
            return p
    raise TypeError(f"a GGUF path must be a str or os.PathLike, got {type(path).__name__}")


def _cached(path: str | os.PathLike) -> GGUFFile:
    """The functions below parse a file's header once while it stays the same file (same inode,
    size, mtime, ctime and first MiB: timestamps can be too coarse to see a quick rewrite): on a
    real model, GGUFReader's parse of the vocabulary takes seconds."""
    path = _path_str(path)
    p = os.path.realpath(path)
    try:
        st = os.stat(p)
        with open(p, "rb") as fh:
            head = hashlib.blake2b(fh.read(1 << 20), digest_size=16).digest()
        key = (p, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, head)
    except OSError:
        return GGUFFile(path)  # let GGUFFile raise the error with the name as given
    with _cache_lock:
        f = _CACHE.get(key)
        if f is not None:
            _CACHE.move_to_end(key)
            return f
    f = GGUFFile(path)
    with _cache_lock:
        _CACHE[key] = f
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return f


def list_tensors(path: str | os.PathLike) -> list[TensorInfo]:
    """Every tensor of a GGUF file: name, ggml type, shape (..., N, K), bytes, data offset."""
    return list(_cached(path).tensors)


def load_gguf(path: str | bytes | os.PathLike, name: str) -> np.ndarray:
    """One tensor of a GGUF file as qgemm weights, memory-mapped (read-only, no copy, on the host):
    Q4_0 -> qgemm.block_q4_0 [N, K/32], Q8_0 -> qgemm.block_q8_0 [N, K/32], F16/F32 -> [N, K]
    (a tensor of more dimensions keeps its leading ones: [..., N, K/32] blocks, [..., N, K]
    floats; `matmul` takes 2-D weights). For repeated matmuls, pass the blocks to
    `qgemm.pack_weights` once rather than to every call (host weights are uploaded each time).

    Raises UnknownNameError (a KeyError and a ValueError, naming close names) for a missing
    tensor, ValueError for another ggml type or a bad file, OSError (FileNotFoundError, ...) for a
    file that cannot be read, TypeError for a path that is not str, bytes or os.PathLike,
    ImportError without the `gguf` package. Loading many tensors: `f = qgemm.gguf_io.open_gguf(path)`
    then `f.load(name)`."""
    return _cached(path).load(name)


def weight_shape(path: str | os.PathLike, name: str) -> tuple[int, int, str]:
    """(N, K, fmt) of a 2-D weight tensor: N rows (output features), K the row length, fmt one of
    "q4_0", "q8_0", "f16", "f32". ValueError for other types and for tensors that are not 2-D."""
    return _cached(path).weight_shape(name)
