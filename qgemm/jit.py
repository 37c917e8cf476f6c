"""Run-time compilation: NVRTC straight to CUBIN, with an on-disk cache.

Why CUBIN and never PTX: PTX produced by a newer NVRTC is rejected by an older driver, while SASS
for the exact sm_XX loads on any driver of the same major version. So each kernel is compiled
for one concrete architecture (the detected GPU's, or one given with --arch).

Cache layout (one directory per key, under `cache_dir()/v1`):

    <key>/kernel.cubin   the SASS image
    <key>/source.cu      the kernel's own source, for humans reading the cache
    <key>/meta.json      kernel name, entry symbols, arch, options, NVRTC version, ptxas resource
                         report, cubin size and its sha256

The key hashes the kernel source, every project header it includes (by path relative to
cuda_src/, so a key is the same on every machine), the CUDA toolkit headers it includes
(cuda_fp16.h, cuda_bf16.h) with everything they pull in,
the options, the arch and the NVRTC version. An entry is trusted only if meta.json parses, names
this key and the cubin's sha256 matches; anything else is rebuilt. Entries are assembled in a
temporary directory beside the final one and renamed into place under a per-key lock (fcntl),
re-checking for the entry inside the lock, so parallel processes compile once and no reader ever
sees half an entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from .errors import CompileError, SetupError, UnsupportedArchError

CACHE_LAYOUT_VERSION = "v1"
BASE_OPTIONS = ("-std=c++17",)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_ERROR_LINE_RE = re.compile(r"^(?P<file>[^\s()]+)\((?P<line>\d+)\): (?:error|warning)", re.MULTILINE)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def verbose() -> bool:
    return env_flag("QGEMM_JIT_VERBOSE")


# ---------------------------------------------------------------------------------------------
# where things are


@lru_cache(maxsize=None)
def cuda_src_dir() -> Path:
    """The kernel sources: QGEMM_CUDA_SRC, else the copy in the wheel (qgemm/cuda_src), else the
    checkout's cuda_src/ beside qgemm/. The wheel's copy comes first: in an installed qgemm the
    directory beside the package is site-packages, where a cuda_src/ would be another package's."""
    env = os.environ.get("QGEMM_CUDA_SRC")
    if env:
        if not (Path(env) / "common").is_dir():
            raise SetupError(f"qgemm: QGEMM_CUDA_SRC={env!r} is not a kernel source tree (no common/ directory "
                                    "in it); unset it to use qgemm's own cuda_src/")
        return Path(env)
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda_src", here.parent / "cuda_src"):
        if (cand / "common").is_dir():
            return cand
    raise SetupError(f"qgemm: cannot find the cuda_src/ kernel sources (looked in and beside {here})")


@lru_cache(maxsize=None)
def cuda_header_dir() -> str:
    """Directory holding cuda_fp16.h: found by cuda.pathfinder (the nvidia-cuda-runtime wheel or a
    CUDA toolkit on the machine). The NVRTC wheel alone ships no cuda_fp16.h."""
    errors = []
    try:
        import cuda.pathfinder as pf

        # locate_* (cuda-pathfinder >= 1.3.4) returns an object with abs_path; find_* (older) a path
        find = getattr(pf, "locate_nvidia_header_directory", None) or pf.find_nvidia_header_directory
        loc = find("cudart")
        if loc is not None:
            path = getattr(loc, "abs_path", loc)
            if path and Path(path, "cuda_fp16.h").is_file():
                return str(path)
    except Exception as e:  # pathfinder absent or too old: fall through to CUDA_HOME
        errors.append(f"cuda.pathfinder: {e}")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and Path(root, "include", "cuda_fp16.h").is_file():
            return str(Path(root, "include"))
    if Path("/usr/local/cuda/include/cuda_fp16.h").is_file():
        return "/usr/local/cuda/include"
    raise SetupError(
        "qgemm: cannot find cuda_fp16.h, which every kernel includes. Install the CUDA runtime "
        "headers wheel (pip install 'nvidia-cuda-runtime>=13') or set CUDA_HOME to a CUDA toolkit. "
        + "; ".join(errors)
    )


