"""qgemm's exceptions. Bad *input* is always a ValueError (or a subclass), raised before launch
wherever the host can see it. What only the GPU sees -- a host-call matmul's activations
overflowing the path's format, non-finite scales in device blocks given to pack_weights -- is a
ValueError raised after the kernels ran."""

from __future__ import annotations


class QgemmError(Exception):
    """Base class of qgemm's own errors. Input errors are ValueError instead (UnsupportedArchError
    and UnknownNameError are both)."""


class CompileError(QgemmError):
    """NVRTC rejected a kernel. Carries the kernel name, the arch, the options, the NVRTC log and
    the offending source lines (.kernel, .arch, .options, .log, .listing)."""

    def __init__(self, kernel: str, arch: str, options: list[str], log: str, listing: str = ""):
        self.kernel = kernel
        self.arch = arch
        self.options = list(options)
        self.log = log = log.rstrip("\x00")  # NVRTC's log buffer is a C string: its terminating NUL came along
        self.listing = listing
        msg = [f"NVRTC failed to compile kernel {kernel!r} for {arch}", "options: " + " ".join(options), "NVRTC log:", log.rstrip()]
        if listing:
            msg += ["source around the errors:", listing.rstrip()]
        super().__init__("\n".join(msg))


class UnsupportedArchError(ValueError, QgemmError):
    """An architecture that the installed NVRTC or the kernel cannot target."""


class UnknownNameError(KeyError, ValueError, QgemmError):
    """A kernel or GGUF tensor name that does not exist. A KeyError (a lookup by name), a
    ValueError (bad input, like every other input error) and a QgemmError; the message lists the
    close names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RegistryError(QgemmError):
    """A KernelSpec in qgemm/registry.py that cannot be registered (a name twice, a name that is
    not "family.variant", a source outside cuda_src/<family>/): raised when qgemm is imported,
    naming every such entry."""


class CudaError(QgemmError):
    """A CUDA driver call failed. `call` names it, `code` is the CUresult name when known."""

    def __init__(self, call: str, message: str, code: str | None = None):
        self.call = call
        self.code = code
        super().__init__(f"{call} failed: {code + ': ' if code else ''}{message}")


class SetupError(QgemmError, FileNotFoundError):
    """What qgemm needs on this machine is missing or misconfigured: the kernel sources
    (QGEMM_CUDA_SRC), the CUDA headers NVRTC compiles against. A FileNotFoundError too."""


class NoGPUError(QgemmError, RuntimeError):
    """No usable NVIDIA GPU/driver. Raised by anything that must run on the GPU."""


def run_tool(main, prog: str):
    """The entry point of the scripts under tools/: `sys.exit(run_tool(main, "probe_defines"))`.
    What the user can act on -- no GPU, a bad name, shape or file (qgemm's errors, ValueError,
    OSError) -- is one line on stderr and exit status 2 (1 for a file that could not be written),
    not a traceback; anything else is a bug and keeps its traceback."""
    import sys

    try:
        return main()
    except (QgemmError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, OSError) and not isinstance(e, (SetupError, FileNotFoundError)) else 2


def positive_int(text: str) -> int:
    """For the scripts under tools/: the argparse type of a count (--reps, --iters, --rounds, --top),
    which 0 or less would turn into a run that times or prints nothing and exits 0."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def check_output_path(path: str, what: str) -> None:
    """For the scripts under tools/: ValueError unless the directory of a result file (`path`,
    given as option `what`) exists and is writable -- checked before the measurements, not after."""
    import os

    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise ValueError(f"{what} {path}: {d} is not a writable directory")
