"""README.md's Python examples run as written (in order, in one namespace): the first one's CPU
half on any machine, its GPU half (and the torch example) where there is a GPU."""

from pathlib import Path

import pytest

from test_docs_gguf import python_blocks

DOC = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(capsys):
    import qgemm

    blocks = python_blocks(DOC.read_text())
    assert len(blocks) == 2, "README.md's examples changed: update this test"
    ns: dict = {"__name__": "readme"}
    exec(compile(blocks[0], "README.md python block 1", "exec"), ns)
    out = capsys.readouterr().out
    assert "w4a16.wgmma_rs" in out and "W4A16: A f32 [M,K] x W q4_0 [N,K/32]^T -> C f32 [M,N]" in out, out
    if qgemm.gpu_available():  # the block's GPU half ran: its results are there and right
        assert ns["c"].shape == (512, 4096) and ns["cb"].shape == (2, 256, 4096) and ns["ch"].shape == (1, 4096)
        op = ns["k"].op  # the block's last `c` is the registered kernel's: its exact-math reference
        assert qgemm.reference.relative_error(ns["c"], op.exact(ns["a"], ns["w"])) <= op.exact_tol
        for m in (1, 8):  # the packed one-token and 8-token calls, each against its own plan's exact math
            p = qgemm.plan(m, 4096, 4096, "q4_0", packed=True)
            assert qgemm.reference.relative_error(ns[f"c{m}"], p.reference(ns["a"][:m], ns["w"])) <= p.op.exact_tol, p.kernel
        try:
            import torch
        except ImportError:
            return
        if torch.cuda.is_available():
            exec(compile(blocks[1], "README.md python block 2", "exec"), ns)
            y, x = ns["y"].cpu().numpy(), ns["x"].cpu().numpy()
            assert qgemm.reference.relative_error(y, op.exact(x, ns["w"])) <= op.exact_tol


@pytest.mark.gpu
def test_readme_examples_run_on_the_gpu(capsys):
    """The same where `pytest -m gpu` (tools/gpu_check.sh) selects it."""
    test_readme_examples_run(capsys)
