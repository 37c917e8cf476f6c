"""`qgemm`: list, inspect, compile, validate and profile the registered kernels."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer

from . import jit, occupancy, registry, runtime, sass
from .errors import CompileError, NoGPUError, QgemmError, SetupError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="llama.cpp-compatible quantized GEMM kernels, JIT-compiled with NVRTC. "
    "Shapes are MxNxK for C[M,N] = A[M,K] . W[N,K]^T (M tokens, N output features, K reduction).",
)


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"qgemm {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print qgemm's version and exit.")) -> None:
    pass


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _specs(names: Optional[List[str]], all_: bool):
    try:
        return registry.resolve(names, all_)
    except (KeyError, ValueError) as e:
        _fail(str(e.args[0] if e.args else e))


def _need_gpu(what: str) -> None:
    if not runtime.gpu_available():
        _fail(f"{what} needs an NVIDIA GPU, but none is usable here: {runtime.gpu_unavailable_reason()}. "
              "`qgemm list`, `qgemm info` and `qgemm compile --arch sm_XX` work without one.", code=2)


def _shape(text: str, form: str | None = None) -> tuple[int, int, int]:
    from .check import parse_shape

    try:
        return parse_shape(text, form=form)
    except ValueError as e:
        _fail(str(e))


def _shapes(text: Optional[str], gemm_default: str, runner_default: str, specs=()):
    """(the GEMM shape, shape_of(spec)): --shape for every kernel when given; otherwise each kind
    its own default, so `validate mustafar.key_q2` or `--all` needs no --shape (a GEMM's MxNxK is
    no BxSxD: D = 4096 is not a head dim). A bad --shape names the form the kernels take."""
    runners = [getattr(s, "runner", None) is not None for s in specs]
    form = "BxSxD" if runners and all(runners) else ("MxNxK (BxSxD for mustafar.*)" if any(runners) else None)
    mnk = _shape(gemm_default if text is None else text, form)
    kv = _shape(runner_default if text is None else text, form)
    return mnk, (lambda spec: kv if getattr(spec, "runner", None) is not None else mnk)


def _gguf_source(gguf, tensor, m_rows, mnk):
    """(M, weights, K, fmt) from --gguf/--tensor/--m, or None. Exits 2 with the reason on a bad file."""
    if gguf is None and tensor is None:
        if m_rows is not None:
            _fail("--m sets the activation rows of a --gguf tensor's GEMM; without --gguf, put M in --shape")
        return None
    if gguf is None or tensor is None:
        _fail("--gguf and --tensor go together (e.g. --gguf model.gguf --tensor blk.0.ffn_down.weight)")
    from . import gguf_io

    try:
        n, k, fmt = gguf_io.weight_shape(gguf, tensor)
        w = gguf_io.load_gguf(gguf, tensor)
    except OSError as e:  # its args are (errno, text): str() names the file
        _fail(f"--gguf: {e}")
    except (KeyError, ValueError, ImportError) as e:
        _fail(str(e.args[0] if e.args else e))
    return (m_rows or mnk[0], w, k, fmt)


def _check_gguf_format(spec, fmt: str) -> None:
    """The GGUF tensor's format must be the kernel's W format (f32 and f16 convert to each other)."""
    if spec.op.weights is None:
        raise ValueError(f"{spec.name} takes no weight matrix (it converts the activations): --gguf does not apply")
    want = spec.op.weights.name
    if want != fmt and not (want in ("f32", "f16") and fmt in ("f32", "f16")):
        raise ValueError(f"{spec.name} takes {want} weights; the GGUF tensor is {fmt}")


def _with_gguf(spec, gg, mnk):
    """The shape and weights a kernel runs on: the GGUF tensor's when given (its format must be
    the kernel's W format), else random weights of --shape."""
    if gg is None:
        return mnk, None
    m, w, k, fmt = gg
    _check_gguf_format(spec, fmt)
    want = spec.op.weights.name
    if want in ("f32", "f16"):
        w = np.ascontiguousarray(w, dtype=spec.op.weights.dtype)
    else:
        w = np.ascontiguousarray(w)
    return (m, w.shape[0], k), w


def _clamp_m(spec, mnk):
    """Decode kernels (max_m) run with M = min(M, max_m); the tables show the shape used."""
    if spec.max_m is not None and mnk[0] > spec.max_m:
        return (spec.max_m,) + tuple(mnk[1:])
    return mnk


def _skip_runner(spec, mnk, all_: bool, rows: list, ncols: int, gg=None) -> bool:
    """--all with a shape a runner kernel (mustafar.*: BxSxD, D in 64/128/256) cannot take, or
    with --gguf (GEMM weights) for a runner kernel or a kernel of another weight format: a
    'skipped' row, not a failure. Named explicitly, _precheck refuses it."""
    runner = getattr(spec, "runner", None)
    if not all_:
        return False
    if runner is None:
        if gg is None:
            return False
        try:  # --all --gguf: the kernels of another weight format are not failures
            _check_gguf_format(spec, gg[3])
            return False
        except ValueError as e:
            rows.append([spec.name] + ["-"] * (ncols - 2) + [f"skipped: {e}"])
            return True
    why = "--gguf gives GEMM weights; this kernel takes a compressed KV cache" if gg is not None else runner.shape_problem(mnk)
    if why is None:
        return False
    rows.append([spec.name] + ["-"] * (ncols - 2) + [f"skipped: {why}"])
    return True


def _path_arg(text) -> Path:
    """The parser of every path argument: Path("") would be ".", the current directory."""
    if isinstance(text, str) and not text.strip():
        raise typer.BadParameter("an empty path: give a file or directory name")
    return Path(text)


