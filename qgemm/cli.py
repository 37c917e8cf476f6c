"""`qgemm`: list, inspect, compile, validate and profile the registered kernels."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from . import jit, registry, runtime
from .errors import CompileError, NoGPUError, QgemmError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="llama.cpp-compatible quantized GEMM kernels, JIT-compiled with NVRTC. "
    "Shapes are MxNxK for C[M,N] = A[M,K] . W[N,K]^T (M tokens, N output features, K reduction).",
)


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


def _shape(text: str) -> tuple[int, int, int]:
    from .check import parse_shape

    try:
        return parse_shape(text)
    except ValueError as e:
        _fail(str(e))


def _command_line() -> str:
    return "qgemm " + " ".join(shlex.quote(a) for a in sys.argv[1:])


@app.command("list")
def list_cmd(
    family: Optional[str] = typer.Option(None, "--family", "-f", help="Only this family (e.g. w4a16)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Every registered kernel: name, op, tutorial step, minimum arch, description."""
    specs = registry.list_kernels(family=family)
    if as_json:
        typer.echo(json.dumps([{"name": s.name, "op": str(s.op), "step": s.step, "min_arch": f"sm_{s.min_arch}{s.arch_suffix}",
                                "source": f"cuda_src/{s.source}", "entry": s.entry, "description": s.description} for s in specs], indent=1))
        return
    rows = [[s.name, s.op.title, str(s.step), f"sm_{s.min_arch}{s.arch_suffix}", s.description] for s in specs]
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
    lines.append(f"kernel sources:   {jit.cuda_src_dir()}")
    lines.append(f"cache directory:  {cache.requested}" + ("  (disabled by QGEMM_DISABLE_CACHE)" if jit.env_flag("QGEMM_DISABLE_CACHE") else ""))
    try:
        import cuda.bindings
        import cuda.core

        lines.append(f"cuda-python:      cuda.core {cuda.core.__version__}, cuda.bindings {cuda.bindings.__version__}")
    except Exception:
        pass
    if runtime.gpu_available():
        d = runtime.device_info()
        lines.insert(0, f"GPU:              {d.name} ({d.arch}, {d.sm_count} SMs, {d.total_mem / 2**30:.1f} GiB, L2 {d.l2_bytes / 2**20:.0f} MiB)")
        lines.insert(1, f"driver:           {d.driver_version} (CUDA {d.driver_cuda_version[0]}.{d.driver_cuda_version[1]} driver API)")
    else:
        lines.insert(0, f"No NVIDIA GPU is usable on this machine ({runtime.gpu_unavailable_reason()}). "
                        "Kernels can still be listed and compiled: qgemm compile --all --arch sm_90")
    typer.echo("\n".join(lines))


