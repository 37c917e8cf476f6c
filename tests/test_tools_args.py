"""The scripts under tools/ refuse bad arguments up front, in one line: before any GPU work, any
timing of the shapes ahead of a bad one, or any table printed (found by an audit of tools/). No GPU
needed: where a script needs one, the refusal must come before its "needs a GPU" error."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
NO_GPU = ("needs an NVIDIA GPU", "no GPU:")  # qgemm.runtime's NoGPUError, sanitize_configs' own

_CSV = '''"Kernel Name","w4a16_wgmma_rs",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples","stall_wait"
"0x10","LDS.128 R4, [R8+0x8000]","10","2","10","2"
"0x20","@!P0 BRA 0x10","30","20","30","30"
'''


def _tune(path) -> str:
    """A `qgemm tune --json` file of w4a16.wgmma_rs with two correct timings (split_model.py's input)."""
    cands = [{"config": {"RS_BN": bn, "RS_WGS": 2, "RS_SPLITK": 1}, "us": us, "check": "ok"} for bn, us in ((64, 1.0), (128, 2.0))]
    path.write_text(json.dumps({"kernel": "w4a16.wgmma_rs", "shape": [300, 3072, 7168], "candidates": cands,
                                "environment": {"sm_count": 132}}))
    return str(path)


def _files(tmp_path) -> dict:
    """The inputs the argument lists name as {csv}, {header_csv}, {tune}, ..."""
    files = {"csv": tmp_path / "sass.csv", "header_csv": tmp_path / "header.csv", "rows_1": tmp_path / "rows1.json",
             "rows_str": tmp_path / "rows_str.json", "cand_1": tmp_path / "cand1.json"}
    files["csv"].write_text(_CSV)
    files["header_csv"].write_text(_CSV.split("\n", 2)[0] + "\n" + _CSV.split("\n", 2)[1] + "\n")
    files["rows_1"].write_text(json.dumps({"rows": [1, 2]}))
    # a string with every field name in it: `"shape" in r` held, r["shape"] failed
    files["rows_str"].write_text(json.dumps({"rows": ["shape fmt x_dtype_asked path cold matmul_us config kernel"]}))
    files["cand_1"].write_text(json.dumps({"kernel": "w4a16.wgmma_rs", "shape": [1, 64, 64], "candidates": [1]}))
    out = {k: str(v) for k, v in files.items()}
    out["tune"] = _tune(tmp_path / "tune.json")
    return out


def _run(tmp_path, argv, env=None, timeout=120):
    files = _files(tmp_path)
    argv = [a.format(**files) for a in argv]
    return subprocess.run([sys.executable, str(TOOLS / argv[0]), *argv[1:]], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), "QGEMM_CACHE_DIR": str(tmp_path / "cache"),
                                                **(env or {})})


def _refused(r, said, status=None):
    """Exit status non-zero (or `status`), `said` in the one line on stderr, no traceback, and no GPU
    asked for first."""
    assert r.returncode != 0 if status is None else r.returncode == status, (r.returncode, r.stdout, r.stderr)
    assert said in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not any(g in r.stderr for g in NO_GPU), r.stderr


@pytest.mark.parametrize("shapes,said", [
    ("", "--shapes '': expected a comma-separated list of MxNxK; nothing to time"),
    (" , ", "nothing to time"),
    ("1x64x64,1x64x100", "--shapes '1x64x100': K must be a multiple of 32 (the q4_0 / q8_0 blocks), got K=100"),
    ("1x64x64@cold,2x64x48@cold", "got K=48"),
])
def test_compare_paths_checks_every_shape_before_timing(tmp_path, shapes, said):
    """`--shapes ""` timed nothing and wrote a JSON of no rows; a K not a multiple of 32 was found
    only when its shape came, after the shapes before it were timed."""
    out = tmp_path / "out.json"
    r = _run(tmp_path, ["compare_paths.py", "--shapes", shapes, "--json", str(out)])
    _refused(r, said)
    assert not out.exists()


