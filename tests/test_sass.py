"""qgemm.sass and `qgemm compile --sass`: SASS instruction counts (nvdisasm, optional)."""
import pytest
from typer.testing import CliRunner

from qgemm import jit, sass
from qgemm.cli import app
from qgemm.errors import SetupError

runner = CliRunner()
HAVE_NVDISASM = sass.find_nvdisasm() is not None

# the shape of `nvdisasm -c` output: headers, two functions, guard predicates, padding NOPs
LISTING = """\
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
//--------------------- .text.kern_a           --------------------------
\t.section\t.text.kern_a,"ax",@progbits
\t.sectioninfo\t@"SHI_REGISTERS=40"
.text.kern_a:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128.CONSTANT R12, desc[UR4][R12.64] ;
        /*0020*/               @P0 LDG.E.128.CONSTANT R16, desc[UR4][R2.64+0x40] ;
        /*0030*/              @!P1 LEA R4, P2, R6, UR8, 0x2 ;
        /*0040*/                   LEA.HI.X R5, R6, UR9, R7, 0x2, P2 ;
        /*0050*/              @!UPT UIADD3 UR4, UPT, UPT, UR4, 0x1, URZ ;
        /*0060*/                   EXIT ;
.L_x_0:
        /*0070*/                   BRA `(.L_x_0) ;
        /*0080*/                   NOP;
        /*0090*/                   NOP;
//--------------------- .text.kern_b           --------------------------
.text.kern_b:
        /*0000*/                   STG.E desc[UR4][R2.64], R5 ;
        /*0010*/                   EXIT ;
"""


def test_counts_per_function_with_predicates_and_without_padding():
    counts = sass.by_function(LISTING)
    assert list(counts) == ["kern_a", "kern_b"]
    a, b = counts["kern_a"], counts["kern_b"]
    assert a.total == 8 and b.total == 2  # the NOPs after kern_a's last branch are not instructions it runs
    assert a.opcodes["LDG"] == 2 and a.opcodes["LEA"] == 2 and a.opcodes["UIADD3"] == 1 and "NOP" not in a.opcodes
    assert a.forms["LDG.E.128.CONSTANT"] == 2 and a.forms["LEA.HI.X"] == 1 and a.forms["LEA"] == 1
    line = a.line(top=2)
    assert line.startswith("8 instructions: LDG 2, LEA 2") and line.endswith("; LDG.E.128.CONSTANT 2"), line
    assert b.line().endswith("; STG.E 1")


def test_a_missing_or_failing_nvdisasm_is_said_clearly(monkeypatch, tmp_path):
    with pytest.raises(SetupError, match=r"^/bin/false -c failed \(exit 1\)$"):
        sass.disassemble(b"not a cubin", "/bin/false")
    monkeypatch.setattr(sass, "find_nvdisasm", lambda: None)
    with pytest.raises(SetupError, match="needs NVIDIA's nvdisasm.*pip install nvidia-cuda-nvdisasm"):
        sass.disassemble(b"")
    r = runner.invoke(app, ["compile", "w4a16.skinny", "--arch", "sm_90", "--sass"])
    assert r.exit_code == 2 and "--sass needs NVIDIA's nvdisasm" in r.output and "pip install" in r.output, r.output
    r = runner.invoke(app, ["compile", "w4a16.skinny", "--arch", "sm_90", "--sass-dir", str(tmp_path)])
    assert r.exit_code == 2 and "nvdisasm" in r.output, r.output


