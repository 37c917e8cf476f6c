"""docs/gguf.md's Python examples run as written (in order, in one namespace, in a scratch
directory). On a machine without a GPU the `if qgemm.gpu_available():` parts are skipped by
the examples themselves; with one, they run the kernels too, and their results are checked."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "gguf.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_docs_gguf_examples_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gguf")
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 6, "docs/gguf.md lost its examples"
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "docs_gguf"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{DOC.name} python block {i + 1}", "exec"), ns)
        except Exception as e:  # name the block that broke
            raise AssertionError(f"docs/gguf.md python block {i + 1} failed: {type(e).__name__}: {e}\n{code}") from e
    out = capsys.readouterr().out
    # what the page says the examples print
    assert "(256, 1024, 'q4_0')" in out
    assert "True (256, 32)" in out
    assert "(256, 32) float16 (256, 1024) False" in out
    assert "llama 4 tensors" in out
    assert "did you mean blk.0.ffn_down.weight" in out and "a vector; expected a 2-D weight [N, K]" in out
    assert "cut.gguf: truncated: tensor" in out
    assert set(ns["layer"]) == {"blk.0.ffn_down.weight", "blk.0.attn_q.weight"}
    import qgemm

    if qgemm.gpu_available():  # the kernel blocks ran: their results, not only that they did not raise
        import numpy as np

        shape_err = re.search(r"^\(8, 256\) (\S+)$", out, flags=re.M)
        assert shape_err and float(shape_err.group(1)) < 1e-3 * float(np.abs(ns["ref"]).max()), out
        x, w8, y8 = ns["x"], ns["w8"], ns["y8"]
        want = qgemm.reference.exact_w8a16(x, w8)
        assert y8.shape == (8, 256) and np.abs(y8 - want).max() < 2e-2 * np.abs(want).max()
        if ns.get("yt") is not None:  # torch's own x: the same kernel on raw bytes on the device
            want_t = qgemm.reference.exact_w4a16(ns["xt"].cpu().numpy(), ns["w4"])
            assert np.abs(ns["yt"].cpu().numpy() - want_t).max() < 1e-4 * np.abs(want_t).max()
