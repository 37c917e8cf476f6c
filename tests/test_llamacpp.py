"""llama.cpp side by side: the test-backend-ops parser on real outputs (tests/data, measured on
an H100 and an H200), the subprocess runner, compare(), and `qgemm compare-llamacpp`."""

import json
import re
import stat
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qgemm import llamacpp, runtime, tutorial
from qgemm.cli import app

DATA = Path(__file__).parent / "data"
H100 = DATA / "ggml-test-backend-ops-perf-mul_mat-h100.txt"
H200 = DATA / "ggml-test-backend-ops-perf-mul_mat-h200.txt"
NO_GPU = not runtime.gpu_available()
runner = CliRunner()


def _row(rows, type_, m, n, k):
    found = [r for r in rows if (r["type"], r["M"], r["N"], r["K"]) == (type_, m, n, k)]
    assert len(found) == 1, (type_, m, n, k)
    return found[0]


def test_parse_h100_exact_values():
    rows = llamacpp.parse_test_backend_ops(H100.read_text())
    assert len(rows) == 24
    assert Counter(r["type"] for r in rows) == {"q4_0": 8, "q8_0": 8, "f16": 8}
    assert {r["device"] for r in rows} == {"NVIDIA H100 80GB HBM3"}
    assert {r["backend"] for r in rows} == {"CUDA0"}
    # ggml m=4096, n=512, k=14336 is qgemm M=512 (tokens), N=4096 (output features), K=14336
    r = _row(rows, "q4_0", 512, 4096, 14336)
    assert (r["us"], r["runs"], r["tflops"], r["type_b"], r["batched"]) == (312.80, 3198, 192.23, "f32", False)
    assert r["params"]["m"] == 4096 and r["params"]["n"] == 512 and r["params"]["per"] == [0, 1, 2, 3]
    assert r["raw"].startswith("MUL_MAT(type_a=q4_0,type_b=f32,m=4096,n=512,k=14336,") and r["raw"].endswith("192.23 TFLOPS")
    r = _row(rows, "f16", 1, 4096, 14336)
    assert (r["us"], r["runs"], r["tflops"]) == (40.49, 24708, 2.90)
    r = _row(rows, "q8_0", 2048, 4096, 4096)
    assert (r["us"], r["runs"], r["tflops"]) == (349.03, 2866, 196.89)
    r = _row(rows, "q4_0", 1, 4096, 4096)
    assert (r["us"], r["runs"], r["tflops"]) == (6.40, 157993, 5.24)


def test_parse_h200_exact_values():
    rows = llamacpp.parse_test_backend_ops(H200.read_text())
    assert len(rows) == 24
    assert Counter(r["type"] for r in rows) == {"q4_0": 8, "q8_0": 8, "f16": 8}
    assert {r["device"] for r in rows} == {"NVIDIA H200"}
    r = _row(rows, "q4_0", 512, 4096, 14336)
    assert (r["us"], r["runs"], r["tflops"]) == (317.51, 3150, 189.38)
    r = _row(rows, "q8_0", 64, 4096, 4096)
    assert (r["us"], r["runs"], r["tflops"]) == (27.71, 36096, 77.50)
    r = _row(rows, "f16", 2048, 4096, 4096)
    assert (r["us"], r["runs"], r["tflops"]) == (163.37, 6122, 420.64)


@pytest.mark.parametrize("path", [H100, H200], ids=["h100", "h200"])
def test_parsed_shapes_agree_with_the_reported_rates(path):
    # 2*M*N*K / time must give the line's own TFLOPS: catches a swapped m/n/k or a unit slip
    rows = llamacpp.parse_test_backend_ops(path.read_text())
    assert len(rows) >= 20, len(rows)  # the shipped files' timed lines (an empty parse would check nothing)
    for r in rows:
        tflops = 2 * r["M"] * r["N"] * r["K"] / (r["us"] * 1e-6) / 1e12
        assert tflops == pytest.approx(r["tflops"], rel=0.01), r["raw"]


def test_parser_agrees_with_the_tutorials_figures():
    mine = [(r["type"], r["M"], r["N"], r["K"], r["us"]) for r in llamacpp.parse_test_backend_ops(H100.read_text())]
    theirs = [(f["type"], f["M"], f["N"], f["K"], f["us"]) for f in tutorial.llamacpp_figures("h100")]
    assert mine == theirs