def cache_dir() -> Path:
    env = os.environ.get("QGEMM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "qgemm"


# ---------------------------------------------------------------------------------------------
# NVRTC and architectures


class NVRTCNotFoundError(RuntimeError):
    pass


def _nvrtc_call(fn_name: str):
    try:
        from cuda.bindings import nvrtc

        return getattr(nvrtc, fn_name)()
    except Exception as e:
        raise NVRTCNotFoundError(
            f"NVRTC is not usable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            "Install it with: pip install 'nvidia-cuda-nvrtc>=13' (or put a CUDA toolkit's lib64 on the library path)"
        ) from None


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    err, major, minor = _nvrtc_call("nvrtcVersion")
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


# Shared memory one block may opt in to, by compute capability (CUDA's tables; a GPU reports its
# own, DeviceInfo.smem_per_block_optin): for planning for an architecture without its GPU.
_SMEM_OPTIN_KB = {75: 64, 80: 163, 86: 99, 87: 163, 88: 99, 89: 99, 90: 227, 100: 227, 103: 227, 110: 227, 120: 99, 121: 99}


def smem_per_block_optin(cc: int) -> int:
    return _SMEM_OPTIN_KB.get(int(cc), 99) * 1024


@lru_cache(maxsize=None)
def supported_archs() -> tuple[int, ...]:
    err, archs = _nvrtc_call("nvrtcGetSupportedArchs")
    if int(err) != 0:
        raise RuntimeError(f"nvrtcGetSupportedArchs failed: {err}")
    return tuple(int(a) for a in archs)


# a compute capability major.minor (the minor one digit: 9.0, 10.0, 12.1) or its digits run together
# (90, 100, 121: the last digit is the minor)
_ARCH_RE = re.compile(r"^(?:sm_?|compute_)?(?:(\d{1,2})\.(\d)|(\d{2,3}))([af]?)$")


def parse_arch(arch: str | int) -> tuple[int, str]:
    """'sm_90', '90', '9.0', 'sm_90a', 90, '10.0', 'sm_120' -> (90 / 100 / 120, 'a' or ''). ValueError
    (UnsupportedArchError) on anything else."""
    s = str(arch).strip().lower()
    m = _ARCH_RE.match(s)
    if not m:
        raise UnsupportedArchError(f"cannot parse architecture {arch!r}; expected e.g. sm_90, sm_90a, 90, 9.0 or 10.0")
    cc = int(m.group(1)) * 10 + int(m.group(2)) if m.group(1) is not None else int(m.group(3))
    return cc, m.group(4)


def normalize_arch(arch: str | int) -> str:
    cc, suffix = parse_arch(arch)
    return f"sm_{cc}{suffix}"


def check_arch_supported(arch: str) -> None:
    cc, suffix = parse_arch(arch)
    # arch-specific ("a") targets exist from sm_90, family-specific ("f") ones from sm_100
    first = {"a": 90, "f": 100}.get(suffix)
    if first is not None and cc < first:
        raise UnsupportedArchError(f"{arch}: there is no '{suffix}' variant of sm_{cc} (the '{suffix}' targets start at "
                                   f"sm_{first}); use sm_{cc}")
    archs = supported_archs()
    if cc not in archs:
        major, minor = nvrtc_version()
        newest = max(archs)
        if cc > newest:
            raise UnsupportedArchError(
                f"{arch} is newer than the installed NVRTC {major}.{minor} supports (newest: sm_{newest}); "
                f"upgrade NVRTC (pip install -U nvidia-cuda-nvrtc) to target it"
            )
        raise UnsupportedArchError(
            f"{arch} is not supported by the installed NVRTC {major}.{minor}; supported: "
            + ", ".join(f"sm_{a}" for a in archs)
        )


# ---------------------------------------------------------------------------------------------
# sources and keys


def read_source(rel: str) -> str:
    path = cuda_src_dir() / rel
    try:
        return path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"qgemm: kernel source {rel} does not exist in the kernel source tree {cuda_src_dir()}"
                                + (" (QGEMM_CUDA_SRC)" if os.environ.get("QGEMM_CUDA_SRC") else "")) from None


def project_headers(rel: str, text: str | None = None) -> dict[str, str]:
    """All project headers reached from cuda_src/<rel> through #include "..." (relative paths)."""
    seen: dict[str, str] = {}
    stack = [(rel, text if text is not None else read_source(rel))]
    root = cuda_src_dir()
    while stack:
        cur, body = stack.pop()
        for inc in _INCLUDE_RE.findall(body):
            # resolved like NVRTC does with -I cuda_src: relative to the includer, then to the root
            for cand in (Path(cur).parent / inc, Path(inc)):
                p = (root / cand).resolve()
                if p.is_file():
                    relp = p.relative_to(root.resolve()).as_posix()
                    if relp not in seen:
                        seen[relp] = p.read_text()
                        stack.append((relp, seen[relp]))
                    break
    return seen


_ANY_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)  # system headers: <...> too


