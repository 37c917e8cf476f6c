"""docs/pytorch.md's Python examples run as written (in order, in one namespace). Without a GPU,
torch or CuPy the examples skip their GPU parts themselves."""

from pathlib import Path

import pytest

from test_docs_gguf import python_blocks

DOC = Path(__file__).resolve().parent.parent / "docs" / "pytorch.md"


def test_docs_pytorch_examples_run(capsys):
    import qgemm

    blocks = python_blocks(DOC.read_text())
    assert len(blocks) == 7, "docs/pytorch.md lost its examples"
    ns: dict = {"__name__": "docs_pytorch"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{DOC.name} python block {i + 1}", "exec"), ns)
        except Exception as e:
            raise AssertionError(f"docs/pytorch.md python block {i + 1} failed: {type(e).__name__}: {e}\n{code}") from e
    out = capsys.readouterr().out
    assert "(256, 576) uint8" in out
    torch = ns.get("torch")
    if qgemm.gpu_available() and torch is not None and torch.cuda.is_available():
        assert "torch.Size([8, 256]) torch.float32 True" in out
        assert "torch.Size([2, 4, 256]) True" in out
        # the two bare checks: the out= result against the reference, and the CUDA graph replay's (a
        # count of "True" anywhere let one of them print False while the other lines held the count)
        assert [ln.strip() for ln in out.splitlines() if ln.strip() in ("True", "False")] == ["True", "True"], out
        assert ("None w4a16.mma" in out) != ("pack.q4_0 w4a16.wgmma_rs" in out), out  # the plan of 300 tokens
        assert "compiled vs eager: True torch.Size([8, 1024])" in out, out  # torch.compile(fullgraph=True)
        assert "the op vs qgemm.matmul: True" in out, out
        assert "QuantLinear(in_features=1024, out_features=256, fmt=q4_0, bias=True) ggml's bytes: True error < 0.15: True" \
            in out, out  # QuantLinear.from_linear
    if qgemm.gpu_available() and ns.get("cp") is not None:
        assert "(4, 32) (4, 1152) True" in out


@pytest.mark.gpu
def test_docs_pytorch_examples_run_on_the_gpu(capsys):
    """The same examples where `pytest -m gpu` (tools/gpu_check.sh) selects them: there the torch
    and CuPy lines above are asserted (the test above runs in the CPU-only CI)."""
    test_docs_pytorch_examples_run(capsys)
