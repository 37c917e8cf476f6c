"""The developer tools under tools/ that parse their own input (no GPU needed)."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_defines_parses_variants():
    pd = _load("probe_defines")
    assert pd.parse_variant("base") == ("base", {})
    assert pd.parse_variant("g4=RS_GROUPS=4") == ("g4", {"RS_GROUPS": 4})
    assert pd.parse_variant("both=RS_A=1;RS_B=0") == ("both", {"RS_A": 1, "RS_B": 0})
    for bad in ("x=RS_A", "x=RS_A=one", "x==1"):
        with pytest.raises((SystemExit, ValueError)):
            pd.parse_variant(bad)


# the shape of `ncu --import R --page source --csv --print-source sass` (Nsight Compute 2025)
_CSV = '''"Kernel Name","w4a16_wgmma_rs",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x10","LDS.128 R4, [R8+0x8000]","10","2","10","8","2","1"
"0x20","PRMT R5, R4, 0x5140, R6","30","20","30","0","30","0"
"0x30","@!P0 BRA 0x10","60","40","60","60","0","40"
'''


def test_ncu_source_top_ranks_instructions(tmp_path):
    f = tmp_path / "sass.csv"
    f.write_text(_CSV)
    out = subprocess.run([sys.executable, str(TOOLS / "ncu_source_top.py"), str(f), "--top", "2"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert "3 SASS instructions, 100 stall samples" in lines[0]
    assert "60.0%" in lines[1] and "BRA" in lines[1] and "long_sb 60.0%" in lines[1]
    assert "30.0%" in lines[2] and "PRMT" in lines[2] and "wait 30.0%" in lines[2]
    assert not lines[3].strip()  # --top 2: the 10% LDS is left out
    reasons = out[out.index("by stall reason:"):out.index("by opcode:")]
    assert "68.0%  long_sb" in reasons and "32.0%  wait" in reasons
    assert "60.0%  BRA" in out[out.index("by opcode:"):]


def test_ncu_source_top_rejects_other_files(tmp_path):
    f = tmp_path / "not.csv"
    f.write_text("Duration,1\n")
    r = subprocess.run([sys.executable, str(TOOLS / "ncu_source_top.py"), str(f)], capture_output=True, text=True)
    assert r.returncode != 0 and "no source-page header" in r.stderr