def included_names(source: str, headers: dict[str, str]) -> tuple[str, ...]:
    """Every name a kernel's source and its project headers #include (<cuda_fp16.h>,
    <cuda_bf16.h>, "common/..."): the roots of system_header_digest (project headers are not in
    the toolkit's directory, so the walk skips them)."""
    names = set()
    for text in (source, *headers.values()):
        names.update(_ANY_INCLUDE_RE.findall(text))
    return tuple(sorted(names))


@lru_cache(maxsize=None)
def system_header_digest(roots: tuple[str, ...] = ("cuda_fp16.h", "cuda_fp16.hpp")) -> str:
    """Digest of the CUDA headers a kernel includes -- `roots` (cache_key passes the kernel's own
    #include names: cuda_fp16.h, cuda_bf16.h) and every header of that directory they pull in,
    transitively (vector_types.h, nv/target, ...): a toolkit update changes the key."""
    h = hashlib.sha256()
    hdir = Path(cuda_header_dir())
    todo, seen = list(roots), set()
    while todo:
        name = todo.pop()
        p = hdir / name
        if name in seen or not p.is_file():
            continue
        seen.add(name)
        text = p.read_bytes()
        h.update(name.encode() + b"\0" + text)
        todo.extend(_ANY_INCLUDE_RE.findall(text.decode("latin-1")))
    return h.hexdigest()


@lru_cache(maxsize=None)
def nvrtc_build() -> str:
    """What identifies the NVRTC library beyond nvrtcVersion's major.minor (a patch release
    changes the generated code): the nvidia-cuda-nvrtc wheel's version, or the loaded library's
    path, size and modification time."""
    try:
        from importlib.metadata import version

        return "wheel " + version("nvidia-cuda-nvrtc")
    except Exception:
        pass
    try:
        import cuda.pathfinder as pf

        path = pf.load_nvidia_dynamic_lib("nvrtc").abs_path
        st = os.stat(path)
        return f"{path} {st.st_size} {st.st_mtime_ns}"
    except Exception:
        return ""


def cache_key(source_rel: str, source: str, headers: dict[str, str], arch: str, options: list[str]) -> str:
    h = hashlib.sha256()
    parts = {
        "layout": CACHE_LAYOUT_VERSION,
        "source": source_rel,
        "arch": arch,
        "options": list(options),
        "nvrtc": list(nvrtc_version()),
        "nvrtc_build": nvrtc_build(),
        "system_headers": system_header_digest(included_names(source, headers)),
    }
    h.update(json.dumps(parts, sort_keys=True).encode())
    h.update(b"\0" + source.encode())
    for rel in sorted(headers):
        h.update(b"\0" + rel.encode() + b"\0" + headers[rel].encode())
    return h.hexdigest()[:40]


