"""What a compiled kernel became: its SASS (the GPU's own instructions), through NVIDIA's `nvdisasm`.

Registers and spills (`qgemm compile`) say how big a kernel is; the SASS says what it does. Two
forms of one source line can compile to the same memory instruction and still differ in the
instructions around it -- the skinny kernels' activation loads are the worked example
(common/skinny_common.cuh, SK_XLD32: `__ldg` and a plain load both become LDG.E.128.CONSTANT, the
plain one with 80 fewer instructions around it at 16 tokens). `qgemm compile NAME --arch sm_90
--shape MxNxK --sass` prints the counts; `--sass-dir DIR` keeps the listings for a diff.

`nvdisasm` is not a dependency: it comes with the CUDA toolkit or `pip install
nvidia-cuda-nvdisasm`, and is found by cuda.pathfinder (then on PATH).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass

from .errors import SetupError

# One instruction line of `nvdisasm -c`: "/*0650*/  @!P0 LDG.E.128.CONSTANT R12, desc[UR4][R12.64] ;"
# -- the address, an optional guard predicate, the opcode with its modifiers.
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")

# The label that starts a function's code: ".text.w4a16_skinny:"
_FUNCTION = re.compile(r"^\.text\.([A-Za-z_]\w*):")

# The memory opcodes whose full forms `SassCounts.line` lists: global / shared loads and stores,
# asynchronous copies (cp.async, TMA), ldmatrix / stmatrix, atomics and reductions.
MEMORY = ("LDG", "STG", "LDS", "STS", "LDGSTS", "UTMALDG", "UTMASTG", "LDSM", "STSM", "ATOMG", "ATOMS", "RED", "REDG")

INSTALL_HINT = "install the CUDA toolkit, or `pip install nvidia-cuda-nvdisasm`"


def find_nvdisasm() -> str | None:
    """The nvdisasm executable: where cuda.pathfinder finds it (pip wheels, CUDA_HOME, conda), else PATH."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:  # cuda-pathfinder before its binary-utility lookup
        find_nvidia_binary_utility = None
    if find_nvidia_binary_utility is not None:
        try:
            found = find_nvidia_binary_utility("nvdisasm")
        except Exception:  # an unusual install layout: PATH still decides
            found = None
        if found:
            return found
    return shutil.which("nvdisasm")


def disassemble(cubin: bytes, nvdisasm: str | None = None) -> str:
    """The SASS listing of a cubin (`nvdisasm -c`: code sections only). SetupError without nvdisasm."""
    exe = nvdisasm or find_nvdisasm()
    if exe is None:
        raise SetupError(f"reading SASS needs NVIDIA's nvdisasm, which was not found: {INSTALL_HINT}")
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        run = subprocess.run([exe, "-c", path], capture_output=True, text=True)
    finally:
        os.unlink(path)
    if run.returncode != 0:
        said = run.stderr.strip() or run.stdout.strip()
        raise SetupError(f"{exe} -c failed (exit {run.returncode})" + (f": {said}" if said else ""))
    return run.stdout


@dataclass
class SassCounts:
    """Instructions of a function (by_function fills the counters): `opcodes` by bare opcode (LDG),
    `forms` by opcode with its modifiers (LDG.E.128.CONSTANT). NOPs are not counted: nvdisasm lists the alignment padding
    after a function's last instruction as NOPs, never executed."""

    opcodes: Counter
    forms: Counter

    @property
    def total(self) -> int:
        return sum(self.opcodes.values())

    def line(self, top: int = 8, detail: tuple[str, ...] = MEMORY) -> str:
        """'1384 instructions: LOP3 177, IMAD 124, ...; LDG.E.128.CONSTANT 38, ...' -- the most
        frequent opcodes, then the full forms of the memory opcodes (what a load compiled to)."""
        head = ", ".join(f"{op} {n}" for op, n in self.opcodes.most_common(top))
        mem = ", ".join(f"{form} {n}" for form, n in sorted(self.forms.items()) if form.split(".")[0] in detail)
        return f"{self.total} instructions: {head}" + (f"; {mem}" if mem else "")


def by_function(listing: str) -> dict[str, SassCounts]:
    """Count the instructions of an nvdisasm listing per function (a cubin holds its entry and any
    helpers, e.g. the Mustafar value kernels' mustafar_zero_output), by opcode and by opcode with
    modifiers."""
    out: dict[str, SassCounts] = {}
    current = None
    for text in listing.splitlines():
        label = _FUNCTION.match(text)
        if label:
            current = out.setdefault(label.group(1), SassCounts(Counter(), Counter()))
            continue
        m = _INSTRUCTION.match(text)
        if m and current is not None and m.group(1) != "NOP":
            current.opcodes[m.group(1)] += 1
            current.forms[m.group(1) + m.group(2)] += 1
    return out


# an HGMMA's operands end with `gsb0` when it closes a wgmma group (the scoreboard a later
# WARPGROUP.DEPBAR waits on)
_HGMMA = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?HGMMA\S*\s+([^;]*);")


def serialized_wgmma(listing: str) -> list[str]:
    """The functions of an nvdisasm listing whose wgmma ptxas serialized: two or more HGMMA and
    every one closing its own group (`gsb0`), each then waited for before the next issues. A
    pipelined kernel issues a commit group's wgmma back to back, only the last with `gsb0`.
    ptxas says so in its log (C7513) when it cannot prove the registers of an in-flight wgmma
    untouched, but not always: under register pressure it serialized silently (session 63,
    docs/perf/NOTES.md), so only the SASS tells."""
    found: dict[str, list[int]] = {}
    current = None
    for text in listing.splitlines():
        label = _FUNCTION.match(text)
        if label:
            current = label.group(1)
            continue
        m = _HGMMA.match(text)
        if m and current is not None:
            n = found.setdefault(current, [0, 0])
            n[0] += 1
            n[1] += m.group(1).replace(" ", "").endswith(",gsb0")
    return sorted(f for f, (total, closing) in found.items() if total >= 2 and closing == total)
