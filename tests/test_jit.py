"""NVRTC compilation and the on-disk cubin cache (no GPU needed: NVRTC runs on the CPU)."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import qgemm
from qgemm import jit, registry
from qgemm.errors import CompileError, UnsupportedArchError

ARCHS = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache dir and an empty in-process memo."""
    monkeypatch.setenv("QGEMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QGEMM_DISABLE_CACHE", raising=False)
    jit.clear_memo()
    yield jit.default_cache()
    jit.clear_memo()


@pytest.fixture
def src_copy(tmp_path, monkeypatch):
    """A private copy of cuda_src/ that a test may edit."""
    dst = tmp_path / "cuda_src"
    shutil.copytree(jit.cuda_src_dir(), dst)
    monkeypatch.setenv("QGEMM_CUDA_SRC", str(dst))
    jit.cuda_src_dir.cache_clear()
    yield dst
    monkeypatch.delenv("QGEMM_CUDA_SRC")
    jit.cuda_src_dir.cache_clear()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", registry.names())
def test_every_kernel_compiles(name, arch, cache):
    spec = registry.spec(name)
    if int(arch[3:]) < spec.min_arch:
        with pytest.raises(UnsupportedArchError, match=re.escape(f"needs {spec.arch_needed}; {arch} was requested")):
            qgemm.get(name).compile(arch)
        return
    ck = qgemm.get(name).compile(arch)
    assert ck.cubin[:4] == b"\x7fELF", "NVRTC must produce a cubin (ELF), never PTX"
    assert ck.arch.startswith(arch)
    res = ck.resources[spec.entry]
    assert res.registers > 0
    assert res.spill_stores == 0 and res.spill_loads == 0, f"{name} spills on {arch}: {res}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,k", [("w4a8.skinny", 4096), ("w4a8.skinny", 14336), ("w8a8.skinny", 4096),
                                    ("w8a8.skinny", 14336)])
def test_skinny_i8_decode_defaults_keep_their_launch_bounds(name, k, arch, cache):
    """The M = 1 defaults are compiled for SK_MINB resident CTAs per SM (__launch_bounds__' second
    argument): the registers must leave room for them, with no spills."""
    kern = qgemm.get(name)
    d = kern.spec.config(1, 4096, k, 132)
    ck = kern.compile(arch, {key: str(v) for key, v in d.items()})
    res = ck.resources[kern.spec.entry]
    threads = 32 * d["SK_WARPS"]
    assert res.spill_stores == 0 and res.spill_loads == 0, (name, d, res)
    assert d["SK_MINB"] * threads * res.registers <= 65536, (name, d, res)
    if d["SK_MINB"] == 1:
        return
    # the bound reaches ptxas: without it the same source compiles to other machine code
    # (docs/perf/NOTES.md) -- the kernel's .text section, not the cubin, whose .nv.info records the
    # bound even when the code is identical
    other = kern.compile(arch, {key: str(v) for key, v in {**d, "SK_MINB": 1}.items()})
    text = _elf_section(ck.cubin, f".text.{kern.spec.entry}")
    assert text and text != _elf_section(other.cubin, f".text.{kern.spec.entry}")


def _elf_section(elf: bytes, name: str) -> bytes:
    """The bytes of the section `name` of a little-endian ELF64 file (a cubin), b"" if absent."""
    import struct

    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx]
    names = elf[strtab[4]:strtab[4] + strtab[5]]
    for h in headers:
        if names[h[0]:names.index(b"\0", h[0])].decode() == name:
            return elf[h[4]:h[4] + h[5]]
    return b""