# ---------------------------------------------------------------------------------------------
# ptxas resource report


@dataclasses.dataclass
class Resources:
    registers: int = 0
    smem_static: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


def parse_ptxas_report(log: str) -> dict[str, Resources]:
    """Per-entry registers/smem/spills from NVRTC's log with --ptxas-options=-v."""
    out: dict[str, Resources] = {}
    cur: str | None = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            out.setdefault(cur, Resources())
            continue
        if cur is None:
            continue
        r = out[cur]
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            r.stack_frame, r.spill_stores, r.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            r.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            r.smem_static = int(s.group(1)) if s else 0
    return out


# ---------------------------------------------------------------------------------------------
# compile errors


def numbered_listing(log: str, files: dict[str, str], context: int = 2) -> str:
    """Source lines (numbered) around each file(line) the NVRTC log complains about."""
    chunks = []
    done = set()
    for m in _ERROR_LINE_RE.finditer(log):
        fname, line = m.group("file"), int(m.group("line"))
        if (fname, line) in done or fname not in files:
            continue
        done.add((fname, line))
        lines = files[fname].splitlines()
        lo, hi = max(1, line - context), min(len(lines), line + context)
        chunk = [f"--- {fname}:{line}"]
        for i in range(lo, hi + 1):
            mark = ">>" if i == line else "  "
            chunk.append(f"{mark}{i:5d} | {lines[i - 1]}")
        chunks.append("\n".join(chunk))
    return "\n".join(chunks)


# ---------------------------------------------------------------------------------------------
# the cache


@dataclasses.dataclass
class CompiledKernel:
    name: str  # registry name, for messages
    source: str  # path relative to cuda_src/
    arch: str
    options: list[str]
    entries: list[str]
    cubin: bytes
    key: str
    resources: dict[str, Resources]
    compile_seconds: float
    from_cache: bool
    nvrtc: tuple[int, int]
    log: str = ""

    @property
    def cubin_size(self) -> int:
        return len(self.cubin)


