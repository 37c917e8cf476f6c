"""Stored tuning results: the fastest correct configuration per (GPU, arch, kernel, shape bucket).

`qgemm tune NAME --shape MxNxK` writes them; Kernel.config_for() reads them. The file lives in the
cache directory (tuning/<gpu>-<arch>.json). A file that does not parse, or an entry that does not
look like a configuration of that kernel, is ignored with a warning, never trusted: the kernel
falls back to its default heuristic.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path

from . import jit, runtime

_lock = threading.Lock()
_cache: dict[str, dict] = {}
TUNING_VERSION = 1


def bucket(m: int, n: int, k: int) -> str:
    """Shapes that share a configuration: M rounded up to a power of two, N and K exact."""
    mb = 1
    while mb < m:
        mb *= 2
    return f"{mb}x{n}x{k}"


_paths: dict = {}
_generation = [0]  # bumped whenever what lookup() answers may change (store, forget_cache)


def path() -> Path:
    """This GPU's tuning file. Memoized on what jit.cache_dir() reads (the environment) and the
    GPU, since every qgemm.matmul plans through lookup(): building the Path each time was a
    sizeable part of an eager decode call's host time."""
    info = runtime.device_info()
    key = (os.environ.get("QGEMM_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"), info.name, info.cc)
    p = _paths.get(key)
    if p is None:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", info.name).strip("-").lower()
        p = _paths[key] = jit.cache_dir() / "tuning" / f"{slug}-{info.arch}.json"
    return p


def state() -> tuple:
    """A token that changes whenever lookup() may answer differently (another tuning file, a
    stored entry, forget_cache): qgemm.matmul's plan memo is keyed on it."""
    return (str(path()) if runtime.gpu_available() else None, _generation[0])


def _load(p: Path) -> dict:
    key = str(p)
    if key in _cache:
        return _cache[key]
    data: dict = {}
    if p.is_file():
        try:
            raw = json.loads(p.read_text())
            if not isinstance(raw, dict) or raw.get("version") != TUNING_VERSION or not isinstance(raw.get("entries"), dict):
                raise ValueError("not a qgemm tuning file of version %d" % TUNING_VERSION)
            data = raw["entries"]
        except (OSError, ValueError) as e:
            warnings.warn(f"qgemm: ignoring tuning file {p}: {e}", RuntimeWarning, stacklevel=3)
            data = {}
    _cache[key] = data
    return data


def _valid(name: str, defines) -> bool:
    from .registry import spec

    s = spec(name)
    if not isinstance(defines, dict) or s.config is None:
        return False
    expected = set(s.config(64, 64, 128, 132))
    # values are tile sizes, counts (> 0) or on/off switches (SK_XSMEM: 0 is a legitimate value)
    return set(defines) == expected and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in defines.values())


def lookup(name: str, m: int, n: int, k: int) -> dict | None:
    if not runtime.gpu_available():
        return None
    with _lock:
        entry = _load(path()).get(f"{name}|{bucket(m, n, k)}")
    if entry is None:
        return None
    defines = entry.get("defines") if isinstance(entry, dict) else None
    if not _valid(name, defines):
        # malformed, or stale: stored before the kernel's configuration gained or lost a define
        warnings.warn(f"qgemm: ignoring a tuning entry for {name} {bucket(m, n, k)} that is not a configuration of the "
                      f"kernel as it is now (malformed or stale); run `qgemm tune {name}` again", RuntimeWarning, stacklevel=3)
        return None
    return fit(name, m, n, k, defines)


_fit_cache: dict = {}


def fit(name: str, m: int, n: int, k: int, defines: dict) -> dict | None:
    """A stored configuration as it applies to this exact shape, or None where it cannot. A
    bucket spans several M (20 and 32 share bucket 32), and some defines follow the shape, not
    the tuning: the token tiles a skinny kernel is compiled for (SK_MT = ceil(M / 8)), a per-shape
    cache policy. Those take this shape's values (the ones every candidate here shares); the
    result must then be one of the kernel's candidates for this shape -- else a configuration
    tuned at M = 20 (SK_MT = 3) would run at M = 32 and leave rows 24-31 unwritten, and a
    malformed entry (a 0 tile) would reach the launch."""
    from .registry import spec

    key = (name, m, n, k, tuple(sorted(defines.items())))
    hit = _fit_cache.get(key, _fit_cache)  # one read: another thread may clear the table in between
    if hit is not _fit_cache:
        return dict(hit) if hit is not None else None
    cands = spec(name).candidates(m, n, k) if spec(name).candidates is not None else []
    got = None
    if cands:
        fixed = {a: v for a, v in cands[0].items() if all(c.get(a) == v for c in cands)}
        d = {**defines, **fixed}
        got = d if d in cands else None
    runtime.remember(_fit_cache, key, got, 4096)
    return dict(got) if got is not None else None


def unwritable() -> str | None:
    """Why this GPU's tuning file cannot be written (its directory cannot be made or written),
    or None. The cubin cache falls back to a temporary directory; tuning results there would
    be lost, so `qgemm tune` asks before it times anything."""
    d = path().parent
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tuning-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return f"{d} is not writable ({e.strerror or e})"
    return None


def store(name: str, m: int, n: int, k: int, defines: dict, median_us: float) -> Path:
    p = path()
    with _lock:
        entries = dict(_load(p))
        entries[f"{name}|{bucket(m, n, k)}"] = {"defines": defines, "median_us": median_us, "shape": [m, n, k]}
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tuning-")
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": TUNING_VERSION, "device": runtime.device_info().name, "entries": entries}, fh, indent=1, sort_keys=True)
        os.replace(tmp, p)
        _cache[str(p)] = entries
        _generation[0] += 1
    return p


def forget_cache() -> None:
    with _lock:
        _cache.clear()
        _generation[0] += 1