@pytest.mark.parametrize("argv,env,said", [
    (["pdl_probe.py"], {"REPS": "0"}, "REPS must be a positive integer (repetitions per shape), got '0'"),
    (["pdl_probe.py"], {"REPS": "-2"}, "REPS must be a positive integer (repetitions per shape), got '-2'"),
    (["pdl_probe.py"], {"REPS": "x"}, "REPS must be a positive integer (repetitions per shape), got 'x'"),
    (["probe_defines.py", "w4a16.skinny", "1x4096x4096", "base", "--reps", "0"], {}, "argument --reps: expected a positive integer, got '0'"),
    (["probe_defines.py", "w4a16.skinny", "1x4096x4096", "base", "--iters", "0"], {}, "argument --iters: expected a positive integer"),
    (["sweep_order.py", "--rounds", "-1"], {}, "argument --rounds: expected a positive integer, got '-1'"),
    (["sweep_order.py", "--iters", "0"], {}, "argument --iters: expected a positive integer, got '0'"),
    (["kv_probe.py", "mustafar.key_q2", "32x16384x128", "base", "--reps", "0"], {}, "argument --reps: expected a positive integer"),
    (["kv_probe.py", "mustafar.key_q2", "32x16384x128", "base", "--iters", "0"], {}, "argument --iters: expected a positive integer"),
    (["ncu_source_top.py", "{csv}", "--top", "0"], {}, "argument --top: expected a positive integer, got '0'"),
    (["ncu_source_top.py", "{csv}", "--top", "-1"], {}, "argument --top: expected a positive integer, got '-1'"),
    (["ncu_source_top.py", "{csv}", "--top=-3"], {}, "argument --top: expected a positive integer, got '-3'"),
    (["split_model.py", "{tune}", "--overhead", "nan"], {}, "--overhead must be finite and >= 0, got nan"),
    (["split_model.py", "{tune}", "--overhead", "inf"], {}, "--overhead must be finite and >= 0, got inf"),
    (["split_model.py", "{tune}", "--rate", "64x2=nan"], {}, "a positive finite rate; got '64x2=nan'"),
    (["split_model.py", "{tune}", "--rate", "64x2=inf"], {}, "a positive finite rate; got '64x2=inf'"),
])
def test_counts_and_numbers_are_refused_up_front(tmp_path, argv, env, said):
    """Counts of 0 or less timed nothing and exited 0 (or printed all but the last rows: --top -1),
    REPS=x did not say which setting was wrong, and a nan or inf cost-model number went into the
    model (an rms error of nan%, or a ZeroDivisionError traceback)."""
    _refused(_run(tmp_path, argv, env), said, status=2)


@pytest.mark.parametrize("argv,said", [
    (["--shapes", "1x4096x4096,512x4096"], "--shapes: shape must be MxNxK with positive integers"),
    (["--shapes", "1x4096x4096,512x4096x100"], "--shapes 512x4096x100: K must be a multiple of 32 (the q4_0 blocks), got K=100"),
    (["--shapes", "1x4096x4096,"], "--shapes: shape must be MxNxK"),
    (["--kv-shapes", "32x4096"], "--kv-shapes: shape must be BxSxD with positive integers"),
    (["--kv-shapes", "32x4096x128,32x4096x96"], "--kv-shapes 32x4096x96: head dim D must be one of"),
    (["--fmt", "q5_0"], "--fmt must be q4_0 or q8_0, got 'q5_0'"),
    (["--table", ""], "--table: expected the path of a host_overhead.py --json file, got an empty path"),
    (["--table", "{rows_1}"], "not a host_overhead.py --json file (expected 'rows': a list of objects"),
])
def test_host_overhead_checks_shapes_and_tables_up_front(tmp_path, argv, said):
    """Shapes were parsed inside the timing loop (the first shape timed, then "not enough values to
    unpack"); `--table ""` was taken for no --table; rows that are not objects were an
    AttributeError traceback. All before torch is imported or a GPU is asked for."""
    r = _run(tmp_path, ["host_overhead.py", *argv])
    _refused(r, said, status=2)
    assert "needs torch" not in r.stderr and not r.stdout