class DiskCache:
    """The on-disk cubin cache. `root` may be unwritable: then it falls back with one warning."""

    def __init__(self, root: Path | None = None):
        self.requested = Path(root) if root is not None else cache_dir()
        self.root: Path | None = self.requested / CACHE_LAYOUT_VERSION
        self._checked = False
        self._check_lock = threading.Lock()

    def usable_root(self) -> Path | None:
        """The directory entries go to: `requested`/v1, else the per-user fallback under the
        temporary directory (with one warning), else None (no writable directory). Probed once."""
        return self._usable_root()

    def _usable_root(self) -> Path | None:
        if self._checked:
            return self.root
        with self._check_lock:  # one thread probes; the others wait for its answer
            if not self._checked:
                self.root = self._probe_root()
                self._checked = True
        return self.root

    def _probe_root(self) -> Path | None:
        fallback = Path(tempfile.gettempdir()) / f"qgemm-cache-{os.getuid()}"
        candidates = [self.root, fallback / CACHE_LAYOUT_VERSION]
        for i, cand in enumerate(candidates):
            try:
                if i > 0:  # in a shared temporary directory: ours, writable by us alone, or another user could plant cubins
                    fallback.mkdir(mode=0o700, exist_ok=True)
                    st = fallback.stat()
                    if st.st_uid != os.getuid() or st.st_mode & 0o022:
                        raise OSError(f"{fallback} belongs to uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}: "
                                      "not this user's alone to write")
                cand.mkdir(parents=True, exist_ok=True)
                probe = cand / f".probe-{os.getpid()}-{threading.get_ident()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                if i == 0:
                    warnings.warn(
                        f"qgemm: cache directory {cand} is not writable ({e}); falling back", RuntimeWarning, stacklevel=5
                    )
                continue
            if i > 0:
                warnings.warn(f"qgemm: using fallback cache directory {cand}", RuntimeWarning, stacklevel=5)
            return cand
        warnings.warn("qgemm: no writable cache directory; kernels are compiled in every process", RuntimeWarning, stacklevel=5)
        return None

    # -- reading ------------------------------------------------------------------------------
    def load(self, key: str) -> tuple[bytes, dict] | None:
        """The cubin and metadata for `key`, or None when absent or not trustworthy."""
        root = self._usable_root()
        if root is None:
            return None
        d = root / key
        try:
            meta = json.loads((d / "meta.json").read_text())
            cubin = (d / "kernel.cubin").read_bytes()
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("key") != key:
            return None
        if meta.get("cubin_size") != len(cubin) or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
            return None
        return cubin, meta

    # -- writing ------------------------------------------------------------------------------
    @contextmanager
    def lock(self, key: str):
        root = self._usable_root()
        if root is None:
            yield
            return
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock; store() still publishes an entry by one rename
            yield
            return

        lock_path = root / f"{key}.lock"
        try:
            fh = open(lock_path, "a+b")
        except OSError:
            yield
            return
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            yield
        finally:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            finally:
                fh.close()

    def store(self, key: str, cubin: bytes, meta: dict, source: str) -> None:
        root = self._usable_root()
        if root is None:
            return
        final = root / key
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
            (tmp / "kernel.cubin").write_bytes(cubin)
            (tmp / "source.cu").write_text(source)
            meta = dict(meta, key=key, cubin_size=len(cubin), cubin_sha256=hashlib.sha256(cubin).hexdigest())
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
            if final.exists():  # a corrupt entry: we hold the lock, so nobody else is writing it
                shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except OSError as e:
            warnings.warn(f"qgemm: could not write cache entry {final}: {e}", RuntimeWarning, stacklevel=3)
            shutil.rmtree(locals().get("tmp", final.with_suffix(".none")), ignore_errors=True)

    def entries(self) -> list[Path]:
        root = self._usable_root()
        return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root else []

    def lock_files(self) -> list[Path]:
        """The per-key lock files (`lock`): one per key ever compiled, kept after the entry."""
        root = self._usable_root()
        return sorted(root.glob("*.lock")) if root else []

    def clear(self) -> tuple[int, int]:
        """Delete every entry, and every lock file and unfinished store (a `.KEY.*` directory of a
        process that died while writing) that no process holds: a lock taken while it is removed
        would let a second process compile the same key at once -- harmless (each publishes its
        entry by one rename), but not removed under it. Returns (entries, other files) removed."""
        root = self._usable_root()
        if root is None:
            return 0, 0
        entries = self.entries()
        for e in entries:
            shutil.rmtree(e, ignore_errors=True)
        other = 0
        try:
            import fcntl
        except ImportError:
            return len(entries), 0
        for lock_path in self.lock_files():
            key = lock_path.name[:-len(".lock")]
            try:
                fh = open(lock_path, "a+b")
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # held: a compile of this key is running
                    continue
                for tmp in root.glob(f".{key}.*"):
                    shutil.rmtree(tmp, ignore_errors=True)
                    other += 1
                try:
                    lock_path.unlink()
                    other += 1
                except OSError:
                    pass
            finally:
                fh.close()  # (releases the lock)
        return len(entries), other


_memo: dict[tuple, CompiledKernel] = {}
_memo_lock = threading.Lock()
_default_cache: DiskCache | None = None


def default_cache() -> DiskCache:
    global _default_cache
    if _default_cache is None or _default_cache.requested != cache_dir():
        _default_cache = DiskCache()
    return _default_cache


def clear_memo() -> None:
    with _memo_lock:
        _memo.clear()


def build_options(arch: str, defines: dict[str, object] | None) -> list[str]:
    """The option list that goes into the key: no absolute paths (include dirs are added later)."""
    opts = list(BASE_OPTIONS) + [f"--gpu-architecture={arch}", "--ptxas-options=-v"]
    for k, v in sorted((defines or {}).items()):
        opts.append(f"-D{k}={v}" if v is not None else f"-D{k}")
    return opts