def test_launch_only_keys_no_cache_and_arch_messages(cache):
    """Audit of session 31: SK_GSPLIT (the skinny kernels' K split across CTAs: gridDim.y only) was
    passed to NVRTC, so configurations differing only in it compiled and cached the same cubin
    again; `use_cache=False` (`qgemm compile --no-cache`) returned this process's memo instead of a
    fresh compile; an sm_90a-only kernel asked for sm_80 said "needs sm_90 or newer"."""
    k = qgemm.get("w4a16.skinny")
    d = k.spec.config(8, 4096, 4096, 132)
    one, two = (k.compile("sm_90", {**d, "SK_GSPLIT": s}) for s in (1, 2))
    assert one.key == two.key and not any("SK_GSPLIT" in o for o in one.options)
    fresh = [jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80", use_cache=False) for _ in range(2)]
    assert fresh[0] is not fresh[1] and not fresh[1].from_cache
    memo = jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80")
    assert jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80") is memo  # the memo otherwise
    for arch in ("sm_80", "sm_100"):
        with pytest.raises(qgemm.UnsupportedArchError, match=rf"w4a16.wgmma_rs needs sm_90a \(only\); {arch} was requested"):
            qgemm.get("w4a16.wgmma_rs").compile(arch)
    with pytest.raises(ValueError, match=r"convert.f16k_f16 takes one operand \(the float16 activations\), got two"):
        qgemm.get("convert.f16k_f16")(np.ones((2, 32), np.float16), np.ones((2, 32), np.float16))


def test_a_cached_cubin_without_the_entry_is_a_compile_error(cache):
    """The disk cache is keyed by the source: a registry entry copied from another kernel with its
    old source path and a new entry name found that source's cubin cached and came back without the
    entry (`qgemm compile` then stopped with a KeyError traceback)."""
    jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80")
    jit.clear_memo()
    with pytest.raises(CompileError, match=r"entry symbol\(s\) \['fp32_naive_rows'\] not found in the compiled code "
                                           r"of fp32/naive.cu; found \['fp32_naive'\]"):
        jit.compile_kernel("fp32.naive_rows", "fp32/naive.cu", ["fp32_naive_rows"], "sm_80")


def test_cache_miss_then_hit_then_memo(cache):
    first = jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80")
    assert not first.from_cache
    assert first is jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80"), "memo hit expected"
    jit.clear_memo()
    second = jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80")
    assert second.from_cache and second.cubin == first.cubin and second.key == first.key
    entry = cache.root / first.key
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["entries"] == ["fp32_naive"] and meta["arch"] == "sm_80"
    assert meta["options"] == first.options and (entry / "source.cu").read_text().startswith("//")
    assert not any(os.path.isabs(o) or "/work" in o for o in meta["options"]), "options in the key must be relative"


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta"])
def test_corrupt_entry_is_rebuilt(cache, damage):
    ck = jit.compile_kernel("fp32.tiled", "fp32/tiled.cu", ["fp32_tiled"], "sm_86")
    entry = cache.root / ck.key
    cubin = (entry / "kernel.cubin").read_bytes()
    if damage == "truncate":
        (entry / "kernel.cubin").write_bytes(cubin[: len(cubin) // 2])
    elif damage == "flip":
        (entry / "kernel.cubin").write_bytes(cubin[:100] + bytes([cubin[100] ^ 0xFF]) + cubin[101:])
    else:
        (entry / "meta.json").write_text("{not json")
    assert cache.load(ck.key) is None, "a damaged entry must not be trusted"
    jit.clear_memo()
    again = jit.compile_kernel("fp32.tiled", "fp32/tiled.cu", ["fp32_tiled"], "sm_86")
    assert not again.from_cache and again.cubin == cubin
    assert cache.load(ck.key) is not None, "the rebuilt entry is stored again"


def test_key_is_path_independent_and_tracks_headers(cache, src_copy, tmp_path):
    k1 = jit.compile_kernel("w4a16.tiled", "w4a16/tiled.cu", ["w4a16_tiled"], "sm_90").key
    # the same sources somewhere else give the same key
    other = tmp_path / "elsewhere" / "cuda_src"
    shutil.copytree(src_copy, other)
    os.environ["QGEMM_CUDA_SRC"] = str(other)
    jit.cuda_src_dir.cache_clear()
    jit.clear_memo()
    k2 = jit.compile_kernel("w4a16.tiled", "w4a16/tiled.cu", ["w4a16_tiled"], "sm_90")
    assert k2.key == k1 and k2.from_cache
    # editing an included header changes the key
    hdr = other / "common" / "tile_gemm.cuh"
    hdr.write_text(hdr.read_text() + "\n// edited\n")
    jit.clear_memo()
    k3 = jit.compile_kernel("w4a16.tiled", "w4a16/tiled.cu", ["w4a16_tiled"], "sm_90")
    assert k3.key != k1 and not k3.from_cache
    # options and arch are in the key
    assert jit.compile_kernel("w4a16.tiled", "w4a16/tiled.cu", ["w4a16_tiled"], "sm_80").key != k3.key
    assert jit.compile_kernel("w4a16.tiled", "w4a16/tiled.cu", ["w4a16_tiled"], "sm_90", {"QGEMM_TEST_DEFINE": 1}).key != k3.key


def test_disable_cache_writes_nothing(cache, monkeypatch):
    monkeypatch.setenv("QGEMM_DISABLE_CACHE", "1")
    ck = jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_75")
    assert not ck.from_cache
    assert not (cache.requested / jit.CACHE_LAYOUT_VERSION).exists() or not cache.entries()


def test_unwritable_cache_dir_falls_back_with_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("QGEMM_CACHE_DIR", str(blocker / "cache"))  # mkdir fails even as root
    jit.clear_memo()
    with pytest.warns(RuntimeWarning) as caught:
        ck = jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_89")
    said = [str(w.message) for w in caught]
    assert any("not writable" in m for m in said) and any("using fallback cache directory" in m for m in said), said
    assert ck.cubin[:4] == b"\x7fELF"
    jit.clear_memo()


def test_compile_error_carries_name_options_and_numbered_log(cache, src_copy):
    (src_copy / "broken.cu").write_text(textwrap.dedent("""\
        #include "common/blocks.cuh"
        extern "C" __global__ void broken(float* x) {
            x[0] = undefined_thing + 1.0f;
        }
    """))
    with pytest.raises(CompileError) as ei:
        jit.compile_kernel("test.broken", "broken.cu", ["broken"], "sm_90", {"FOO": 3})
    e = ei.value
    assert e.kernel == "test.broken" and e.arch == "sm_90"
    assert "-DFOO=3" in e.options and "--gpu-architecture=sm_90" in e.options
    assert "undefined_thing" in e.log
    assert ">>    3 | " in e.listing and "undefined_thing" in e.listing
    assert "test.broken" in str(e) and "NVRTC log" in str(e)


def test_compile_error_leaves_no_program_to_the_cycle_collector(cache, src_copy):
    """A CompileError in a reference cycle is freed by the cycle collector, with every frame of
    the failed compile that its traceback holds. cuda.core's Program fails in its __dealloc__ when
    the collector reaches it ("Exception ignored in: Program.__dealloc__"), so the compile must not
    leave its Program in those frames."""
    import gc

    (src_copy / "broken.cu").write_text('extern "C" __global__ void broken() { undefined_thing(); }\n')
    unraisable = []
    old_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        try:
            jit.compile_kernel("test.broken", "broken.cu", ["broken"], "sm_90")
        except CompileError as e:
            err = e
        err.cycle = err  # garbage only the cycle collector frees, with its traceback's frames
        del err
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert not unraisable, [f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}" for u in unraisable]


def test_missing_entry_symbol_is_a_compile_error(cache):
    with pytest.raises(CompileError, match="not found"):
        jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["no_such_symbol"], "sm_90")


def test_arch_newer_than_nvrtc_is_reported(cache):
    with pytest.raises(UnsupportedArchError, match="newer than the installed NVRTC"):
        jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_990")
    with pytest.raises(UnsupportedArchError, match="cannot parse"):
        jit.normalize_arch("volta")
    assert jit.normalize_arch("9.0") == "sm_90" and jit.normalize_arch(90) == "sm_90" and jit.normalize_arch("sm_90a") == "sm_90a"


def test_kernel_below_min_arch_is_refused():
    with pytest.raises(UnsupportedArchError, match="sm_75 or newer"):
        qgemm.get("fp32.naive").compile("sm_70")


def test_running_on_a_gpu_it_does_not_run_on_names_what_it_needs(monkeypatch):
    """The launch-time refusal (no GPU call made): an sm_90a kernel on an sm_100 GPU says it runs
    on sm_90a only, not "sm_90 or newer"; a kernel below its minimum names its minimum."""
    import types

    from qgemm import runtime

    for cc, name, want in ((100, "w4a16.wgmma_rs", r"needs sm_90a \(only\), but the GPU \(B200\) is sm_100"),
                           (75, "w4a8.mma", r"needs sm_80 or newer, but the GPU \(T4\) is sm_75")):
        monkeypatch.setattr(runtime, "require_gpu", lambda what="": None)
        monkeypatch.setattr(runtime, "device_info", lambda cc=cc, n=name: types.SimpleNamespace(
            cc=cc, arch=f"sm_{cc}", name="B200" if cc == 100 else "T4"))
        k = qgemm.get(name)
        with pytest.raises(UnsupportedArchError, match=want):
            k._module({"QGEMM_TEST_UNLOADED": 1})


def test_ptxas_report_parser():
    log = textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Compiling entry function 'k1' for 'sm_90'
        ptxas info    : Function properties for k1
        ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
        ptxas info    : Used 96 registers, used 1 barriers, 17408 bytes smem, 400 bytes cmem[0]
    """)
    r = jit.parse_ptxas_report(log)["k1"]
    assert (r.registers, r.smem_static, r.stack_frame, r.spill_stores, r.spill_loads) == (96, 17408, 16, 8, 4)


def test_nvrtc_cache_is_off(monkeypatch):
    """NVRTC 12.9+ caches ptxas results by PTX on disk and then returns no ptxas report: on the
    H100 machines every sm_90 kernel read 0 registers and no spills in a process after others had
    compiled them (session 27). qgemm keeps its own cubin cache, so NVRTC's is turned off."""
    from cuda.core import ProgramOptions

    seen = []

    class Stop(Exception):
        pass

    class FakeProgram:
        def __init__(self, source, code_type, options=None):
            seen.append(options)
            raise Stop

    import cuda.core

    monkeypatch.setattr(cuda.core, "Program", FakeProgram)
    with pytest.raises(CompileError):  # the fake's Stop, reported as a failed compile
        jit._nvrtc_compile("fp32.naive", "fp32/naive.cu", "", "sm_90", [], {})
    if jit.nvrtc_version() >= (12, 9):  # the cuda.core CI installs (the newest) must be able to say so
        assert "no_cache" in ProgramOptions.__dataclass_fields__ and seen[0].no_cache is True
    else:
        assert not getattr(seen[0], "no_cache", False)


def test_a_missing_ptxas_report_is_said_aloud(monkeypatch, tmp_path):
    """Where NVRTC's cache cannot be turned off, a cubin comes without ptxas's report: the entry
    still loads (its symbol is in the cubin), its resources read 0, and a warning says why --
    a spill check would otherwise pass on nothing."""
    monkeypatch.setattr(jit, "_nvrtc_compile", lambda *a: (b"cubin fp32_naive\0", ""))
    monkeypatch.setenv("QGEMM_CACHE_DIR", str(tmp_path))
    jit.clear_memo()
    try:
        with pytest.warns(RuntimeWarning, match="no ptxas report for fp32_naive"):
            ck = qgemm.get("fp32.naive").compile("sm_90")
    finally:
        jit.clear_memo()
    assert ck.resources["fp32_naive"].registers == 0


def test_ptxas_report_in_a_second_process():
    """With NVRTC's cache on, the second process compiling a program got no report (0 registers).
    NVRTC only: runs without a GPU."""
    code = ("import qgemm; ck = qgemm.get('fp32.naive').compile('sm_90', use_cache=False); "
            "print(ck.resources['fp32_naive'].registers)")
    regs = [int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])
            for _ in range(2)]
    assert regs[0] > 0 and regs[1] == regs[0], regs