@pytest.mark.skipif(not HAVE_NVDISASM, reason="nvdisasm not installed (CUDA toolkit or pip install nvidia-cuda-nvdisasm)")
def test_compile_sass_counts_the_plain_load_saving(tmp_path, monkeypatch):
    """What common/skinny_common.cuh says of SK_XLD32, by the command it cites: the plain float32
    load and `__ldg` compile to the same LDG forms, the plain one with fewer instructions around
    them; --sass-dir keeps the listing, and refuses a file in its place."""
    monkeypatch.setenv("QGEMM_CACHE_DIR", str(tmp_path / "cache"))
    jit.clear_memo()
    argv = ["compile", "w4a16.skinny", "--arch", "sm_90", "--shape", "16x4096x4096", "--sass"]
    out = {}
    for label, extra in (("plain", []), ("ldg", ["-D", "SK_XLD32=0"])):
        r = runner.invoke(app, argv + extra + ["--sass-dir", str(tmp_path / label)])
        assert r.exit_code == 0, r.output
        line = next(x for x in r.output.splitlines() if "w4a16.skinny (sm_90) w4a16_skinny:" in x)
        listing = (tmp_path / label / "w4a16.skinny.sm_90.sass").read_text()
        counts = sass.by_function(listing)["w4a16_skinny"]
        assert f"w4a16_skinny: {counts.line()}" in line and counts.opcodes["HMMA"] > 0
        out[label] = counts
    loads = lambda c: {f: n for f, n in c.forms.items() if f.startswith("LDG")}
    assert loads(out["plain"]) == loads(out["ldg"]) and "LDG.E.128.CONSTANT" in loads(out["plain"])
    assert out["plain"].total < out["ldg"].total and out["plain"].opcodes["LEA"] < out["ldg"].opcodes["LEA"]
    (tmp_path / "afile").write_text("x")
    r = runner.invoke(app, ["compile", "w4a16.skinny", "--arch", "sm_90", "--sass-dir", str(tmp_path / "afile")])
    assert r.exit_code == 2 and "is not a directory" in r.output, r.output
    # under a file: refused before anything compiles (it once failed only after the compiles)
    r = runner.invoke(app, ["compile", "fp32.naive", "--arch", "sm_90", "--sass-dir", str(tmp_path / "afile" / "under")])
    assert r.exit_code == 2 and "afile is a file, not a directory" in r.output and "fp32.naive  sm_90" not in r.output, r.output
    jit.clear_memo()


# HGMMA lines as nvdisasm prints them: a pipelined commit group (w8a16.wgmma_rs's default, sm_90a)
# and the serialized form ptxas emitted for session 63's 128 x 256 tiles with 168 registers (its
# second HGMMA given a guard predicate here, as nvdisasm prints one)
PIPELINED = """\
//--------------------- .text.piped           --------------------------
.text.piped:
        /*1010*/                   HGMMA.64x256x16.F32 R24, R152, gdesc[UR12], R24 ;
        /*1180*/                   HGMMA.64x256x16.F32 R24, R156, gdesc[UR12], R24 ;
        /*11d0*/                   HGMMA.64x256x16.F32 R24, R160, gdesc[UR12], R24 ;
        /*1210*/                   HGMMA.64x256x16.F32 R24, R164, gdesc[UR12], R24, gsb0 ;
        /*1250*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
"""
SERIALIZED = """\
//--------------------- .text.serial          --------------------------
.text.serial:
        /*0fb0*/                   WARPGROUP.ARRIVE ;
        /*0fc0*/                   HGMMA.64x256x16.F32 R24, R160, gdesc[UR16], R24, gsb0 ;
        /*0fd0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*1140*/                   WARPGROUP.ARRIVE ;
        /*1150*/              @P0 HGMMA.64x256x16.F32 R24, R160, gdesc[UR16], R24, gsb0 ;
        /*1180*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""
ONE = """\
//--------------------- .text.single          --------------------------
.text.single:
        /*0100*/                   HGMMA.64x64x16.F32 R24, R152, gdesc[UR4], RZ, !UPT, gsb0 ;
"""


def test_serialized_wgmma_is_read_from_the_sass():
    """A function counts as serialized when every one of its (two or more) HGMMA closes its own
    group; one whose groups hold several wgmma, or with a single HGMMA, does not."""
    assert sass.serialized_wgmma(PIPELINED) == []
    assert sass.serialized_wgmma(SERIALIZED) == ["serial"]
    assert sass.serialized_wgmma(ONE) == []
    assert sass.serialized_wgmma(PIPELINED + SERIALIZED + ONE) == ["serial"]
    assert sass.serialized_wgmma(LISTING) == []  # no wgmma at all