def _no_nvrtc_cache() -> dict:
    """NVRTC 12.9+ keeps its own on-disk cache of ptxas results, keyed by the PTX: a program whose
    PTX some process compiled before (a define no source reads changes nothing) comes back
    without ptxas's report -- 0 registers and no spills for every sm_90 kernel in one pytest
    process on the H100 machines (session 27), after other processes had compiled them. qgemm
    caches its cubins itself, so NVRTC's cache is turned off (`--no-cache`) where cuda.core
    can say so."""
    from cuda.core import ProgramOptions

    if nvrtc_version() >= (12, 9) and "no_cache" in getattr(ProgramOptions, "__dataclass_fields__", {}):
        return {"no_cache": True}
    return {}


def _nvrtc_compile(name: str, source_rel: str, source: str, arch: str, options: list[str], headers: dict[str, str]) -> tuple[bytes, str]:
    """One NVRTC compile to cubin through cuda.core's Program. Returns (cubin, log)."""
    from cuda.core import Program, ProgramOptions

    defines = []
    for o in options:
        if o.startswith("-D"):
            k, _, v = o[2:].partition("=")
            defines.append((k, v) if v else k)
    popts = ProgramOptions(
        name=source_rel,
        arch=arch,
        std="c++17",
        include_path=[str(cuda_src_dir()), cuda_header_dir()],
        ptxas_options=["-v"],
        define_macro=defines or None,
        **_no_nvrtc_cache(),
    )
    if verbose():
        print(f"[qgemm.jit] nvrtc {'.'.join(map(str, nvrtc_version()))}: {source_rel} {' '.join(options)} "
              f"-I{cuda_src_dir()} -I{cuda_header_dir()}", file=sys.stderr)
    log = io.StringIO()
    prog, error = None, None
    try:
        prog = Program(source, "c++", options=popts)
        obj = prog.compile("cubin", logs=log)
    except Exception as e:  # cuda.core raises NVRTCError with the log in its message
        error = e.with_traceback(None)  # only its type and message are used: no frame cycle kept
    finally:
        # Closed and dropped here: a CompileError's traceback (kept by a caller, e.g. in a
        # reference cycle with its frame) reaches this frame, and a Program freed by the cycle
        # collector fails in cuda.core's Program.__dealloc__ on attributes the collector has
        # already cleared ("Exception ignored in: Program.__dealloc__ ... AttributeError").
        if prog is not None and hasattr(prog, "close"):
            prog.close()
        prog = None
    text = log.getvalue().replace("\x00", "")  # NVRTC's log ends in NUL bytes
    if error is not None:
        # the log alone when the error repeats it; else both (an error after a clean NVRTC run,
        # e.g. a driver library cuda.core could not load, must not read as a compile failure)
        err = f"{type(error).__name__}: {error}"
        failed = text if text.strip() and text.strip() in str(error) else (text.rstrip() + "\n" + err).lstrip()
        files = {source_rel: source, **headers}
        raise CompileError(name, arch, options, failed, numbered_listing(failed, files))
    if verbose() and text.strip():
        print(text, file=sys.stderr)
    return bytes(obj.code), text