def test_parser_ansi_units_backends_and_skipped_lines():
    text = "\n".join([
        "ggml_cuda_init: found 2 CUDA devices:",
        "  Device 0: NVIDIA A100-SXM4-80GB, compute capability 8.0, VMM: yes",
        "  Device 1: NVIDIA L4, compute capability 8.9, VMM: yes",
        "Testing 3 devices",
        "",
        "Backend 1/3: CUDA0",
        "  Device description: NVIDIA A100-SXM4-80GB",
        "  MUL_MAT(type_a=q4_0,type_b=f32,m=4096,n=1,k=4096,bs=[1,1],nr=[1,1],per=[0,1,2,3],v=0):      \x1b[0m"
        "   1000 runs -    10.00 us/run -  33.55 MFLOP/run - \x1b[1;34m  3.36 TFLOPS\x1b[0m",
        "  MUL_MAT(type_a=q4_K,type_b=f32,m=4096,n=1,k=4096,bs=[1,1],nr=[1,1],per=[0,1,2,3],v=0): not supported",
        "  MUL_MAT(type_a=q8_0,type_b=f16,m=64,n=16,k=256,bs=[10,1],nr=[2,1],per=[0,1,2,3],v=0):  "
        "   744 runs -  1660.11 us/run - 134.48 MFLOP/run - \x1b[1;34m 81.01 GFLOPS\x1b[0m",
        "  ADD(type=f32,ne=[10,5,4,3]):   8192 runs -     1.23 us/run -       2 kB/run -    1.50 GB/s",
        "  Backend CUDA0: \x1b[1;32mOK\x1b[0m",
        "Backend 2/3: CUDA1",
        "  Device description: NVIDIA L4",
        "  MUL_MAT(type_a=f16,type_b=f32,m=32,n=8,k=64,bs=[1,1],nr=[1,1],per=[0,1,2,3],v=0):   5 runs - 2.00 us/run - 32.77 kFLOP/run - 16.38 GFLOPS",
        "Backend 3/3: CPU",
        "  Skipping",
    ])
    rows = llamacpp.parse_test_backend_ops(text)
    assert len(rows) == 3
    a, b, c = rows
    assert (a["type"], a["M"], a["N"], a["K"], a["us"], a["tflops"]) == ("q4_0", 1, 4096, 4096, 10.0, 3.36)
    assert (a["device"], a["backend"], a["batched"]) == ("NVIDIA A100-SXM4-80GB", "CUDA0", False)
    assert "\x1b" not in a["raw"]
    assert (b["type"], b["type_b"], b["M"], b["N"], b["K"], b["runs"]) == ("q8_0", "f16", 16, 64, 256, 744)
    assert b["tflops"] == pytest.approx(0.08101) and b["batched"] is True and b["params"]["bs"] == [10, 1]
    assert (c["type"], c["device"], c["backend"], c["tflops"]) == ("f16", "NVIDIA L4", "CUDA1", pytest.approx(0.01638))


def test_parser_device0_fallback_and_empty():
    text = ("  Device 0: NVIDIA H100 PCIe, compute capability 9.0, VMM: yes\n"
            "  MUL_MAT(type_a=q8_0,type_b=f32,m=128,n=8,k=256,bs=[1,1],nr=[1,1]):  10 runs - 5.00 us/run - 524.29 kFLOP/run - 104.86 GFLOPS\n")
    (r,) = llamacpp.parse_test_backend_ops(text)
    assert r["device"] == "NVIDIA H100 PCIe" and r["backend"] is None and (r["M"], r["N"], r["K"]) == (8, 128, 256)
    assert llamacpp.parse_test_backend_ops("Testing 0 devices\nOK\n") == []


# ---------------------------------------------------------------------------------------------
# compare()


def test_compare_ratio_notes_and_types():
    rows = llamacpp.parse_test_backend_ops(H100.read_text())
    calls = []

    def timer(type_, m, n, k):
        calls.append((type_, m, n, k))
        if type_ == "f16":
            raise ValueError("no f16 path")
        return {"q4_0": 2.0, "q8_0": 4.0}[type_] * (m + 1)

    out = llamacpp.compare(rows, timer)
    assert len(out) == 24 and len(calls) == 24
    r = _row(out, "q4_0", 512, 4096, 14336)
    assert r["qgemm_us"] == 2.0 * 513 and r["ratio"] == pytest.approx(312.80 / (2.0 * 513)) and r["note"] == ""
    r = _row(out, "f16", 8, 4096, 4096)
    assert r["qgemm_us"] is None and r["ratio"] is None and r["note"] == "qgemm: no f16 path"
    assert "qgemm_us" not in rows[0]  # the input rows are left alone
    only = llamacpp.compare(rows, timer, types=["Q8_0"])
    assert [r["type"] for r in only] == ["q8_0"] * 8
    assert ("q8_0", 2048, 4096, 4096) in calls