_RACE = textwrap.dedent("""\
    import sys, time
    start = float(sys.argv[1])
    while time.time() < start:
        time.sleep(0.001)
    from qgemm import jit
    ck = jit.compile_kernel("w4a16.naive", "w4a16/naive.cu", ["w4a16_naive"], "sm_80", {"QGEMM_RACE_TEST": sys.argv[2]})
    print("cache" if ck.from_cache else "compiled", ck.key, len(ck.cubin))
""")


def test_two_processes_compile_once(tmp_path):
    env = dict(os.environ, QGEMM_CACHE_DIR=str(tmp_path / "shared-cache"))
    env.pop("QGEMM_DISABLE_CACHE", None)
    env["PYTHONPATH"] = str(Path(qgemm.__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    import time

    tag = str(os.getpid())
    start = time.time() + 3.0  # both processes are imported and waiting by then
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(start), tag], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    lines = [o[0].split() for o in outs]
    assert sorted(l[0] for l in lines) == ["cache", "compiled"], lines
    assert lines[0][1:] == lines[1][1:], "both processes must end with the same entry"
    entries = [p for p in (tmp_path / "shared-cache" / jit.CACHE_LAYOUT_VERSION).iterdir() if p.is_dir()]
    assert len(entries) == 1 and not any(p.name.startswith(".") for p in entries), "no temp dirs left behind"


def test_cuda_headers_found():
    assert (Path(jit.cuda_header_dir()) / "cuda_fp16.h").is_file()


def test_programmatic_dependent_launch_config(monkeypatch):
    """qgemm.matmul launches the wgmma GEMMs behind their prologue with programmatic dependent
    launch on sm_90+; with a cuda.core whose LaunchConfig lacks the option (or an older GPU) it
    falls back to plain launches instead of failing."""
    import types

    import cuda.core

    from qgemm import runtime

    geo = dict(grid=(2, 1, 1), block=(128, 1, 1), shmem_size=0)
    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(runtime, "device_info", lambda: types.SimpleNamespace(cc=90))
    monkeypatch.setitem(runtime._PDL, "supported", None)
    try:
        cuda.core.LaunchConfig(**geo, programmatic_stream_serialization=True)
        has_option = True
    except TypeError:
        has_option = False
    cfg = runtime._pdl_config(geo)
    assert (cfg is not None) == has_option and runtime._PDL["supported"] == has_option

    class OldLaunchConfig:  # a cuda.core without programmatic_stream_serialization
        def __init__(self, grid=None, block=None, shmem_size=None):
            pass

    monkeypatch.setattr(cuda.core, "LaunchConfig", OldLaunchConfig)
    monkeypatch.setitem(runtime._PDL, "supported", None)
    assert runtime._pdl_config(geo) is None and runtime._PDL["supported"] is False
    monkeypatch.setattr(runtime, "device_info", lambda: types.SimpleNamespace(cc=80))
    monkeypatch.setitem(runtime._PDL, "supported", None)
    assert runtime._pdl_config(geo) is None  # no PDL before sm_90
    monkeypatch.setattr(runtime, "device_info", lambda: types.SimpleNamespace(cc=90))
    monkeypatch.setattr(cuda.core, "LaunchConfig", lambda **kw: kw)
    monkeypatch.setitem(runtime._PDL, "supported", None)
    assert runtime._pdl_config(geo) == dict(geo, programmatic_stream_serialization=True)
    monkeypatch.setenv("QGEMM_PDL", "0")  # the switch for debugging and for timing both ways
    assert runtime._pdl_config(geo) is None and not runtime.pdl_enabled()


def test_cache_audit_findings(cache, tmp_path, monkeypatch):
    """Session 32's runtime audit: an entry whose meta.json this qgemm cannot read (a newer
    layout's extra field, a null) crashed instead of being rebuilt; the key missed the headers
    cuda_fp16.h pulls in and NVRTC's patch release; the shared fallback directory was trusted
    whoever could write to it."""
    ck = jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80")
    meta_path = cache.root / ck.key / "meta.json"
    for damage in ({"resources": {"fp32_naive": {"registers": 1, "a_newer_field": 2}}}, {"compile_seconds": None},
                   {"resources": []}):
        meta = json.loads(meta_path.read_text())
        meta_path.write_text(json.dumps({**meta, **damage}))
        jit.clear_memo()
        again = jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80")
        assert not again.from_cache and again.cubin == ck.cubin, damage  # rebuilt and stored again
        jit.clear_memo()
        assert jit.compile_kernel("fp32.naive", "fp32/naive.cu", ["fp32_naive"], "sm_80").from_cache

    # every header cuda_fp16.h includes, transitively, is in the key
    hdir = tmp_path / "include"
    (hdir / "nv").mkdir(parents=True)
    (hdir / "cuda_fp16.h").write_text('#include "vector_types.h"\n')
    (hdir / "vector_types.h").write_text("#include <nv/target>\n")
    (hdir / "nv" / "target").write_text("// 1\n")
    real_dir = jit.cuda_header_dir
    monkeypatch.setattr(jit, "cuda_header_dir", lambda: str(hdir))
    jit.system_header_digest.cache_clear()
    d1 = jit.system_header_digest()
    (hdir / "nv" / "target").write_text("// 2\n")
    jit.system_header_digest.cache_clear()
    assert jit.system_header_digest() != d1
    # ... and so is every toolkit header the kernel itself includes: cuda_bf16.h (the 16-bit
    # activation kernels, session 41) was outside the key until session 48, so a toolkit update
    # that changed only it kept the old cubins
    (hdir / "cuda_bf16.h").write_text('#include "cuda_bf16.hpp"\n')
    (hdir / "cuda_bf16.hpp").write_text("// bf16 1\n")
    src = "#include <cuda_fp16.h>\n"
    hdrs = {"common/x.cuh": "#include <cuda_bf16.h>\n"}
    k1, k_fp16_only = jit.cache_key("x.cu", src, hdrs, "sm_80", []), jit.cache_key("x.cu", src, {}, "sm_80", [])
    (hdir / "cuda_bf16.hpp").write_text("// bf16 2\n")
    jit.system_header_digest.cache_clear()
    assert jit.cache_key("x.cu", src, hdrs, "sm_80", []) != k1
    assert jit.cache_key("x.cu", src, {}, "sm_80", []) == k_fp16_only
    assert jit.included_names(src, hdrs) == ("cuda_bf16.h", "cuda_fp16.h")
    monkeypatch.setattr(jit, "cuda_header_dir", real_dir)
    jit.system_header_digest.cache_clear()
    build = jit.nvrtc_build()
    assert build  # the wheel's version (or the library's identity)
    key = jit.cache_key("fp32/naive.cu", "x", {}, "sm_80", [])
    monkeypatch.setattr(jit, "nvrtc_build", lambda: build + ".1")
    assert jit.cache_key("fp32/naive.cu", "x", {}, "sm_80", []) != key

    # a fallback directory other users can write to is not used
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    shared = tmp_path / "tmp"
    (shared / f"qgemm-cache-{os.getuid()}").mkdir(parents=True)
    (shared / f"qgemm-cache-{os.getuid()}").chmod(0o777)
    monkeypatch.setattr(jit.tempfile, "gettempdir", lambda: str(shared))
    with pytest.warns(RuntimeWarning) as caught:
        assert jit.DiskCache(blocker / "cache")._usable_root() is None
    assert any("no writable cache directory" in str(w.message) for w in caught), [str(w.message) for w in caught]
    (shared / f"qgemm-cache-{os.getuid()}").chmod(0o700)
    with pytest.warns(RuntimeWarning) as caught:
        assert jit.DiskCache(blocker / "cache")._usable_root() == shared / f"qgemm-cache-{os.getuid()}" / jit.CACHE_LAYOUT_VERSION
    assert any("using fallback cache directory" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_packaging_audit_findings(monkeypatch, tmp_path):
    """Session 33's packaging audit: QGEMM_CUDA_SRC naming no kernel tree is an error (it used to
    fall back silently to qgemm's own sources); an installed qgemm takes the wheel's cuda_src/
    before a cuda_src/ in the directory that holds the package (site-packages); an older
    cuda-pathfinder without locate_nvidia_header_directory is asked through
    find_nvidia_header_directory; an error raised after a clean NVRTC run is reported with its
    type, not as the empty-looking compile log alone."""
    import cuda.pathfinder as pf

    from qgemm import errors as qgemm_errors

    monkeypatch.setenv("QGEMM_CUDA_SRC", str(tmp_path / "nowhere"))
    jit.cuda_src_dir.cache_clear()
    try:
        with pytest.raises(qgemm_errors.SetupError, match="QGEMM_CUDA_SRC=.*nowhere.*not a kernel source tree"):
            jit.cuda_src_dir()
        cli = subprocess.run([sys.executable, "-m", "qgemm", "info"], capture_output=True, text=True)
        assert cli.returncode == 2 and cli.stderr.startswith("error: qgemm: QGEMM_CUDA_SRC=") and "Traceback" not in cli.stderr
    finally:
        monkeypatch.delenv("QGEMM_CUDA_SRC")
        jit.cuda_src_dir.cache_clear()

    site = tmp_path / "site-packages"
    for d in (site / "qgemm" / "cuda_src" / "common", site / "cuda_src" / "common"):
        d.mkdir(parents=True)
    (site / "qgemm" / "jit.py").write_text("")
    monkeypatch.setattr(jit, "__file__", str(site / "qgemm" / "jit.py"))
    jit.cuda_src_dir.cache_clear()
    try:
        assert jit.cuda_src_dir() == (site / "qgemm" / "cuda_src").resolve()
    finally:
        monkeypatch.undo()
        jit.cuda_src_dir.cache_clear()

    headers = jit.cuda_header_dir()
    monkeypatch.delattr(pf, "locate_nvidia_header_directory", raising=False)
    monkeypatch.setattr(pf, "find_nvidia_header_directory", lambda lib: headers, raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    asked = []
    real_is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda p: asked.append(p) or (str(p).startswith(headers) and real_is_file(p)))
    jit.cuda_header_dir.cache_clear()
    try:
        assert jit.cuda_header_dir() == headers and asked == [Path(headers, "cuda_fp16.h")]
    finally:
        monkeypatch.undo()
        jit.cuda_header_dir.cache_clear()

    import cuda.core

    class DriverMissing(RuntimeError):
        pass

    class FakeProgram:
        def __init__(self, source, code_type, options=None):
            pass

        def compile(self, target, logs=None):
            logs.write("ptxas info    : Used 10 registers\x00\x00")
            raise DriverMissing("Failed to dlopen libcuda.so.1")

    monkeypatch.setattr(cuda.core, "Program", FakeProgram)
    with pytest.raises(CompileError) as ei:
        jit._nvrtc_compile("fp32.naive", "fp32/naive.cu", "", "sm_90", [], {})
    assert "Used 10 registers" in ei.value.log and "DriverMissing: Failed to dlopen libcuda.so.1" in ei.value.log
    assert "\x00" not in ei.value.log