def compile_kernel(
    name: str,
    source_rel: str,
    entries: list[str],
    arch: str,
    defines: dict[str, object] | None = None,
    cache: DiskCache | None = None,
    use_cache: bool | None = None,
) -> CompiledKernel:
    """Compile cuda_src/<source_rel> for `arch` (e.g. 'sm_90'), through the memo and the disk cache."""
    arch = normalize_arch(arch)
    check_arch_supported(arch)
    options = build_options(arch, defines)
    memo_key = (source_rel, arch, tuple(options), tuple(entries))
    fresh = use_cache is False  # asked for a new compile (`qgemm compile --no-cache`): not this process's memo either
    with _memo_lock:
        hit = None if fresh else _memo.get(memo_key)
    if hit is not None:
        return hit

    source = read_source(source_rel)
    headers = project_headers(source_rel, source)
    key = cache_key(source_rel, source, headers, arch, options)
    if use_cache is None:
        use_cache = not env_flag("QGEMM_DISABLE_CACHE")
    cache = cache or default_cache()

    def from_meta(cubin: bytes, meta: dict) -> CompiledKernel:
        res = {k: Resources(**v) for k, v in meta.get("resources", {}).items()}
        return CompiledKernel(name, source_rel, arch, options, list(entries), cubin, key, res,
                              float(meta.get("compile_seconds", 0.0)), True, nvrtc_version(), meta.get("log", ""))

    def cached() -> CompiledKernel | None:  # None: absent, or an entry this qgemm cannot read (then rebuilt)
        got = cache.load(key)
        if got is None:
            return None
        try:
            return from_meta(*got)
        except (TypeError, ValueError, AttributeError, KeyError):  # e.g. a newer layout's extra field
            return None

    if use_cache:
        result = cached()
        if result is None:
            with cache.lock(key):
                result = cached()  # another process may have finished while we waited
                if result is None:
                    result = _compile_and_store(name, source_rel, source, headers, entries, arch, options, key, cache)
    else:
        result = _compile_and_store(name, source_rel, source, headers, entries, arch, options, key, None)
    # the disk cache is keyed by the source, not by the entries asked for: a cubin another spec of
    # the same source compiled (e.g. a registry entry copied with its old source path) is checked
    # as a fresh compile is (_compile_and_store), instead of coming back without the entry
    missing = [] if not result.from_cache else [
        e for e in entries if e not in result.resources and e.encode() + b"\0" not in result.cubin]
    if missing:
        raise CompileError(name, arch, options, f"entry symbol(s) {missing} not found in the compiled code of "
                           f"{source_rel}; found {sorted(result.resources)} (is the kernel declared extern \"C\", "
                           f"and is the entry's name in the registry spelled as in the source?)\n" + result.log)
    if not fresh:
        with _memo_lock:
            _memo[memo_key] = result
    return result


def _compile_and_store(name, source_rel, source, headers, entries, arch, options, key, cache) -> CompiledKernel:
    t0 = time.perf_counter()
    cubin, log = _nvrtc_compile(name, source_rel, source, arch, options, headers)
    seconds = time.perf_counter() - t0
    res = parse_ptxas_report(log)
    # Without a report (NVRTC's own cache where cuda.core cannot turn it off: _no_nvrtc_cache), the
    # cubin's symbol table tells whether the entry exists; its resources then read 0, said aloud,
    # since a spill check would pass on them.
    for e in entries:
        if e not in res and e.encode() + b"\0" in cubin:
            res[e] = Resources()
            warnings.warn(f"{name} ({arch}): NVRTC returned no ptxas report for {e}, so its registers and spills "
                          f"read 0 (NVRTC >= 12.9 omits it for a program its own cache holds; that cache is off only "
                          f"where cuda.core's ProgramOptions has no_cache)", RuntimeWarning, stacklevel=2)
    missing = [e for e in entries if e not in res]
    if missing:
        raise CompileError(name, arch, options, f"entry symbol(s) {missing} not found in the compiled code; "
                           f"found {sorted(res)} (is the kernel declared extern \"C\"?)\n" + log)
    ck = CompiledKernel(name, source_rel, arch, options, list(entries), cubin, key, res, seconds, False, nvrtc_version(), log)
    if cache is not None:
        meta = {
            "kernel": name,
            "source": source_rel,
            "arch": arch,
            "options": options,
            "entries": list(entries),
            "nvrtc": list(nvrtc_version()),
            "resources": {k: dataclasses.asdict(v) for k, v in res.items()},
            "compile_seconds": seconds,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "log": log,
        }
        cache.store(key, cubin, meta, source)
    return ck