def test_compare_skips_batched_and_non_f32_activations():
    base = {"type": "q4_0", "type_b": "f32", "M": 8, "N": 64, "K": 64, "us": 10.0, "runs": 1, "tflops": None,
            "device": None, "backend": None, "batched": False, "params": {}, "raw": ""}
    rows = [base, dict(base, batched=True), dict(base, type_b="f16")]
    out = llamacpp.compare(rows, lambda *a: 5.0)
    assert [r["ratio"] for r in out] == [2.0, None, None]
    assert "batched" in out[1]["note"] and "f16" in out[2]["note"]


# ---------------------------------------------------------------------------------------------
# running the user's binary (a shell script stands in for test-backend-ops here)


def _script(tmp_path, name, body, executable=True):
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body)
    if executable:
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def test_run_passes_perf_args_and_returns_stdout(tmp_path):
    exe = _script(tmp_path, "test-backend-ops",
                  f'[ "$1 $2 $3" = "perf -o MUL_MAT" ] || {{ echo "bad args: $*" >&2; exit 9; }}\n'
                  f'[ "$4 $5" = "-b CUDA0" ] || {{ echo "bad backend: $*" >&2; exit 8; }}\ncat "{H100}"\n')
    text = llamacpp.run_test_backend_ops(exe, timeout=30, extra_args=["-b", "CUDA0"])
    assert text == H100.read_text()
    with pytest.raises(RuntimeError, match=r"(?s)status 8.*bad backend: perf -o MUL_MAT"):
        llamacpp.run_test_backend_ops(exe, timeout=30)


def test_run_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file.*test-backend-ops"):
        llamacpp.run_test_backend_ops(tmp_path / "missing")
    plain = _script(tmp_path, "not-exec", "exit 0\n", executable=False)
    with pytest.raises(PermissionError, match="not executable"):
        llamacpp.run_test_backend_ops(plain)
    (tmp_path / "build" / "bin").mkdir(parents=True)
    _script(tmp_path / "build" / "bin", "test-backend-ops", "exit 0\n")
    with pytest.raises(PermissionError, match=r"is a directory.*did you mean .*build/bin/test-backend-ops"):
        llamacpp.run_test_backend_ops(tmp_path / "build")
    failing = _script(tmp_path, "failing", 'echo "line $1" ; echo "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device" >&2; exit 3\n')
    with pytest.raises(RuntimeError, match=r"exited with status 3.*\n.*no CUDA-capable device"):
        llamacpp.run_test_backend_ops(failing)
    slow = _script(tmp_path, "slow", "exec sleep 5\n")
    with pytest.raises(RuntimeError, match="ran past 0.3 s"):
        llamacpp.run_test_backend_ops(slow, timeout=0.3)


