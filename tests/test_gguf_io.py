"""GGUF in: real files written by gguf.GGUFWriter (weights quantized by gguf.quants), read back
through qgemm.gguf_io. No mocks: every file here is a GGUF file ggml's own writer produced,
or one cut/garbled on purpose."""

import json
import struct

import numpy as np
import pytest
from typer.testing import CliRunner

import qgemm
from qgemm import gguf_io
from qgemm.cli import app

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

runner = CliRunner()

N, K = 48, 96  # weights W[N, K]: 3 blocks of 32 per row


@pytest.fixture
def model(tmp_path, rng):
    """A small llama-style GGUF file: Q4_0, Q8_0, F16, F32 (matrix and vector), a stacked 3-D
    Q4_0, and two types qgemm does not load (Q5_0 quantized by gguf.quants, Q4_K raw bytes)."""
    src = {
        "blk.0.ffn_down.weight": rng.standard_normal((N, K), dtype=np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((N, K), dtype=np.float32),
        "token_embd.weight": rng.standard_normal((N, K), dtype=np.float32),
        "output.weight": rng.standard_normal((N, K), dtype=np.float32),
        "output_norm.weight": rng.standard_normal((K,), dtype=np.float32),
        "blk.0.ffn_up_exps.weight": rng.standard_normal((2, N, K), dtype=np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((N, K), dtype=np.float32),
    }
    written = {
        "blk.0.ffn_down.weight": (gguf.quants.quantize(src["blk.0.ffn_down.weight"], T.Q4_0), T.Q4_0),
        "blk.0.attn_q.weight": (gguf.quants.quantize(src["blk.0.attn_q.weight"], T.Q8_0), T.Q8_0),
        "token_embd.weight": (src["token_embd.weight"].astype(np.float16), None),
        "output.weight": (src["output.weight"], None),
        "output_norm.weight": (src["output_norm.weight"], None),
        "blk.0.ffn_up_exps.weight": (gguf.quants.quantize(src["blk.0.ffn_up_exps.weight"], T.Q4_0), T.Q4_0),
        "blk.0.ffn_up.weight": (gguf.quants.quantize(src["blk.0.ffn_up.weight"], T.Q5_0), T.Q5_0),
        # gguf.quants has no Q4_K quantizer: random bytes of the right size (256 values = 144 bytes)
        "blk.0.ffn_gate.weight": (rng.integers(0, 256, (N, 2 * 144), dtype=np.uint8), T.Q4_K),
    }
    path = tmp_path / "tiny-llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test model")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello"])
    w.add_array("test.ints", [1, 2, 3, 4])
    for name, (data, qtype) in written.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, src, written


def test_list_tensors_shapes_types_bytes(model):
    path, src, written = model
    tensors = {t.name: t for t in gguf_io.list_tensors(path)}
    assert list(tensors) == list(written)  # file order
    expect = {
        "blk.0.ffn_down.weight": ("Q4_0", (N, K), N * K // 32 * 18, "q4_0"),
        "blk.0.attn_q.weight": ("Q8_0", (N, K), N * K // 32 * 34, "q8_0"),
        "token_embd.weight": ("F16", (N, K), N * K * 2, "f16"),
        "output.weight": ("F32", (N, K), N * K * 4, "f32"),
        "output_norm.weight": ("F32", (K,), K * 4, "f32"),
        "blk.0.ffn_up_exps.weight": ("Q4_0", (2, N, K), 2 * N * K // 32 * 18, "q4_0"),
        "blk.0.ffn_up.weight": ("Q5_0", (N, K), N * K // 32 * 22, None),
        "blk.0.ffn_gate.weight": ("Q4_K", (N, 512), N * 2 * 144, None),
    }
    for name, (typ, shape, nbytes, fmt) in expect.items():
        t = tensors[name]
        assert (t.type, t.shape, t.nbytes, t.fmt) == (typ, shape, nbytes, fmt), name
        assert t.ne == tuple(reversed(shape))  # ggml order: ne[0] = K
    # the convention against the gguf package itself: reader .shape is ggml's ne, K first
    reader = gguf.GGUFReader(str(path))
    rt = {t.name: t for t in reader.tensors}
    assert rt["blk.0.ffn_down.weight"].shape.tolist() == [K, N]
    assert tensors["blk.0.ffn_down.weight"].offset == rt["blk.0.ffn_down.weight"].data_offset


@pytest.mark.parametrize("name,qtype,block,quantizer", [
    ("blk.0.ffn_down.weight", T.Q4_0, qgemm.block_q4_0, qgemm.quantize_q4_0),
    ("blk.0.attn_q.weight", T.Q8_0, qgemm.block_q8_0, qgemm.quantize_q8_0),
])
def test_quantized_tensors_load_byte_identical(model, name, qtype, block, quantizer):
    path, src, written = model
    w = qgemm.load_gguf(path, name)
    assert w.dtype == block and w.shape == (N, K // 32)
    raw = written[name][0]
    assert w.view(np.uint8).tobytes() == raw.tobytes()  # the bytes ggml's writer wrote
    assert w.tobytes() == quantizer(src[name]).tobytes()  # and what qgemm's quantizer makes
    np.testing.assert_array_equal(qgemm.dequantize(w, block is qgemm.block_q4_0 and "q4_0" or "q8_0"),
                                  gguf.quants.dequantize(raw, qtype))
    assert not w.flags.writeable and w.flags.c_contiguous


def test_float_tensors_load_as_arrays(model):
    path, src, _ = model
    e = qgemm.load_gguf(path, "token_embd.weight")
    assert e.dtype == np.float16 and e.shape == (N, K)
    np.testing.assert_array_equal(e, src["token_embd.weight"].astype(np.float16))
    o = qgemm.load_gguf(path, "output.weight")
    assert o.dtype == np.float32 and o.shape == (N, K)
    np.testing.assert_array_equal(o, src["output.weight"])
    norm = qgemm.load_gguf(path, "output_norm.weight")
    assert norm.shape == (K,)
    np.testing.assert_array_equal(norm, src["output_norm.weight"])


def test_stacked_tensor_keeps_leading_dims(model):
    path, src, _ = model
    w = qgemm.load_gguf(path, "blk.0.ffn_up_exps.weight")
    assert w.dtype == qgemm.block_q4_0 and w.shape == (2, N, K // 32)
    assert w[1].tobytes() == qgemm.quantize_q4_0(src["blk.0.ffn_up_exps.weight"][1]).tobytes()


def _root(a):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a  # the mmap.mmap under a memory map


def _is_memmap_view(a):
    b = a
    while b is not None:
        if isinstance(b, np.memmap):
            return True
        b = b.base
    return False


def test_load_is_a_view_of_the_memory_map_not_a_copy(model):
    path, _, _ = model
    f = gguf_io.open_gguf(path)
    w = f.load("blk.0.ffn_down.weight")
    assert type(w) is np.ndarray and _is_memmap_view(w)
    assert np.shares_memory(w, f.reader.data)
    # a live map: bytes changed in the file after loading show through the same array
    t = f.info("blk.0.ffn_down.weight")
    with open(path, "r+b") as fh:
        fh.seek(t.offset + 2)  # qs[0] of block 0 (after the half scale)
        fh.write(bytes([0xA5]))
    assert w[0, 0]["qs"][0] == 0xA5


def test_weight_shape(model):
    path, _, _ = model
    assert gguf_io.weight_shape(path, "blk.0.ffn_down.weight") == (N, K, "q4_0")
    assert gguf_io.weight_shape(path, "blk.0.attn_q.weight") == (N, K, "q8_0")
    assert gguf_io.weight_shape(path, "token_embd.weight") == (N, K, "f16")
    assert gguf_io.weight_shape(path, "output.weight") == (N, K, "f32")
    with pytest.raises(ValueError, match=r"output_norm.weight.*\[96\], a vector; expected a 2-D weight \[N, K\]"):
        gguf_io.weight_shape(path, "output_norm.weight")
    with pytest.raises(ValueError, match=r"\[2 x 48 x 96\], 3-D"):
        gguf_io.weight_shape(path, "blk.0.ffn_up_exps.weight")
    with pytest.raises(ValueError, match="Q4_K"):
        gguf_io.weight_shape(path, "blk.0.ffn_gate.weight")


def test_weight_shape_refuses_an_empty_matrix(tmp_path):
    """A [4 x 0] tensor passed as a weight and reached the GPU check of `qgemm validate --gguf`,
    where an empty GEMM would have "passed" with nothing computed."""
    path = tmp_path / "empty.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("w", np.zeros((4, 0), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'w' has shape \[4 x 0\], an empty matrix"):
        gguf_io.weight_shape(path, "w")


@pytest.mark.parametrize("name,typ", [("blk.0.ffn_up.weight", "Q5_0"), ("blk.0.ffn_gate.weight", "Q4_K")])
def test_unsupported_type_names_it_and_the_supported_ones(model, name, typ):
    path, _, _ = model
    with pytest.raises(ValueError) as e:
        qgemm.load_gguf(path, name)
    msg = str(e.value)
    assert f"is {typ} [" in msg and name in msg and str(path) in msg
    assert "Q4_0, Q8_0" in msg and "F16, F32" in msg
    # a re-quantize command that works: llama.cpp refuses a quantized input without --allow-requantize
    assert "llama-quantize --pure" in msg and "--allow-requantize" in msg


def test_missing_tensor_suggests_close_names(model):
    path, _, _ = model
    with pytest.raises(KeyError) as e:
        qgemm.load_gguf(path, "blk.0.ffn_dwn.weight")
    msg = e.value.args[0]
    assert "no tensor named 'blk.0.ffn_dwn.weight'" in msg and "did you mean blk.0.ffn_down.weight" in msg
    with pytest.raises(KeyError, match="8 tensors"):
        qgemm.load_gguf(path, "zzz")


def test_metadata(model):
    path, _, _ = model
    f = gguf_io.open_gguf(path)
    assert f.metadata("general.architecture") == "llama"
    assert f.metadata("general.name") == "tiny test model"
    assert f.metadata("llama.block_count") == 1
    assert f.metadata("tokenizer.ggml.tokens") == ["<s>", "</s>", "hello"]
    assert f.metadata("nope", 7) == 7
    assert set(f.metadata_keys) == {"general.architecture", "general.name", "llama.block_count",
                                    "llama.rope.freq_base", "tokenizer.ggml.tokens", "test.ints"}


# ---------------------------------------------------------------------------------------------
# bad files: a clear ValueError naming the file, never a crash or a hang


def test_truncated_file(model, tmp_path):
    path, _, _ = model
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated: tensor '.*' .* ends at byte \d+, but the file has \d+ bytes"):
        qgemm.load_gguf(cut, "blk.0.ffn_down.weight")


def test_every_truncation_of_the_header_is_a_value_error(model, tmp_path):
    path, _, _ = model
    data = path.read_bytes()
    first_data = min(t.offset for t in gguf_io.list_tensors(path))
    cut = tmp_path / "cut.gguf"
    for n in range(0, first_data, 3):
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match="cut.gguf"):
            gguf_io.list_tensors(cut)


@pytest.mark.parametrize("content,match", [
    (b"", "the file is empty"),
    (b"PK\x03\x04" + bytes(200), r"not a GGUF file: it starts with b'PK\\x03\\x04', expected b'GGUF'"),
    (b"GGUF" + struct.pack("<I", 7) + bytes(40), "GGUF version 7 is not supported"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1 << 40) + bytes(40), "more than the file's"),
])
def test_garbage_files(tmp_path, content, match):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(content)
    with pytest.raises(ValueError, match=match) as e:
        qgemm.load_gguf(p, "x")
    assert str(p) in str(e.value)


def test_random_bytes_file(tmp_path, rng):
    p = tmp_path / "random.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<I", 3) + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="random.gguf"):
        gguf_io.list_tensors(p)


def test_corrupt_array_length_does_not_hang(model, tmp_path):
    # gguf.GGUFReader alone would loop ~2**40 times over an empty slice here
    path, _, _ = model
    data = path.read_bytes()
    needle = b"test.ints" + struct.pack("<IIQ", 9, 5, 4)  # key, ARRAY, item INT32, 4 items
    assert data.count(needle) == 1
    bad = tmp_path / "bad-array.gguf"
    bad.write_bytes(data.replace(needle, b"test.ints" + struct.pack("<IIQ", 9, 5, 1 << 40)))
    with pytest.raises(ValueError, match=r"bad-array.gguf: .*the 1099511627776 items of 'test.ints'"):
        gguf_io.list_tensors(bad)


def test_quantized_k_not_a_multiple_of_32(model, tmp_path):
    path, _, _ = model
    data = path.read_bytes()
    name = b"blk.0.ffn_down.weight"
    # tensor info: name, n_dims=2, ne=[K, N], type Q4_0 (2)
    needle = struct.pack("<Q", len(name)) + name + struct.pack("<IQQI", 2, K, N, 2)
    assert data.count(needle) == 1
    bad = tmp_path / "bad-k.gguf"
    bad.write_bytes(data.replace(needle, struct.pack("<Q", len(name)) + name + struct.pack("<IQQI", 2, 80, N, 2)))
    with pytest.raises(ValueError, match=r"bad-k.gguf: tensor 'blk.0.ffn_down.weight' is Q4_0 \[48 x 80\] with K .* = 80, "
                                         r"which is not a multiple of the Q4_0 block size 32"):
        gguf_io.list_tensors(bad)


def test_unknown_ggml_type_id(model, tmp_path):
    path, _, _ = model
    data = path.read_bytes()
    name = b"output.weight"
    needle = struct.pack("<Q", len(name)) + name + struct.pack("<IQQI", 2, K, N, 0)
    assert data.count(needle) == 1
    bad = tmp_path / "bad-type.gguf"
    bad.write_bytes(data.replace(needle, struct.pack("<Q", len(name)) + name + struct.pack("<IQQI", 2, K, N, 200)))
    with pytest.raises(ValueError, match=r"bad-type.gguf: tensor 'output.weight' has ggml type id 200"):
        gguf_io.list_tensors(bad)


def test_misaligned_tensor_data_offset(model, tmp_path):
    """A data offset that is not a multiple of general.alignment (32 here) is a corrupt file, as
    ggml says: it was once accepted and the tensor read from the wrong bytes. The unknown-type
    message names the installed gguf version (the package has no __version__)."""
    path, _, _ = model
    data = path.read_bytes()
    name = b"blk.0.ffn_down.weight"
    head = struct.pack("<Q", len(name)) + name + struct.pack("<IQQI", 2, K, N, 2)
    at = data.index(head) + len(head)
    offset = struct.unpack_from("<Q", data, at)[0]
    bad = tmp_path / "misaligned.gguf"
    bad.write_bytes(data[:at] + struct.pack("<Q", offset + 3) + data[at + 8:])
    with pytest.raises(ValueError, match=rf"misaligned.gguf: tensor 'blk.0.ffn_down.weight' has data offset {offset + 3}, "
                                         r"not a multiple of the file's alignment \(32\)"):
        gguf_io.list_tensors(bad)
    other = tmp_path / "bad-type.gguf"
    needle = struct.pack("<Q", len(b"output.weight")) + b"output.weight" + struct.pack("<IQQI", 2, K, N, 0)
    other.write_bytes(data.replace(needle, needle[:-4] + struct.pack("<I", 200)))
    with pytest.raises(ValueError, match=r"installed gguf package \(gguf \d"):
        gguf_io.list_tensors(other)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        qgemm.load_gguf(tmp_path / "nope.gguf", "x")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        qgemm.load_gguf(tmp_path, "x")


# ---------------------------------------------------------------------------------------------
# the command


def test_cli_gguf_lists_the_tensors(model):
    path, _, _ = model
    r = runner.invoke(app, ["gguf", str(path)])
    assert r.exit_code == 0, r.output
    assert "GGUF v3, 6 metadata keys (general.architecture = llama, general.name = tiny test model), 8 tensors" in r.output
    lines = {ln.split()[0]: ln.split() for ln in r.output.splitlines() if ln.startswith(("blk.", "token", "output"))}
    assert lines["blk.0.ffn_down.weight"][:6] == ["blk.0.ffn_down.weight", "Q4_0", "48", "x", "96", str(N * K // 32 * 18)]
    assert "q4_0 blocks [48, 3]" in r.output and "float16 [48, 96]" in r.output
    assert lines["blk.0.ffn_gate.weight"][-1] == "unsupported"
    assert "6 of 8 tensors load in qgemm" in r.output and "Q5_0 (1), Q4_K (1)" in r.output


def test_cli_gguf_json(model):
    path, _, _ = model
    r = runner.invoke(app, ["gguf", str(path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    t = {x["name"]: x for x in d["tensors"]}
    assert t["blk.0.attn_q.weight"] == {"name": "blk.0.attn_q.weight", "type": "Q8_0", "shape": [N, K], "ne": [K, N],
                                        "bytes": N * K // 32 * 34, "offset": t["blk.0.attn_q.weight"]["offset"],
                                        "qgemm_format": "q8_0"}
    assert d["version"] == 3 and len(d["metadata_keys"]) == 6


def test_cli_gguf_bad_file_exits_2(model, tmp_path):
    path, _, _ = model
    cut = tmp_path / "half.gguf"
    cut.write_bytes(path.read_bytes()[:300])
    r = runner.invoke(app, ["gguf", str(cut)])
    assert r.exit_code == 2 and "half.gguf" in r.output and "error:" in r.output
    r = runner.invoke(app, ["gguf", str(tmp_path / "missing.gguf")])
    assert r.exit_code == 2 and "missing.gguf" in r.output


def test_cli_gguf_weights_are_not_for_the_kv_cache_kernels(model, monkeypatch):
    """--gguf gives GEMM weights: a mustafar.* kernel named with it is refused before the GPU, and
    --all skips them (before session 27's per-kind default shapes, --all skipped them only because
    the GEMM shape was no BxSxD; with those defaults they ran on the GGUF tensor's shape)."""
    from qgemm import cli

    path, _, _ = model
    r = runner.invoke(app, ["validate", "mustafar.key_q2", "--gguf", str(path), "--tensor", "token_embd.weight"])
    assert r.exit_code == 2 and "takes a compressed KV cache" in r.output, r.output
    rows = []
    spec = qgemm.registry.spec("mustafar.key_q2")
    assert cli._skip_runner(spec, (5, 1031, 128), True, rows, 7, gg=(5, None, 128, "f16"))
    assert "takes a compressed KV cache" in rows[0][-1]
    assert not cli._skip_runner(spec, (5, 1031, 128), True, [], 7, gg=None)


# ---------------------------------------------------------------------------------------------
# on the GPU: a kernel on loaded weights


@pytest.mark.gpu
def test_kernel_on_loaded_weights(model, rng):
    path, src, _ = model
    w = qgemm.load_gguf(path, "blk.0.ffn_down.weight")  # read-only memory map
    a = rng.standard_normal((5, K), dtype=np.float32)
    c = qgemm.get("w4a16.tiled")(a, w)
    ref = qgemm.reference.exact_w4a16(a, qgemm.quantize_q4_0(src["blk.0.ffn_down.weight"]))
    assert c.shape == (5, N)
    assert qgemm.reference.relative_error(c, ref) < 2e-5
    w8 = qgemm.load_gguf(path, "blk.0.attn_q.weight")
    c8 = qgemm.get("w8a16.tiled")(a, w8)
    ref8 = qgemm.reference.exact_w8a16(a, qgemm.quantize_q8_0(src["blk.0.attn_q.weight"]))
    assert qgemm.reference.relative_error(c8, ref8) < 2e-5


def test_repeated_loads_parse_once_and_see_a_rewritten_file(model, tmp_path, rng):
    path, src, _ = model
    a = qgemm.load_gguf(path, "blk.0.ffn_down.weight")
    b = qgemm.load_gguf(path, "blk.0.attn_q.weight")
    assert _root(a) is _root(b) and not isinstance(_root(a), np.ndarray)  # one memory map: one parse
    # rewrite the same path at once with other weights of the same shapes (same size, maybe same mtime)
    x = rng.standard_normal((N, K), dtype=np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_down.weight", gguf.quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    c = qgemm.load_gguf(path, "blk.0.ffn_down.weight")
    assert c.dtype == qgemm.block_q8_0 and c.tobytes() == qgemm.quantize_q8_0(x).tobytes()
    assert gguf_io.list_tensors(path)[0].type == "Q8_0" and len(gguf_io.list_tensors(path)) == 1


def test_gguf_cli_survives_a_name_that_is_not_utf8(model, tmp_path):
    """`qgemm gguf FILE` printed a traceback (exit 1) when general.name was not valid UTF-8; the
    tensors are still listed, the name shown as unreadable."""
    path, _, _ = model
    data = path.read_bytes()
    bad = tmp_path / "bad-name.gguf"
    bad.write_bytes(data.replace(b"tiny test model", b"\xff\xfeny test model", 1))
    r = CliRunner().invoke(app, ["gguf", str(bad)])
    assert r.exit_code == 0 and "general.name = <unreadable:" in r.output and "blk.0.ffn_down.weight" in r.output, r.output