@pytest.mark.parametrize("argv,said", [
    (["ab_report.py", "--old", "{rows_1}", "--new", "{rows_1}"], "a row of {rows_1} is not an object (a int)"),
    (["ab_report.py", "--old", "{rows_str}", "--new", "{rows_str}"], "--old: a row of {rows_str} is not an object (a str)"),
    (["split_model.py", "{cand_1}"], "{cand_1}: not the output of `qgemm tune --json` (expected candidates: a list of objects"),
])
def test_json_readers_say_what_structure_they_expected(tmp_path, argv, said):
    """Rows or candidates that are not objects were a TypeError / AttributeError traceback."""
    r = _run(tmp_path, argv)
    _refused(r, said.format(**_files(tmp_path)), status=2)


def test_fold_error_and_quant_error_refuse_before_printing(tmp_path):
    """fold_error.py's negative seed was numpy's traceback; quant_error.py printed a table of
    zeros for --rows 0 and its header before refusing --k 100."""
    _refused(_run(tmp_path, ["fold_error.py", "--seed", "-3"]), "--seed must be >= 0, got -3", status=2)
    for argv, said in ((["--rows", "0"], "--rows must be at least 1, got 0"),
                       (["--k", "100"], "--k must be a positive multiple of 32 (one block), got 100"),
                       (["--seed", "-1"], "--seed must be >= 0, got -1")):
        r = _run(tmp_path, ["quant_error.py", *argv])
        _refused(r, said, status=2)
        assert r.stdout == "", r.stdout


def test_every_tool_ends_in_run_tool():
    """What a user can fix is one line and exit 2 in every script (fold_error.py was the one
    without run_tool)."""
    for path in sorted(TOOLS.glob("*.py")):
        assert f'sys.exit(run_tool(main, "{path.stem}"))' in path.read_text(), path.name