# ---------------------------------------------------------------------------------------------
# the command


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU path")
def test_cli_from_file_without_gpu(tmp_path):
    out = tmp_path / "rows.json"
    r = runner.invoke(app, ["compare-llamacpp", "--from-file", str(H100), "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "NVIDIA H100 80GB HBM3" in r.output and "qgemm column needs an NVIDIA GPU" in r.output
    lines = [ln.split() for ln in r.output.splitlines()]
    assert ["q4_0", "512x4096x14336", "312.80", "192.23", "3198"] in lines
    assert not any(ln and ln[0] == "f16" for ln in lines)  # default --types q4_0,q8_0
    d = json.loads(out.read_text())
    assert len(d["rows"]) == 16 and d["llamacpp_device"] == "NVIDIA H100 80GB HBM3"
    r = runner.invoke(app, ["compare-llamacpp", "--from-file", str(H200), "--types", "all"])
    assert r.exit_code == 0 and ["f16", "2048x4096x4096", "163.37", "420.64", "6122"] in [ln.split() for ln in r.output.splitlines()]


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU path")
def test_cli_runs_the_binary(tmp_path):
    exe = _script(tmp_path, "test-backend-ops", f'cat "{H200}"\n')
    r = runner.invoke(app, ["compare-llamacpp", "--test-backend-ops", str(exe), "--types", "q8_0"])
    assert r.exit_code == 0, r.output
    assert ["q8_0", "512x4096x14336", "317.25", "189.53", "3154"] in [ln.split() for ln in r.output.splitlines()]


@pytest.mark.parametrize("args,match", [
    ([], "exactly one of --test-backend-ops"),
    (["--from-file", str(H100), "--test-backend-ops", "/bin/true"], "exactly one of"),
    (["--from-file", str(H100), "--types", "q4_k"], "no q4_k lines.*it has: f16, q4_0, q8_0"),
    (["--from-file", "/nonexistent/out.txt"], "out.txt"),
    (["--test-backend-ops", "/nonexistent/test-backend-ops"], "no such file"),
])
def test_cli_errors(args, match):
    r = runner.invoke(app, ["compare-llamacpp", *args])
    assert r.exit_code == 2
    assert re.search(match, r.output), r.output


def test_cli_no_lines(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("Testing 2 devices\n\nBackend 1/2: CUDA0\n  Skipping\nOK\n")
    r = runner.invoke(app, ["compare-llamacpp", "--from-file", str(p)])
    assert r.exit_code == 2 and "no timed MUL_MAT lines" in r.output


@pytest.mark.gpu
def test_cli_side_by_side_on_gpu(tmp_path):
    p = tmp_path / "small.txt"
    p.write_text("Backend 1/2: CUDA0\n  Device description: some GPU\n"
                 "  MUL_MAT(type_a=q4_0,type_b=f32,m=256,n=64,k=512,bs=[1,1],nr=[1,1]):  100 runs - 5.00 us/run - 16.78 MFLOP/run - 3.36 TFLOPS\n"
                 "  MUL_MAT(type_a=q8_0,type_b=f32,m=256,n=4,k=512,bs=[1,1],nr=[1,1]):  100 runs - 4.00 us/run - 1.05 MFLOP/run - 0.26 TFLOPS\n")
    out = tmp_path / "rows.json"
    r = runner.invoke(app, ["compare-llamacpp", "--from-file", str(p), "--iters", "3", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "ratios compare different GPUs" in r.output  # "some GPU" is not this one
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(row["note"] == "llama.cpp on some GPU (CUDA0)" for row in rows), rows
    for row in rows:
        assert row["qgemm_us"] > 0 and row["ratio"] == pytest.approx(row["us"] / row["qgemm_us"]), row
    # timed the way test-backend-ops times its own rows: back to back for a while (0.05 s here)
    r = runner.invoke(app, ["compare-llamacpp", "--from-file", str(p), "--iters", "3", "--sustain", "0.05", "--json", str(out)])
    assert r.exit_code == 0 and "sampled back to back for >= 0.05 s" in r.output, r.output
    assert all(row["qgemm_us"] > 0 for row in json.loads(out.read_text())["rows"])


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU path")
def test_cli_from_file_without_gpu_tells_rows_apart(tmp_path):
    """Session 69's audit: without a GPU, a plain, a batched and an f16-activation line of one
    shape printed as three identical rows (the notes came only with the GPU's column), and a
    --types list with a type absent from the file dropped it silently."""
    line = ("  MUL_MAT(type_a=q4_0,type_b={b},m=4096,n=1,k=4096,bs={bs},nr=[1,1],per=[0,1,2,3],k_v=0,o=1): "
            "30000 runs -    20.00 us/run -  33.55 MFLOP/run -   1.68 TFLOPS\n")
    p = tmp_path / "tbo.txt"
    p.write_text(line.format(b="f32", bs="[1,1]") + line.format(b="f32", bs="[2,1]") + line.format(b="f16", bs="[1,1]"))
    r = runner.invoke(app, ["compare-llamacpp", "--from-file", str(p), "--types", "q4_0,bogus"])
    assert r.exit_code == 0, r.output
    rows = [ln for ln in r.output.splitlines() if ln.startswith("q4_0")]
    assert len(rows) == 3 and len(set(rows)) == 3, rows
    assert rows[0].split()[-1] == "30000" and "batched" in rows[1] and "activations f16" in rows[2]
    assert "warning: no bogus lines" in r.output and "it has: q4_0" in r.output