@app.command()
def compile(
    names: Optional[List[str]] = typer.Argument(None, help="Kernel names (or families, e.g. w4a16)."),
    all_: bool = typer.Option(False, "--all", help="Every registered kernel."),
    arch: Optional[str] = typer.Option(None, "--arch", help="Target, e.g. sm_90 (default: the GPU's). Works without a GPU."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Compile even if a cached cubin exists (and do not store it)."),
):
    """Compile with NVRTC and print registers, shared memory, spills, cubin size, time, cache hit."""
    specs = _specs(names, all_)
    if arch is None:
        if not runtime.gpu_available():
            _fail("no GPU to take the architecture from: pass --arch, e.g. --arch sm_90")
        arch = runtime.device_arch()
    try:
        arch = jit.normalize_arch(arch)
        jit.check_arch_supported(arch)
    except ValueError as e:
        _fail(str(e))
    rows, failed = [], 0
    for s in specs:
        k = registry.get(s.name)
        try:
            t0 = time.perf_counter()
            ck = k.compile(arch, use_cache=not no_cache)
            wall = time.perf_counter() - t0
        except CompileError as e:
            failed += 1
            typer.echo(str(e), err=True)
            rows.append([s.name, arch, "-", "-", "-", "-", "-", "-", "COMPILE ERROR"])
            continue
        except ValueError as e:
            rows.append([s.name, arch, "-", "-", "-", "-", "-", "-", f"skipped: {e}"])
            continue
        r = ck.resources[s.entry]
        rows.append([s.name, ck.arch, str(r.registers), f"{r.smem_static}", f"{r.spill_stores}/{r.spill_loads}",
                     f"{r.stack_frame}", f"{ck.cubin_size}", f"{(ck.compile_seconds if not ck.from_cache else wall) * 1e3:.0f} ms",
                     "cache" if ck.from_cache else "compiled"])
    typer.echo(_table(["kernel", "arch", "regs", "smem B", "spill st/ld B", "stack B", "cubin B", "time", "source"], rows,
                      right={2, 3, 4, 5, 6, 7}))
    if failed:
        raise typer.Exit(1)


@app.command()
def validate(
    names: Optional[List[str]] = typer.Argument(None, help="Kernel names (or families)."),
    all_: bool = typer.Option(False, "--all", help="Every registered kernel."),
    shape: str = typer.Option("257x1031x4096", "--shape", help="MxNxK; odd M and N catch edge bugs."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (default: fresh every run, printed)."),
    as_json: Optional[Path] = typer.Option(None, "--json", help="Also write the results to this JSON file."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Break C[0,0] down block by block: sumi, d_a, s_a, d_w, kernel vs reference."),
):
    """Run on the GPU and compare with the numpy references; exit 1 on any FAIL."""
    from .check import block_breakdown, format_breakdown
    from .check import validate as run_validate

    specs = _specs(names, all_)
    mnk = _shape(shape)
    _need_gpu("validate")
    rows, results, details, failed = [], [], [], 0
    for s in specs:
        try:
            r = run_validate(registry.get(s.name), mnk, seed)
        except (QgemmError, ValueError) as e:
            failed += 1
            rows.append([s.name, "x".join(map(str, mnk)), "-", "-", "-", "-", f"ERROR: {e}"])
            continue
        results.append(r.to_dict())
        failed += not r.passed
        if verbose and s.op.kind == "gemm" and r.inputs is not None:
            details.append(format_breakdown(s.name, block_breakdown(registry.get(s.name), r.inputs.a, r.inputs.w)))
        rows.append([s.name, "x".join(map(str, mnk)), f"{r.max_abs_err:.3e}", f"{r.rel_err:.2e} (<= {r.exact_tol:.0e})",
                     f"{r.nmse:.2e} (<= {r.nmse_tol:.1e})", str(r.seed), ("PASS" if r.passed else "FAIL") + (f"  {r.note}" if r.note and not r.passed else "")])
    typer.echo(_table(["kernel", "MxNxK", "max abs err", "rel err vs exact", "NMSE vs float64", "seed", "result"], rows))
    for d in details:
        typer.echo("\n" + d)
    if as_json:
        as_json.write_text(json.dumps({"command": _command_line(), "results": results}, indent=1))
    if failed:
        typer.echo(f"\n{failed} of {len(specs)} FAILED", err=True)
        raise typer.Exit(1)


@app.command()
def profile(
    names: Optional[List[str]] = typer.Argument(None, help="Kernel names (or families)."),
    all_: bool = typer.Option(False, "--all", help="Every registered kernel."),
    shape: str = typer.Option("512x4096x4096", "--shape", help="MxNxK."),
    warmup: int = typer.Option(10, "--warmup", min=0, help="Untimed launches first."),
    iters: int = typer.Option(50, "--iters", min=1, help="Timed launches (the median is reported)."),
    cold: bool = typer.Option(False, "--cold", help="Rotate buffer sets larger than 2x L2, so operands come from DRAM."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also time torch (cuBLAS fp16/bf16/fp32, cuBLASLt int8) when present."),
    as_json: Optional[Path] = typer.Option(None, "--json", help="Also write the results (with device, date, command) as JSON."),
):
    """CUDA-event timing: median/min/max us, TFLOPS, bytes and GB/s, % of the device roofline."""
    from . import bench

    specs = _specs(names, all_)
    mnk = _shape(shape)
    _need_gpu("profile")
    env = bench.environment()
    rows, results = [], []
    for s in specs:
        try:
            p = bench.profile(registry.get(s.name), mnk, warmup=warmup, iters=iters, cold=cold)
        except (QgemmError, ValueError) as e:
            rows.append([s.name, "-", "-", "-", "-", "-", "-", "-", f"ERROR: {e}"])
            continue
        results.append(p.to_dict())
        rows.append([s.name, f"{p.median_us:.1f}", f"{p.min_us:.1f}", f"{p.max_us:.1f}", f"{p.tflops:.2f}",
                     f"{p.bytes / 1e6:.1f}", f"{p.gbps:.0f}", f"{p.roofline_pct:.1f}% ({p.bound})", ""])
    peer_rows = bench.torch_peers(mnk, warmup=warmup, iters=iters) if peers else []
    for pr in peer_rows:
        if "error" in pr:
            rows.append([pr["peer"], "-", "-", "-", "-", "-", "-", "-", pr["error"][:60]])
        else:
            rows.append([pr["peer"], f"{pr['median_us']:.1f}", "", "", f"{pr['tflops']:.2f}", "", "", "", "peer"])
    bw = bench.copy_bandwidth()
    typer.echo(f"{env['device']} ({env['arch']}), {env['date']}, shape MxNxK={'x'.join(map(str, mnk))}, "
               f"{'cold (rotating buffers > 2x L2)' if cold else 'hot (same buffers)'}, {warmup} warm-up + {iters} timed launches")
    typer.echo(f"measured copy bandwidth {bw / 1e9:.0f} GB/s (read+write)\n")
    typer.echo(_table(["kernel", "median us", "min us", "max us", "TFLOPS", "MB moved", "GB/s", "% roofline", "note"], rows,
                      right={1, 2, 3, 4, 5, 6}))
    if as_json:
        as_json.write_text(json.dumps({"command": _command_line(), "environment": env, "shape": mnk, "cold": cold,
                                       "warmup": warmup, "iters": iters, "copy_bandwidth_gbps": bw / 1e9,
                                       "results": results, "peers": peer_rows}, indent=1))


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
    for st in steps:
        tut.run(st, typer.echo, mnk)
        typer.echo("")


@app.command("cache")
def cache_cmd(
    clear: bool = typer.Option(False, "--clear", help="Delete every cached cubin."),
):
    """Show (or clear) the kernel cache."""
    import shutil

    c = jit.default_cache()
    entries = c.entries()
    if clear:
        for e in entries:
            shutil.rmtree(e, ignore_errors=True)
        typer.echo(f"removed {len(entries)} entries from {c.root}")
        return
    typer.echo(f"{c.root}: {len(entries)} entries, {sum(f.stat().st_size for e in entries for f in e.iterdir()) / 1e6:.1f} MB")


def main() -> None:
    try:
        app()
    except NoGPUError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