def test_gpu_ncu_names_an_unknown_kernel_in_one_line(tmp_path):
    """The entry-point lookup was a bare `python -c`: a misspelt KERNELS name was a traceback."""
    r = subprocess.run(["bash", str(TOOLS / "gpu_ncu.sh")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "NCU": "/bin/true", "KERNELS": "w4a16.nope", "OUT": str(tmp_path / "ncu"),
                            "PYTHON": sys.executable, "QGEMM_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("gpu_ncu: error: no kernel named 'w4a16.nope'"), r.stderr


@pytest.mark.parametrize("argv,said", [
    (["--shapes", "7x33x32,1x33x100"], "--shapes 1x33x100: K must be a multiple of 32 for w4a16.wgmma_rs, got K=100"),
    (["--shapes", "7x33x32", "--timeout", "-1"], "--timeout must be a positive number of seconds, got -1"),
    (["--shapes", "7x33x32", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
])
def test_sanitize_configs_checks_shapes_and_timeout_in_the_parent(tmp_path, argv, said):
    """A K the kernel cannot take made every configuration FAILED with the child's reason hidden;
    --timeout -1 made every one TIMED OUT."""
    r = _run(tmp_path, ["sanitize_configs.py", "memcheck", "w4a16.wgmma_rs", "--sanitizer", "/bin/true", *argv])
    _refused(r, said, status=2)
    assert "FAILED" not in r.stdout and "TIMED OUT" not in r.stdout


@pytest.mark.parametrize("argv,said", [
    (["probe_defines.py", "w4a16.skinny", "1x4096x4096", "base", "a=@mustafar.key_q2"],
     "variant a=@mustafar.key_q2: mustafar.key_q2 has no launch configuration"),
    (["probe_defines.py", "w4a16.skinny", "1x4096x4096", "base", "a=@w4a16.naive"], "w4a16.naive has no launch configuration"),
    (["probe_defines.py", "w4a16.skinny", "1x4096x4096", "=SK_UNROLL=1"], "variant '=SK_UNROLL=1': the label before '=' is empty"),
    (["probe_defines.py", "w4a16.skinny", "1x4096x4096", "base", "u=SK_UNROLL=2", "base"], "each label once, got 'base' more than once"),
    (["probe_defines.py", "w4a16.skinny", "1x4096x4096,1x4096x100", "base"], "K must be a multiple of 32 for w4a16.skinny, got K=100"),
    (["pdl_probe.py", "1x4096x4096:q4_0,8x4096x100:q8_0"], "'8x4096x100:q8_0': K must be a multiple of 32"),
    (["kv_probe.py", "mustafar.key_q2", "32x16384x128", "base", "base"], "each label once, got 'base' more than once"),
    (["kv_probe.py", "mustafar.key_q2", "32x16384x128", "base", "=MF_SORT=0"], "the label before '=' is empty"),
    (["kv_probe.py", "mustafar.key_q2", "32x16384x128", "base", "a=@mustafar.key_q4"], "variant a=@mustafar.key_q4: expected label"),
])
def test_variants_and_shapes_are_what_the_probes_take(tmp_path, argv, said):
    """A variant @KERNEL of a kernel without a launch configuration was timed as the base
    configuration; an empty label was accepted; kv_probe.py merged two variants of one label into
    one; a K the kernel cannot take was found after the shapes before it were timed."""
    _refused(_run(tmp_path, argv), said, status=2)


def test_ncu_source_top_says_a_header_alone_has_no_rows(tmp_path):
    """A header-only CSV printed `0 SASS instructions, 1 stall samples` (the 1 of a guard)."""
    files = _files(tmp_path)
    r = _run(tmp_path, ["ncu_source_top.py", "{header_csv}"])
    _refused(r, f"{files['header_csv']}: no instruction rows under the source-page header", status=2)
    assert r.stdout == ""


def test_good_arguments_get_past_the_checks(tmp_path):
    """The checks above refuse only what is wrong: the scripts that need no GPU run, and the GPU
    scripts given good arguments get as far as asking for one."""
    for argv in (["ncu_source_top.py", "{csv}", "--top", "1"], ["split_model.py", "{tune}", "--rate", "64x2=0.7"],
                 ["quant_error.py", "--rows", "2", "--k", "64"], ["fold_error.py", "--m", "2", "--n", "32", "--k", "128", "--seed", "1"]):
        r = _run(tmp_path, argv)
        assert r.returncode == 0 and r.stdout, (argv, r.stderr)
    from qgemm import runtime

    if runtime.gpu_available():
        pytest.skip("a GPU is here: the GPU scripts would run their timings")
    for argv, env in ((["compare_paths.py", "--shapes", "1x64x64,2x64x96@cold"], {}),
                      (["pdl_probe.py", "1x64x64:q4_0"], {"REPS": "1"}),
                      (["probe_defines.py", "w8a16.skinny_f16", "2x4096x4096", "base", "f32cfg=@w8a16.skinny", "u=SK_UNROLL=2",
                        "--reps", "1", "--iters", "1"], {}),
                      (["sweep_order.py", "--rounds", "1", "--iters", "1"], {}),
                      (["kv_probe.py", "mustafar.key_q2", "32x16384x128", "base", "u=MF_SORT=0", "--reps", "1"], {}),
                      (["sanitize_configs.py", "memcheck", "w4a16.wgmma_rs", "--shapes", "7x33x32", "--sanitizer", "/bin/true",
                        "--timeout", "5"], {})):
        r = _run(tmp_path, argv, env)
        assert r.returncode == 2 and any(g in r.stderr for g in NO_GPU), (argv, r.stderr)
    r = _run(tmp_path, ["host_overhead.py", "--shapes", "1x64x64", "--kv-shapes", "", "--calls", "4"])
    assert r.returncode != 0 and ("needs torch" in r.stderr or any(g in r.stderr for g in NO_GPU)), r.stderr