def _writable_file(path: Optional[Path], what: str) -> None:
    """--json / --out: fail before the GPU work, not after it, when the result cannot be written."""
    if path is None:
        return
    if path.exists() and path.is_dir():
        _fail(f"{what} {path} is a directory; give a file name")
    if path.is_symlink() and not path.exists():
        _fail(f"{what} {path} is a link to {os.readlink(path)}, which does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        _fail(f"{what} {path} exists and is not writable")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        _fail(f"{what} {path}: the directory {parent} does not exist or is not writable")


def _writable_dir(path: Path, what: str) -> None:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if path.exists() and not path.is_dir():
        _fail(f"{what} {path} exists and is not a directory")
    if not existing.is_dir():  # a/b with a a file: mkdir would fail only after the work
        _fail(f"{what} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        _fail(f"{what} {path}: {existing} is not writable")


def _write(path: Path, text: str, what: str) -> None:
    """Write a result file; an OSError the checks above could not foresee (a full disk, a device
    file) is one line, not a traceback after the work."""
    try:
        path.write_text(text)
    except OSError as e:
        _fail(f"{what}: could not write {path}: {e}", code=1)


def _precheck(specs, shape_of, all_: bool, sparsity: float, gg) -> None:
    """What validate / profile can check without a GPU, checked before they ask for one: the
    mustafar sparsity, K for the GEMM kernels, a named mustafar kernel's B x S x D, and that a
    GGUF tensor's format is the kernel's."""
    if not 0.0 <= sparsity < 1.0:
        _fail(f"--sparsity must be in [0, 1), got {sparsity}")
    for s in specs:
        runner = getattr(s, "runner", None)
        mnk = shape_of(s)
        if runner is not None and gg is not None and not all_:
            _fail(f"{s.name}: --gguf gives GEMM weights; this kernel takes a compressed KV cache (no --gguf)")
        if runner is not None:
            why = runner.shape_problem(mnk)
            if why is not None and not all_:
                _fail(f"{s.name}: {why}")
        elif gg is None and mnk[2] % s.op.k_multiple:  # GEMMs on quantized operands and the quantizers
            _fail(f"--shape: K must be a multiple of {s.op.k_multiple} for {s.name}, got K={mnk[2]}")
        if gg is not None and runner is None:
            try:
                _check_gguf_format(s, gg[3])
            except ValueError as e:
                if not all_:
                    _fail(str(e))


def _command_line() -> str:
    return "qgemm " + " ".join(shlex.quote(a) for a in sys.argv[1:])


# options shared by `validate` and `profile` (GGUF weights; the mustafar.* problem)
_OPT_GGUF = typer.Option(None, "--gguf", help="Take the weights from this GGUF file (with --tensor); N and K come from the tensor.")
_OPT_TENSOR = typer.Option(None, "--tensor", help="The GGUF tensor, e.g. blk.0.ffn_down.weight.")
_OPT_M_ROWS = typer.Option(None, "--m", min=1, help="Activation rows M with --gguf (default: the M of --shape).")
_OPT_LQ = typer.Option(1, "--lq", min=1, help="mustafar.*: query length Lq (--shape is BxSxD: B = batch x kv-heads).")
_OPT_GROUPS = typer.Option(4, "--groups", min=1, help="mustafar.*: query heads per kv head (num_key_value_groups).")
_OPT_SPARSITY = typer.Option(0.7, "--sparsity", help="mustafar.*: per-token pruning sparsity in [0, 1).")


@app.command("list")
def list_cmd(
    family: Optional[str] = typer.Option(None, "--family", "-f", help="Only this family (e.g. w4a16)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Every registered kernel: name, op, tutorial step, minimum arch, description."""
    try:
        specs = registry.list_kernels(family=family)
    except ValueError as e:
        _fail(str(e))
    try:
        src = jit.cuda_src_dir()
    except SetupError as e:  # the listing needs no sources; a compile says so again
        src = None
        typer.echo(f"warning: {e}", err=True)
    for s in specs if src is not None else ():  # an entry whose source is not there compiles nowhere
        if not (src / s.source).is_file():
            typer.echo(f"warning: {s.name}: its source cuda_src/{s.source} does not exist in {src} "
                       f"(qgemm/registry.py's KernelSpec says source={s.source!r})", err=True)
    if as_json:
        typer.echo(json.dumps([{"name": s.name, "op": str(s.op), "step": s.step, "min_arch": f"sm_{s.min_arch}{s.arch_suffix}",
                                "source": f"cuda_src/{s.source}", "entry": s.entry, "description": s.description} for s in specs], indent=1))
        return
    rows = [[s.name, s.op.title, str(s.step) if s.step <= 5 else "prod", f"sm_{s.min_arch}{s.arch_suffix}", s.description] for s in specs]
    typer.echo(_table(["name", "op", "step", "min arch", "description"], rows))
    typer.echo(f"\n{len(specs)} kernels. Operand formats: `qgemm list --json` or qgemm.get(NAME).op")


@app.command()
def info():
    """GPU, sm_XX, driver/CUDA/NVRTC versions and the cache directory (works without a GPU)."""
    lines = []
    try:
        lines.append(f"NVRTC:            {'.'.join(map(str, jit.nvrtc_version()))} (targets "
                     f"{', '.join(f'sm_{a}' for a in jit.supported_archs())})")
    except Exception as e:
        lines.append(f"NVRTC:            not usable ({e})")
    try:
        lines.append(f"CUDA headers:     {jit.cuda_header_dir()}")
    except Exception as e:
        lines.append(f"CUDA headers:     not found ({e})")
    cache = jit.default_cache()
    bad_sources = None
    try:
        lines.append(f"kernel sources:   {jit.cuda_src_dir()}")
    except SetupError as e:  # a QGEMM_CUDA_SRC that is no source tree: the rest still shown, then the error
        bad_sources = e
        lines.append("kernel sources:   not usable (the error below)")
    if jit.env_flag("QGEMM_DISABLE_CACHE"):
        lines.append(f"cache directory:  {cache.requested}  (disabled by QGEMM_DISABLE_CACHE)")
    else:
        used = cache.usable_root()
        lines.append(f"cache directory:  {used.parent if used else cache.requested}" + (
            "" if used == cache.requested / jit.CACHE_LAYOUT_VERSION else
            f"  (the fallback: {cache.requested} is not a writable directory)" if used else "  (not writable: no cache)"))
    try:
        import cuda.bindings
        import cuda.core

        lines.append(f"cuda-python:      cuda.core {cuda.core.__version__}, cuda.bindings {cuda.bindings.__version__}")
    except Exception:
        pass
    if runtime.gpu_available():
        d = runtime.device_info()
        which = f"device {d.ordinal} of {d.device_count} (QGEMM_DEVICE picks): " if d.device_count > 1 or d.ordinal else ""
        lines.insert(0, f"GPU:              {which}{d.name} ({d.arch}, {d.sm_count} SMs, {d.total_mem / 2**30:.1f} GiB, L2 {d.l2_bytes / 2**20:.0f} MiB)")
        lines.insert(1, f"driver:           {d.driver_version} (CUDA {d.driver_cuda_version[0]}.{d.driver_cuda_version[1]} driver API)")
        lines.insert(2, f"memory:           {d.nominal_bandwidth / 1e9:.0f} GB/s nominal ({d.bus_width_bits}-bit bus, "
                        f"{d.mem_clock_khz / 1e3:.0f} MHz); the roofline uses the copy bandwidth qgemm bench measures")
    else:
        lines.insert(0, f"No NVIDIA GPU is usable on this machine ({runtime.gpu_unavailable_reason()}). "
                        "Kernels can still be listed and compiled: qgemm compile --all --arch sm_90")
    typer.echo("\n".join(lines))
    if bad_sources is not None:
        _fail(str(bad_sources))


def _define_warnings(spec, ck, extra: dict) -> list[str]:
    """`compile -D`: the macros that changed nothing in this kernel -- redefined by its source
    (NVRTC warns, and keeps the source's value) or named nowhere in it (a typo, or a key of
    another kernel)."""
    if not extra:  # (every compile without -D: no sources to read)
        return []
    try:
        src = jit.read_source(spec.source)
        text = src + "".join(jit.project_headers(spec.source, src).values())
    except OSError:
        return []
    out = []
    for key in extra:
        if re.search(rf'incompatible redefinition of macro "{re.escape(key)}"', ck.log or ""):
            out.append(f"warning: {spec.name}: -D {key}: its source #defines {key} itself and NVRTC kept the source's "
                       "value, so the row is not that configuration")
        elif not re.search(rf"\b{re.escape(key)}\b", text):
            out.append(f"warning: {spec.name}: -D {key}: no such macro in cuda_src/{spec.source} or the headers it "
                       "includes, so it changes nothing (a typo?)")
    return out


def _occupancy_cells(k, mnk, defines: dict, r, cc: int, sms: int) -> list[str]:
    """`qgemm compile --shape`'s two occupancy cells for a GEMM kernel: the CTAs one SM holds (with
    the binding limit) and the grid's CTAs with the waves they take; "-" where there is no launch
    geometry or no limits table for the architecture."""
    if k.op.kind != "gemm":
        return ["-", "-"]
    try:
        g = k.geometry(*mnk, defines)
        occ = occupancy.of_launch(cc, g, r)
    except ValueError as e:
        return [f"- ({e})" if "does not fit" in str(e) else "-", "-"]
    ctas = math.prod(g.grid)
    try:
        k.check_launch(*mnk, defines)
    except ValueError:  # (the message, in full, after the table)
        return [f"{occ.ctas_per_sm} ({', '.join(occ.limited_by)})", f"grid {g.grid}: beyond CUDA's limits"]
    return [f"{occ.ctas_per_sm} ({', '.join(occ.limited_by)})", f"{ctas} CTAs: {occ.waves(ctas, sms):.2f} waves"]


@app.command()
def compile(
    names: Optional[List[str]] = typer.Argument(None, help="Kernel names (or families, e.g. w4a16)."),
    all_: bool = typer.Option(False, "--all", help="Every registered kernel."),
    arch: Optional[str] = typer.Option(None, "--arch", help="Target, e.g. sm_90 (default: the GPU's). Works without a GPU."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Compile even if a cached cubin exists (and do not store it)."),
    shape: Optional[str] = typer.Option(
        None, "--shape", help="MxNxK: the configuration a launch of this shape uses (tuned, or the default heuristic) "
                              "instead of the source's defaults; for kernels with launch-time configurations."),
    define: Optional[List[str]] = typer.Option(
        None, "--define", "-D", help="KEY=VALUE, a #define on top (repeatable), e.g. -D SK_UNROLL=1: the registers "
                                     "and spills of any configuration `qgemm tune` would try."),
    show_sass: bool = typer.Option(
        False, "--sass", help="Also count each kernel's SASS instructions by opcode (needs NVIDIA's nvdisasm: the CUDA "
                              "toolkit or `pip install nvidia-cuda-nvdisasm`)."),
    sass_dir: Optional[Path] = typer.Option(
        None, "--sass-dir", parser=_path_arg, metavar="<path>", help="Write each kernel's SASS listing to DIR/NAME.ARCH.sass (implies --sass), e.g. to diff "
                                 "two -D settings."),
    sms: Optional[int] = typer.Option(
        None, "--sms", min=1, help="With --shape: the SMs the grid's waves are counted for (default: this GPU's, or 132 "
                                   "where it is not of the target architecture or there is none)."),
):
    """Compile with NVRTC and print registers, shared memory, spills, cubin size, time, cache hit.
    With --shape, a GEMM kernel's occupancy too: the CTAs one SM holds (and the limit that binds:
    CTAs, threads, registers or shared memory) and the waves its grid takes (qgemm/occupancy.py)."""
    specs = _specs(names, all_)
    mnk = _shape(shape) if shape is not None else None  # ("" is refused there, as by the other commands)
    if sms is not None and mnk is None:
        _fail("--sms counts the waves of a launch: it needs --shape MxNxK")
    extra = {}
    for item in define or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            _fail(f"--define takes KEY=VALUE (e.g. -D SK_UNROLL=1), got {item!r}")
        if not re.fullmatch(r"[A-Za-z_]\w*", key.strip()):
            _fail(f"--define: {key.strip()!r} is not a macro name (letters, digits and _, not starting with a digit)")
        value = value.strip()
        extra[key.strip()] = int(value) if re.fullmatch(r"-?\d+", value) else value
    nvdisasm = None
    if show_sass or sass_dir is not None:  # before any compile: a missing tool is said at once
        nvdisasm = sass.find_nvdisasm()
        if nvdisasm is None:
            _fail(f"--sass needs NVIDIA's nvdisasm, which was not found: {sass.INSTALL_HINT}")
        if sass_dir is not None:
            _writable_dir(sass_dir, "--sass-dir")
    if arch is None:
        if not runtime.gpu_available():
            _fail("no GPU to take the architecture from: pass --arch, e.g. --arch sm_90")
        arch = runtime.device_arch()
    try:
        arch = jit.normalize_arch(arch)
        jit.check_arch_supported(arch)
    except ValueError as e:
        _fail(str(e))
    rows, failed, listings = [], 0, []
    configured = bool(mnk or extra)
    cc = jit.parse_arch(arch)[0]
    if sms is None:
        gpu = runtime.device_info() if runtime.gpu_available() else None
        sms = gpu.sm_count if gpu is not None and gpu.cc == cc else 132
    named = set(names or []) & set(registry.names())  # kernels asked for by name, not through a family or --all
    for s in specs:
        if mnk and s.config is not None and s.op.kind == "gemm" and mnk[2] % s.op.k_multiple:
            _fail(f"--shape: K must be a multiple of {s.op.k_multiple} for {s.name}, got K={mnk[2]}")
        if mnk and s.max_m is not None and mnk[0] > s.max_m:  # its configurations stop there (tune refuses it too)
            rows.append([s.name, arch, "-", "-", "-", "-", "-", "-", f"skipped: handles at most M={s.max_m}", ""])
            failed += s.name in named
            continue
        k = registry.get(s.name)
        defines = dict(k.config_for(*mnk)) if mnk and s.config is not None else {}
        defines.update(extra)
        try:
            t0 = time.perf_counter()
            ck = k.compile(arch, defines or None, use_cache=False if no_cache else None)  # None: QGEMM_DISABLE_CACHE decides
            wall = time.perf_counter() - t0
        except CompileError as e:
            failed += 1
            typer.echo(str(e), err=True)
            rows.append([s.name, arch, "-", "-", "-", "-", "-", "-", "COMPILE ERROR", ""])
            continue
        except ValueError as e:
            rows.append([s.name, arch, "-", "-", "-", "-", "-", "-", f"skipped: {e}", ""])
            failed += s.name in named  # asked for by name: not compiling it is a failure
            continue
        except FileNotFoundError as e:  # a QGEMM_CUDA_SRC tree without this kernel's file
            if isinstance(e, SetupError):  # no source tree at all, or no headers: main() says it once
                raise
            failed += 1
            typer.echo(f"error: {e}", err=True)
            rows.append([s.name, arch, "-", "-", "-", "-", "-", "-", "NO SOURCE", ""])
            continue
        r = ck.resources[s.entry]
        for line in _define_warnings(s, ck, extra):
            typer.echo(line, err=True)
        if nvdisasm is not None:
            listings.append((s, ck))
        rows.append([s.name, ck.arch, str(r.registers), f"{r.smem_static}", f"{r.spill_stores}/{r.spill_loads}",
                     f"{r.stack_frame}", f"{ck.cubin_size}", f"{(ck.compile_seconds if not ck.from_cache else wall) * 1e3:.0f} ms",
                     "cache" if ck.from_cache else "compiled",
                     _defines_text(defines) or "(source defaults)"]
                    + (_occupancy_cells(k, mnk, defines, r, cc, sms) if mnk else []))
    headers = ["kernel", "arch", "regs", "smem B", "spill st/ld B", "stack B", "cubin B", "time", "source", "configuration"]
    if mnk:  # the occupancy columns after the configuration, only for a launch's shape
        headers += ["CTAs/SM", "grid"]
        rows = [row + ["-", "-"] * (len(row) == 10) for row in rows]
    if not configured:  # the configuration column only when --shape or -D chose one
        headers, rows = headers[:-1], [row[:-1] for row in rows]
    typer.echo(_table(headers, rows, right={2, 3, 4, 5, 6, 7}))
    if mnk:
        typer.echo(f"CTAs/SM: what one SM of {arch} holds and the limit that binds (qgemm/occupancy.py); grid: the launch's "
                   f"CTAs and the waves they take on {sms} SMs")
    if listings:
        typer.echo("\nSASS (NOPs of the alignment padding not counted):")
    for s, ck in listings:
        try:
            text = sass.disassemble(ck.cubin, nvdisasm)
        except SetupError as e:
            _fail(str(e))
        if sass_dir is not None:
            try:
                sass_dir.mkdir(parents=True, exist_ok=True)
                (sass_dir / f"{s.name}.{ck.arch}.sass").write_text(text)
            except OSError as e:
                _fail(f"--sass-dir: cannot write the listing: {e}")
        for function, counts in sass.by_function(text).items():
            typer.echo(f"  {s.name} ({ck.arch}) {function}: {counts.line()}")
    if sass_dir is not None and listings:
        typer.echo(f"listings in {sass_dir}/")
    if failed:
        raise typer.Exit(1)


@app.command()
def validate(
    names: Optional[List[str]] = typer.Argument(None, help="Kernel names (or families)."),
    all_: bool = typer.Option(False, "--all", help="Every registered kernel."),
    shape: Optional[str] = typer.Option(None, "--shape", help="MxNxK (mustafar.*: BxSxD) for every kernel named; odd M and N "
                                        "catch edge bugs. Default: 257x1031x4096, and 5x1031x128 for mustafar.*."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (default: fresh every run, printed)."),
    as_json: Optional[Path] = typer.Option(None, "--json", parser=_path_arg, metavar="<path>", help="Also write the results to this JSON file."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Break C[0,0] down block by block: sumi, d_a, s_a, d_w, kernel vs reference."),
    gguf: Optional[Path] = _OPT_GGUF,
    tensor: Optional[str] = _OPT_TENSOR,
    m_rows: Optional[int] = _OPT_M_ROWS,
    lq: int = _OPT_LQ,
    groups: int = _OPT_GROUPS,
    sparsity: float = _OPT_SPARSITY,
    cache_scale: float = typer.Option(1.0, "--cache-scale", help="mustafar.*: the standard deviation of the random "
                                      "Gaussian cache (e.g. 0.001: a small-valued cache)."),
):
    """Run on the GPU and compare with the numpy references; exit 1 on any FAIL."""
    from .check import block_breakdown, format_breakdown
    from .check import validate as run_validate

    specs = _specs(names, all_)
    mnk, shape_of = _shapes(shape, "257x1031x4096", "5x1031x128", specs)
    _writable_file(as_json, "--json")
    if seed is not None and seed < 0:  # numpy's generators refuse it; said before the GPU is asked
        _fail(f"--seed must be a non-negative integer, got {seed}")
    gg = _gguf_source(gguf, tensor, m_rows, mnk)
    _precheck(specs, shape_of, all_, sparsity, gg)
    if not (math.isfinite(cache_scale) and cache_scale > 0):
        _fail(f"--cache-scale must be a positive finite number, got {cache_scale}")
    _need_gpu("validate")
    rows, results, details, failed = [], [], [], 0
    opts = {"lq": lq, "groups": groups, "sparsity": sparsity, "cache_scale": cache_scale}
    for s in specs:
        if _skip_runner(s, shape_of(s), all_, rows, 7, gg):
            continue
        try:
            shp, wts = _with_gguf(s, gg, shape_of(s))
            r = run_validate(registry.get(s.name), _clamp_m(s, shp), seed, weights=wts, opts=opts)
        except (QgemmError, ValueError) as e:
            failed += 1
            rows.append([s.name, "x".join(map(str, shape_of(s))), "-", "-", "-", "-", f"ERROR: {e}"])
            continue
        results.append(r.to_dict())
        failed += not r.passed
        if verbose and s.op.kind == "gemm" and r.inputs is not None:
            details.append(format_breakdown(s.name, block_breakdown(registry.get(s.name), r.inputs.a, r.inputs.w)))
        rows.append([s.name, "x".join(map(str, r.shape)), f"{r.max_abs_err:.3e}", f"{r.rel_err:.2e} (<= {r.exact_tol:.0e})",
                     f"{r.nmse:.2e} (<= {r.nmse_tol:.1e})", str(r.seed), ("PASS" if r.passed else "FAIL") + (f"  {r.note}" if r.note and not r.passed else "")])
    typer.echo(_table(["kernel", "MxNxK", "max abs err", "rel err vs exact", "NMSE vs float64", "seed", "result"], rows))
    for d in details:
        typer.echo("\n" + d)
    if as_json:
        _write(as_json, json.dumps({"command": _command_line(), "results": results}, indent=1), "--json")
    if failed:
        typer.echo(f"\n{failed} of {len(specs)} FAILED", err=True)
        raise typer.Exit(1)


@app.command()
def profile(
    names: Optional[List[str]] = typer.Argument(None, help="Kernel names (or families)."),
    all_: bool = typer.Option(False, "--all", help="Every registered kernel."),
    shape: Optional[str] = typer.Option(None, "--shape", help="MxNxK (mustafar.*: BxSxD) for every kernel named. Default: "
                                        "512x4096x4096, and 32x16384x128 for mustafar.*."),
    warmup: int = typer.Option(10, "--warmup", min=0, help="Untimed launches first."),
    iters: int = typer.Option(50, "--iters", min=1, help="Timed samples, each a CUDA graph of back-to-back launches "
                                                          "(~1 ms); the median time per launch is reported."),
    cold: bool = typer.Option(False, "--cold", help="Rotate buffer sets larger than 2x L2, so operands come from DRAM."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also time torch (cuBLAS fp16/bf16/fp32, cuBLASLt int8) when present."),
    as_json: Optional[Path] = typer.Option(None, "--json", parser=_path_arg, metavar="<path>", help="Also write the results (with device, date, command) as JSON."),
    gguf: Optional[Path] = _OPT_GGUF,
    tensor: Optional[str] = _OPT_TENSOR,
    m_rows: Optional[int] = _OPT_M_ROWS,
    lq: int = _OPT_LQ,
    groups: int = _OPT_GROUPS,
    sparsity: float = _OPT_SPARSITY,
):
    """CUDA-event timing: median/min/max us, TFLOPS, bytes and GB/s, % of the device roofline."""
    from . import bench

    specs = _specs(names, all_)
    mnk, shape_of = _shapes(shape, "512x4096x4096", "32x16384x128", specs)
    _writable_file(as_json, "--json")
    gg = _gguf_source(gguf, tensor, m_rows, mnk)
    _precheck(specs, shape_of, all_, sparsity, gg)
    _need_gpu("profile")
    env = bench.environment()
    if gg is not None:
        mnk = (gg[0], gg[1].shape[0], gg[2])
    rows, results = [], []
    opts = {"lq": lq, "groups": groups, "sparsity": sparsity}
    for s in specs:
        if _skip_runner(s, shape_of(s), all_, rows, 9, gg):
            continue
        try:
            shp, wts = _with_gguf(s, gg, shape_of(s) if gg is None else mnk)
            p = bench.profile(registry.get(s.name), _clamp_m(s, shp), warmup=warmup, iters=iters, cold=cold, weights=wts, opts=opts)
        except (QgemmError, ValueError) as e:
            rows.append([s.name, "-", "-", "-", "-", "-", "-", "-", f"ERROR: {e}"])
            continue
        results.append(p.to_dict())
        note = (f"compressed {p.extra['compressed_gbps']:.0f} GB/s = {p.extra['compressed_pct_of_copy']:.0f}% of copy, "
                f"{100 * p.extra['ratio']:.1f}% of dense") if "compressed_gbps" in p.extra else ""
        # the header names the shapes; a row says so only where a decode kernel ran at its max M
        label = s.name if tuple(p.shape) == tuple(shp) else f"{s.name} (M={p.shape[0]})"
        rows.append([label, f"{p.median_us:.1f}", f"{p.min_us:.1f}", f"{p.max_us:.1f}", f"{p.tflops:.2f}",
                     f"{p.bytes / 1e6:.1f}", f"{p.gbps:.0f}", f"{p.roofline_pct:.1f}% ({p.bound})", note])
    if all(s.runner is not None for s in specs):
        peers = False  # the GEMM peers mean nothing for attention kernels (qgemm bench --suite kvcache has torch's)
    peer_rows = bench.torch_peers(mnk, warmup=warmup, iters=iters) if peers else []
    for pr in peer_rows:
        if "error" in pr:
            rows.append([pr["peer"], "-", "-", "-", "-", "-", "-", "-", pr["error"][:60]])
        else:
            # the peers are timed hot even in a cold profile (torch_peers has no buffer rotation)
            rows.append([pr["peer"], f"{pr['median_us']:.1f}", "", "", f"{pr['tflops']:.2f}", "", "", "",
                         "peer, hot" if cold else "peer"])
    bw = bench.copy_bandwidth()
    gemms = [t for t in specs if getattr(t, "runner", None) is None]
    runners = [t for t in specs if getattr(t, "runner", None) is not None]
    if gemms and runners and shape_of(runners[0]) == mnk:  # --shape given: one shape, two readings
        shapes = [f"MxNxK={'x'.join(map(str, mnk))} (mustafar.*: BxSxD)"]
    else:
        shapes = ([f"MxNxK={'x'.join(map(str, mnk))}"] if gemms else []) + (
            [f"BxSxD={'x'.join(map(str, shape_of(runners[0])))}"] if runners else [])
    typer.echo(f"{env['device']} ({env['arch']}), {env['date']}, shape {', '.join(shapes)}, "
               f"{'cold (rotating buffers > 2x L2)' if cold else 'hot (same buffers)'}, {warmup} warm-up + {iters} timed samples (CUDA-graph replays of back-to-back launches)")
    typer.echo(f"measured copy bandwidth {bw / 1e9:.0f} GB/s (read+write)\n")
    typer.echo(_table(["kernel", "median us", "min us", "max us", "TFLOPS", "MB moved", "GB/s", "% roofline", "note"], rows,
                      right={1, 2, 3, 4, 5, 6}))
    if as_json:
        _write(as_json, json.dumps({"command": _command_line(), "environment": env, "shape": mnk if gemms else shape_of(runners[0]),
                                    "cold": cold, "warmup": warmup, "iters": iters, "copy_bandwidth_gbps": bw / 1e9,
                                    "results": results, "peers": peer_rows}, indent=1), "--json")


_TUTORIAL_MAX_VALUES = 1 << 28  # 2 GiB of float64 per operand set: the CPU references' footprint


@app.command()
def tutorial(
    steps: List[int] = typer.Argument(..., help="Step numbers 1-5 (e.g. `qgemm tutorial 4` or `qgemm tutorial 1 2 3`)."),
    shape: str = typer.Option("512x4096x4096", "--shape", help="MxNxK for the steps that multiply."),
):
    """The tutorial's steps, measured live: 1 FP32, 2 quantization, 3 W4A16, 4 W4A8 + compensation, 5 llama.cpp."""
    from . import tutorial as tut

    mnk = _shape(shape)
    for st in steps:
        if st not in tut.STEPS:
            _fail(f"tutorial step must be 1..5, got {st}")
    m, n, k = mnk
    if k % 32 and any(st in (2, 3, 4) for st in steps):  # 1 is FP32, 5 uses llama.cpp's shapes; 2-4 quantize
        _fail(f"--shape: K must be a multiple of 32 (the block size) for steps 2-4, got K={k}")
    if m * k + n * k + m * n > _TUTORIAL_MAX_VALUES:
        _fail(f"--shape {m}x{n}x{k} is too large for the tutorial: its CPU references hold M*K + N*K + M*N = "
              f"{m * k + n * k + m * n:,} values in float64 (at most {_TUTORIAL_MAX_VALUES:,}; the default 512x4096x4096 holds "
              "~21 million)")
    for st in steps:
        tut.run(st, typer.echo, mnk)
        typer.echo("")


@app.command()
def explain(
    shape: str = typer.Option("512x4096x4096", "--shape", help="MxNxK."),
    fmt: str = typer.Option("q4_0", "--type", "--fmt", "-t", help="Weight format: q4_0 or q8_0 (fmt= in Python)."),
    x_dtype: str = typer.Option("f32", "--x-dtype", help="The activations' type: f32, f16 or bf16 (x_dtype= in Python)."),
    f16: bool = typer.Option(False, "--f16", help="float16 activations: --x-dtype f16."),
    path: Optional[str] = typer.Option(None, "--path", help="Override the GEMM kernel."),
    packed: bool = typer.Option(False, "--packed", help="Weights made by qgemm.pack_weights (the skinny kernels may run)."),
    arch: Optional[str] = typer.Option(None, "--arch", help="Plan for this architecture (e.g. sm_90) instead of this "
                                       "machine's GPU; works without a GPU."),
):
    """Which kernels qgemm.matmul runs for a shape on this GPU, with which configuration, and why."""
    from . import dispatch as mm
    from .errors import UnsupportedArchError

    mnk = _shape(shape)
    if f16 and x_dtype not in ("f32", "f16"):
        _fail(f"--f16 and --x-dtype {x_dtype} disagree: pass one of them")
    try:
        typer.echo(mm.explain(*mnk, fmt=fmt, x_dtype="f16" if f16 else x_dtype, path=path, packed=packed, arch=arch))
    except (KeyError, ValueError, UnsupportedArchError) as e:
        _fail(str(e.args[0] if e.args else e))


@app.command()
def tune(
    name: str = typer.Argument(..., help="A kernel with launch configurations (e.g. w4a8.mma, w4a8.gemv)."),
    shape: str = typer.Option("512x4096x4096", "--shape", help="MxNxK to tune for (stored per shape bucket: M rounded up to a power of 2)."),
    iters: int = typer.Option(20, "--iters", min=1, help="Timed samples per configuration."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Measure but do not store."),
    only: str = typer.Option("", "--only", help="Try only the configurations with these defines, e.g. RS_WS=1,RS_SPLITK=1."),
    as_json: Optional[Path] = typer.Option(None, "--json", parser=_path_arg, metavar="<path>", help="Also write every configuration's time and check, "
                                                                  "the default and the best (with device, date, command) as JSON."),
):
    """Try the kernel's configurations, keep the fastest correct one for this GPU and shape bucket."""
    from . import check, tuning
    from . import bench as B

    try:
        spec = registry.spec(name)
    except KeyError as e:
        _fail(str(e.args[0]))
    if spec.candidates is None:
        _fail(f"{name} has no launch configurations to tune; tunable: "
              + ", ".join(s.name for s in registry.list_kernels() if s.candidates))
    mnk = _shape(shape)
    m, n, kk = mnk
    cands = spec.candidates(m, n, kk)
    want: dict = {}
    if only:
        try:
            want = {a.strip(): int(b) for a, b in (kv.split("=") for kv in only.split(","))}
        except ValueError:
            _fail(f"--only takes KEY=INT pairs separated by commas, e.g. RS_WS=1,RS_SPLITK=1; got {only!r}")
        # (the default races too, below: a 132-SM default stands in for it before the GPU is asked)
        if not any(all(d.get(a) == b for a, b in want.items()) for d in cands + [spec.config(m, n, kk, 132)]):
            _fail(f"no configuration of {name} at {m}x{n}x{kk} has {only}")
    if kk % spec.op.k_multiple:
        _fail(f"--shape: K must be a multiple of {spec.op.k_multiple} for {name}, got K={kk}")
    _writable_file(as_json, "--json")
    k = registry.get(name)
    try:
        k._check_m(m)
    except ValueError as e:
        _fail(str(e))
    _need_gpu("tune")
    info = runtime.device_info()
    if not spec.runs_on(info.cc):  # else every configuration fails to launch and it reads as a wrong result
        _fail(f"{name} needs {spec.arch_needed}, but the GPU ({info.name}) is {info.arch}; nothing to tune")
    if not dry_run:  # find out before minutes of timing, not when storing the winner
        why = tuning.unwritable()
        if why:
            _fail(f"cannot store tuning results: {why}; set QGEMM_CACHE_DIR to a writable directory, or pass --dry-run")
    # the untuned default on this GPU (what matmul runs without a tuning entry) is timed too (first;
    # with --only, where it matches), so the result says what tuning gains over it -- and a default
    # outside the candidate list (a K split sized to a GPU of other than 132 SMs) cannot lose to a
    # slower candidate that gets stored
    default = k.default_config(m, n, kk, info.sm_count, info.smem_per_block_optin)
    cands = [d for d in [default] + [c for c in cands if c != default] if all(d.get(a) == b for a, b in want.items())]
    if not cands:
        _fail(f"no configuration of {name} at {m}x{n}x{kk} has {only}")
    rng = np.random.default_rng(0)
    inp = check.make_inputs(k.op, m, n, kk, rng)
    exact = k.op.exact(inp.a, inp.w)
    da, dw = k.upload_activations(inp.a), k.upload_weights(inp.w)
    dc = runtime.DeviceArray.empty((m, n), np.float32)
    records, best, default_us = [], None, None
    with typer.progressbar(cands, label=f"tuning {name} at {m}x{n}x{kk}") as bar:
        for d in bar:
            try:
                dc.fill_bytes(0xFF)
                k.launch(da, dw, dc, m, n, kk, defines=d)
                out = dc.to_host()
                ok = not np.isnan(out).any() and check.reference.relative_error(out, exact) <= k.op.exact_tol
                times, _ = B._time_launches(lambda i, stream=None: k.launch(da, dw, dc, m, n, kk, stream=stream, defines=d), 1, 3, iters)
                us = statistics.median(times)
            except Exception as e:  # a configuration that does not compile or launch is skipped
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                records.append(_tune_record(d, None, "skipped", d == default, why))
                continue
            records.append(_tune_record(d, us, "ok" if ok else "wrong result", d == default))
            if d == default and ok:
                default_us = us
            if ok and (best is None or us < best[1]):
                best = (d, us)
    typer.echo(_table(["configuration", "median us", "check"], [_tune_row(r) for r in records], right={1}))
    if as_json:  # written before the verdict, so that a run with no correct configuration is on record too
        _write(as_json, json.dumps({"command": _command_line(), "environment": B.environment(), "kernel": name,
                                    "shape": list(mnk), "iters": iters, "only": want, "default": default,
                                    "default_us": default_us, "best": best[0] if best else None,
                                    "best_us": best[1] if best else None, "candidates": records}, indent=1), "--json")
    if best is None:
        _fail("no configuration produced a correct result", code=1)
    # re-validate the winner on fresh inputs before it is stored
    inp2 = check.make_inputs(k.op, m, n, kk, np.random.default_rng())
    dc.fill_bytes(0xFF)
    k.launch(k.upload_activations(inp2.a), k.upload_weights(inp2.w), dc, m, n, kk, defines=best[0])
    res = check.compare(name, k.op, mnk, -1, dc.to_host(), k.op.exact(inp2.a, inp2.w), check.reference.truth(inp2.a_float, inp2.w_float),
                        inp2.a_float, inp2.w_float)
    if not res.passed:
        _fail(f"the fastest configuration failed re-validation ({res.note}); nothing stored", code=1)
    typer.echo("\n" + _tune_summary(best[0], best[1], default, default_us, only))
    if not dry_run:
        p = tuning.store(name, m, n, kk, best[0], best[1])
        typer.echo(f"stored for {name} bucket {tuning.bucket(m, n, kk)} in {p}")


def _tune_record(config: dict, us: float | None, check: str, is_default: bool, error: str = "") -> dict:
    """One row of `qgemm tune --json`: a configuration, its median time (None when skipped), its
    check ("ok", "wrong result" or "skipped"), whether it is the untuned default, and why it was
    skipped."""
    row = {"config": dict(config), "us": us, "check": check, "default": is_default}
    if error:
        row["error"] = error
    return row


def _defines_text(defines: dict) -> str:
    """A configuration as the CLI prints it (`qgemm tune`, `qgemm compile`): KEY=VALUE pairs in the kernel's order."""
    return " ".join(f"{a}={b}" for a, b in defines.items())


def _tune_row(record: dict) -> list[str]:
    """The printed table's row of one `_tune_record`: the configuration, its median time, its check
    (and the start of the error of a skipped one), marking the untuned default."""
    mark = " (default)" if record["default"] else ""
    if record["check"] == "skipped":
        return [_defines_text(record["config"]), "-", f"skipped{mark}: {record['error'][:60]}"]
    return [_defines_text(record["config"]), f"{record['us']:.1f}",
            ("ok" if record["check"] == "ok" else "WRONG RESULT") + mark]


def _tune_summary(best: dict, best_us: float, default: dict, default_us: float | None, only: str = "") -> str:
    """`qgemm tune`'s last lines: the winner and what it gains over the untuned default."""
    lines = [f"best: {_defines_text(best)}  {best_us:.1f} us"]
    if best == default:
        lines.append(f"the untuned default is the fastest of the configurations with {only}" if only
                     else "the untuned default is the fastest: tuning changes nothing at this shape")
    elif default_us is not None:
        lines.append(f"default: {_defines_text(default)}  {default_us:.1f} us (the best is {100 * (1 - best_us / default_us):.1f}% faster)")
    else:
        why = f"not among --only {only}" if only else "not timed: it failed or gave a wrong result, see the table"
        lines.append(f"default: {_defines_text(default)}  ({why})")
    return "\n".join(lines)


@app.command()
def bench(
    quick: bool = typer.Option(False, "--quick", help="gemm suite: a few M values and K=4096 only; kvcache suite: S = 4k "
                                                       "and 16k, Lq = 1, 70% sparsity only."),
    out_dir: Path = typer.Option(Path("bench-out"), "--out", parser=_path_arg, metavar="<path>", help="Where bench.json, bench.md and the plots go "
                                                                 "(--suite kvcache: kvcache.json and kvcache.md)."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="gemm suite: time torch (cuBLAS fp16/bf16, cuBLASLt int8) "
                                                                "too (the kvcache suite always times dense torch)."),
    hot_only: bool = typer.Option(False, "--hot-only", help="Skip the cold-cache pass."),
    iters: int = typer.Option(30, "--iters", min=1, help="Timed samples per point."),
    suite: str = typer.Option("gemm", "--suite", help="gemm: the matmul sweep; kvcache: Mustafar sparse KV-cache attention vs dense torch."),
    m_list: Optional[str] = typer.Option(None, "--m", help="Comma-separated M values instead of the sweep's (e.g. 1,8,64)."),
    k_list: Optional[str] = typer.Option(None, "--k", help="Comma-separated K values instead of the sweep's (e.g. 4096)."),
    n_val: Optional[int] = typer.Option(None, "--n", min=1, help="gemm suite: the weights' width N (output features) "
                                        "instead of the sweep's 4096, e.g. 1024 for the k / v projections of "
                                        "grouped-query attention."),
    clocks: bool = typer.Option(False, "--clocks", help="gemm suite: record the SM clock and power per row (nvidia-smi, "
                                                         "every 20 ms)."),
    sustain: float = typer.Option(0.0, "--sustain", min=0.0, max=60.0,
                                  help="gemm suite: sample every timing back to back for at least this many seconds "
                                       "(llama.cpp's perf mode runs each op >= 1 s), --iters samples of ~1 ms at least; "
                                       "0: off."),
    x_dtype: str = typer.Option("f32", "--x-dtype", help="gemm suite: qgemm's activations, f32, f16 or bf16 (the peers "
                                "are timed as always)."),
    settle: Optional[float] = typer.Option(None, "--settle", min=0.0, max=60.0,
                                           help="gemm suite: seconds the GPU idles between the hot and the cold pass, so "
                                                "the cold rows do not start at the clock the hot prefill rows left "
                                                "(default 2)."),
):
    """Sweep M x K (N = 4096, or --n) for Q4_0 and Q8_0: qgemm.matmul, its kernel alone, and torch peers, hot and cold;
    with M = 1 in the sweep, also the read ceilings at the decode rows' weight bytes (what a kernel
    that only reads them achieves back to back). --suite kvcache: the mustafar.* kernels over S,
    Lq, sparsity and bits against dense torch attention."""
    from . import bench as B

    if suite not in ("gemm", "kvcache"):
        _fail(f"--suite must be gemm or kvcache, got {suite!r}")
    _writable_dir(out_dir, "--out")
    if x_dtype not in ("f32", "f16", "bf16"):
        _fail(f"--x-dtype must be f32, f16 or bf16, got {x_dtype!r}")
    if suite == "kvcache":
        if x_dtype != "f32":
            _fail("--x-dtype is for the gemm suite (the KV-cache kernels take float16 queries and probabilities)")
        if m_list is not None or k_list is not None or n_val is not None:
            _fail("--m, --n and --k choose the GEMM sweep's shapes; --suite kvcache has its own (S, Lq, sparsity, bits)")
        if not peers:
            _fail("--no-peers is for the gemm suite; --suite kvcache times dense torch attention as its baseline")
        if sustain:
            _fail("--sustain is for the gemm suite; --suite kvcache times --iters samples")
        if clocks:
            _fail("--clocks is for the gemm suite (--suite kvcache records no clocks)")
        if settle is not None:
            _fail("--settle is for the gemm suite")
        _need_gpu("bench")
        from . import kvcache_bench

        try:
            kvcache_bench.run_cli(out_dir, quick=quick, iters=iters, cold=not hot_only, echo=typer.echo, command=_command_line())
        except OSError as e:
            _fail(f"--out: could not write the results: {e}", code=1)
        return

    def ints(text: str, what: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(v) for v in text.split(","))
        except ValueError:
            vals = ()
        if not vals or any(v <= 0 for v in vals) or (what == "K" and any(v % 32 for v in vals)):
            _fail(f"--{what.lower()} must be comma-separated positive integers{' (multiples of 32)' if what == 'K' else ''}, got {text!r}")
        return vals

    ms = ints(m_list, "M") if m_list is not None else ((1, 8, 64, 512) if quick else B.SWEEP_M)
    ks = ints(k_list, "K") if k_list is not None else ((4096,) if quick else B.SWEEP_K)
    modes = (False,) if hot_only else (False, True)
    _need_gpu("bench")
    # the largest row's operands, at least twice over (qgemm's float32 x, staging and C, the Q8_0 weights
    # packed and as blocks; torch's fp16 copies): refused up front, not after an allocation runs for minutes
    n = B.SWEEP_N if n_val is None else n_val
    need = max(2 * (m * k * 4 + m * k * 2 + m * n * 4 + 2 * n * k * 34 // 32 + (m + n) * k * 2) for m in ms for k in ks)
    have = runtime.device_info().total_mem
    if need > have:
        _fail(f"--m / --k: the largest row ({max(ms)} x {n} x {max(ks)}) needs about {need / 2**30:.1f} GiB of GPU memory; "
              f"the GPU has {have / 2**30:.1f} GiB")
    total = len(ms) * len(ks) * 2 * len(modes) + (len(ks) * 2 * len(modes) if 1 in ms else 0)  # rows, read ceilings
    with typer.progressbar(length=total, label="qgemm bench") as bar:
        data = B.sweep(ms=ms, ks=ks, n=n, modes=modes, peers=peers, progress=lambda r: bar.update(1), iters=iters, clocks=clocks,
                       sustain_s=sustain, x_dtype=x_dtype,
                       settle_s=B.SETTLE_S if settle is None else settle)
    cmd = _command_line()
    data["command"] = cmd
    md = B.sweep_markdown(data, cmd)
    typer.echo(md)  # first: the sweep's table is on the screen even if the files below cannot be written
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _fail(f"--out: could not make {out_dir}: {e}", code=1)
    _write(out_dir / "bench.json", json.dumps(data, indent=1), "--out")
    _write(out_dir / "bench.md", md, "--out")
    try:
        files = B.sweep_plots(data, out_dir)
        typer.echo("plots: " + ", ".join(files))
    except ImportError:
        typer.echo("(matplotlib is not installed: no plots; pip install matplotlib)")
    typer.echo(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'}")


@app.command("cache")
def cache_cmd(
    clear: bool = typer.Option(False, "--clear", help="Delete every cached cubin (and the lock files no running compile holds)."),
):
    """Show (or clear) the kernel cache."""
    c = jit.default_cache()
    entries = c.entries()  # probes the directory: c.root is then the one in use
    if c.root is None:
        _fail(f"no usable cache directory ({c.requested} is not writable, nor is the fallback): kernels are compiled "
              "in every process", code=1)
    if c.root != c.requested / jit.CACHE_LAYOUT_VERSION:  # the one asked for (QGEMM_CACHE_DIR) is not usable
        typer.echo(f"note: {c.requested} is not a writable directory, so qgemm uses (and this command "
                   f"{'clears' if clear else 'shows'}) the fallback {c.root}; {c.requested} is left as it is")
    if clear:
        n, other = c.clear()
        typer.echo(f"removed {n} entries from {c.root}" + (f" (and {other} lock files and unfinished stores)" if other else ""))
        return
    locks = len(c.lock_files())
    typer.echo(f"{c.root}: {len(entries)} entries, {sum(f.stat().st_size for e in entries for f in e.iterdir()) / 1e6:.1f} MB"
               + (f", {locks} lock files" if locks else ""))


# ---------------------------------------------------------------------------------------------
# GGUF files and llama.cpp side by side (qgemm/gguf_io.py, qgemm/llamacpp.py)


def _bytes_str(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@app.command("gguf")
def gguf_cmd(
    file: Path = typer.Argument(..., parser=_path_arg, help="A .gguf model file."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """A GGUF file's tensors: name, ggml type, shape N x K, bytes, and how qgemm.load_gguf returns each."""
    from . import gguf_io

    try:
        f = gguf_io.open_gguf(file)
    except (ImportError, ValueError, OSError) as e:
        _fail(str(e))
    keys = f.metadata_keys
    if as_json:
        typer.echo(json.dumps({"file": str(file), "version": f.version, "metadata_keys": keys,
                               "tensors": [{"name": t.name, "type": t.type, "shape": list(t.shape), "ne": list(t.ne),
                                            "bytes": t.nbytes, "offset": t.offset, "qgemm_format": t.fmt}
                                           for t in f.tensors]}, indent=1))
        return
    def meta(key):  # a name that is not valid UTF-8 is shown as such, not a traceback
        try:
            return f.metadata(key)
        except ValueError as e:
            return f"<unreadable: {e}>"

    named = [f"{k} = {v}" for k in ("general.architecture", "general.name") if (v := meta(k)) is not None]
    total = sum(t.nbytes for t in f.tensors)
    typer.echo(f"{file}: GGUF v{f.version}, {len(keys)} metadata keys" + (f" ({', '.join(named)})" if named else "")
               + f", {len(f.tensors)} tensors, {_bytes_str(total)} of tensor data")
    rows = [[t.name, t.type, t.shape_str, str(t.nbytes), t.loads_as()] for t in f.tensors]
    typer.echo(_table(["name", "type", "shape (N x K)", "bytes", "qgemm.load_gguf"], rows, right={3}))
    unsupported: dict[str, int] = {}
    for t in f.tensors:
        if not t.supported:
            unsupported[t.type] = unsupported.get(t.type, 0) + 1
    typer.echo(f"\n{len(f.tensors) - sum(unsupported.values())} of {len(f.tensors)} tensors load in qgemm "
               f"({', '.join(gguf_io.SUPPORTED)})"
               + (f"; not supported: {', '.join(f'{k} ({v})' for k, v in unsupported.items())}" if unsupported else ""))


@app.command("compare-llamacpp")
def compare_llamacpp(
    test_backend_ops: Optional[Path] = typer.Option(None, "--test-backend-ops", parser=_path_arg, metavar="<path>", help="ggml's test-backend-ops binary that you built; run as `PATH perf -o MUL_MAT`."),
    from_file: Optional[Path] = typer.Option(None, "--from-file", parser=_path_arg, metavar="<path>", help="Parse this saved test-backend-ops output instead of running a binary."),
    types: str = typer.Option("q4_0,q8_0", "--types", help="Comma-separated ggml weight types to compare, or 'all'."),
    backend: Optional[str] = typer.Option(None, "--backend", "-b", help="Passed to test-backend-ops as `-b BACKEND` (e.g. CUDA0)."),
    timeout: float = typer.Option(1800.0, "--timeout", help="Seconds test-backend-ops may run."),
    warmup: int = typer.Option(5, "--warmup", min=0, help="Untimed qgemm.matmul calls per shape."),
    iters: int = typer.Option(20, "--iters", min=1, help="Timed samples per shape, each a CUDA-graph replay of back-to-back qgemm.matmul calls (the median is reported)."),
    sustain: float = typer.Option(0.0, "--sustain", min=0.0, max=60.0,
                                  help="Sample each shape back to back for at least this many seconds, as test-backend-ops "
                                       "runs each op for >= 1 s (--iters samples at least); 0: off."),
    as_json: Optional[Path] = typer.Option(None, "--json", parser=_path_arg, metavar="<path>", help="Also write the rows as JSON."),
):
    """llama.cpp's MUL_MAT (test-backend-ops perf) and qgemm.matmul on the same shapes and types,
    side by side. ggml's m, n, k are qgemm's N, M, K. qgemm does not build llama.cpp."""
    from . import llamacpp

    if (test_backend_ops is None) == (from_file is None):
        _fail("pass exactly one of --test-backend-ops PATH (run your build) or --from-file TXT (a saved output)")
    if from_file is not None and backend is not None:
        _fail("--backend is passed to the test-backend-ops binary; with --from-file nothing is run (the file's lines "
              "name their backend)")
    if not math.isfinite(timeout) or timeout <= 0:
        _fail(f"--timeout must be a positive number of seconds, got {timeout}")
    if types.strip().lower() != "all" and not [t for t in types.split(",") if t.strip()]:
        _fail(f"--types must name ggml weight types (e.g. q4_0,q8_0) or be 'all', got {types!r}")
    _writable_file(as_json, "--json")
    try:
        if from_file is not None:
            source = str(from_file)
            text = from_file.read_text(errors="replace")
        else:
            source = f"{test_backend_ops} perf -o MUL_MAT" + (f" -b {backend}" if backend else "")
            text = llamacpp.run_test_backend_ops(test_backend_ops, timeout=timeout,
                                                 extra_args=["-b", backend] if backend else [])
    except (OSError, RuntimeError) as e:
        _fail(str(e))
    try:
        rows = llamacpp.parse_test_backend_ops(text)
    except ValueError as e:
        _fail(f"{source}: {e}")
    if not rows:
        _fail(f"no timed MUL_MAT lines in {source}; expected lines like "
              "'MUL_MAT(type_a=q4_0,type_b=f32,m=4096,n=512,k=14336,...): 3198 runs - 312.80 us/run - ...'")
    wanted = None if types.strip().lower() == "all" else [t.strip().lower() for t in types.split(",") if t.strip()]
    selected = [r for r in rows if wanted is None or r["type"].lower() in wanted]
    present = sorted({r["type"] for r in rows})
    if not selected:
        _fail(f"no {', '.join(wanted)} lines in {source}; it has: {', '.join(present)}")
    missing = [t for t in wanted or [] if t not in {p.lower() for p in present}]
    if missing:
        typer.echo(f"warning: no {', '.join(missing)} lines in {source} (it has: {', '.join(present)})", err=True)
    llama_dev = next((r["device"] for r in selected if r["device"]), "unknown device")

    def shape(r):
        return f"{r['M']}x{r['N']}x{r['K']}"

    if not runtime.gpu_available():
        typer.echo(f"llama.cpp test-backend-ops on {llama_dev} ({source}); MxNxK is qgemm's (ggml's n x m x k)\n")
        several = len({r["backend"] for r in selected}) > 1
        typer.echo(_table(["type", "MxNxK"] + (["backend"] if several else []) + ["llama.cpp us", "TFLOPS", "runs", "note"],
                          [[r["type"], shape(r)] + ([str(r["backend"])] if several else [])
                           + [f"{r['us']:.2f}", f"{r['tflops']:.2f}" if r["tflops"] is not None else "-", str(r["runs"]),
                              llamacpp.row_note(r)] for r in selected],
                          right={3, 4, 5} if several else {2, 3, 4}))
        if as_json:
            _write(as_json, json.dumps({"command": _command_line(), "llamacpp_device": llama_dev, "rows": selected}, indent=1),
                   "--json")
        typer.echo(f"\nThe qgemm column needs an NVIDIA GPU, and none is usable here ({runtime.gpu_unavailable_reason()}); "
                   "run this on the GPU the llama.cpp figures come from.")
        return
    info = runtime.device_info()
    try:
        timer = llamacpp.matmul_timer(warmup=warmup, iters=iters, sustain_s=sustain)
    except RuntimeError as e:
        _fail(str(e))
    res = llamacpp.compare(selected, timer)
    typer.echo(f"llama.cpp: {llama_dev} ({source}); qgemm.matmul: {info.name} ({info.arch}), "
               f"median of {iters} CUDA-graph samples of back-to-back calls per shape"
               + (f", sampled back to back for >= {sustain:g} s" if sustain else ""))
    others = sorted({r["device"] for r in res if r["device"] and r["device"] != info.name})
    if others:
        typer.echo(f"warning: llama.cpp figures from {', '.join(others)}, qgemm runs on {info.name}: those rows' "
                   "ratios compare different GPUs (their note says so)")
        for r in res:
            if r["device"] and r["device"] != info.name:
                r["note"] = "; ".join(x for x in (r["note"], f"llama.cpp on {r['device']} ({r['backend']})") if x)
    typer.echo("ratio = llama.cpp us / qgemm us (> 1: qgemm is faster); MxNxK is qgemm's (ggml's n x m x k)\n")
    several = len({r["backend"] for r in res}) > 1  # a multi-GPU output: each shape once per backend
    typer.echo(_table(["type", "MxNxK"] + (["backend"] if several else []) + ["llama.cpp us", "qgemm us", "ratio", "note"],
                      [[r["type"], shape(r)] + ([str(r["backend"])] if several else [])
                       + [f"{r['us']:.2f}", f"{r['qgemm_us']:.2f}" if r["qgemm_us"] is not None else "-",
                          f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-", r["note"]] for r in res],
                      right={3, 4, 5} if several else {2, 3, 4}))
    if as_json:
        _write(as_json, json.dumps({"command": _command_line(), "llamacpp_device": llama_dev, "qgemm_device": info.name,
                                    "rows": res}, indent=1), "--json")


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """The CLI's warnings as one line each ("warning: ..."): Python's default form names the
    library's source line (e.g. typer/main.py:1445) and repeats it, which tells a user nothing."""
    typer.echo(f"warning: {message}", err=True)


def main() -> None:
    import warnings

    warnings.showwarning = _one_line_warning
    try:
        app()
    except (NoGPUError, SetupError, jit.NVRTCNotFoundError) as e:  # this machine, not the command line
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
