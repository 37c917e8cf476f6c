import os

import numpy as np
import pytest

# Each test session gets its own kernel cache unless the caller chose one, so tests never
# depend on (or pollute) the user's cache.
if "QGEMM_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["QGEMM_CACHE_DIR"] = tempfile.mkdtemp(prefix="qgemm-test-cache-")
    atexit.register(shutil.rmtree, os.environ["QGEMM_CACHE_DIR"], True)  # ~1 MB per kernel variant compiled


def pytest_collection_modifyitems(config, items):
    from qgemm import runtime

    if runtime.gpu_available():
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {runtime.gpu_unavailable_reason()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    # a fresh seed per test run, printed on failure through the test id's fixture value
    seed = int(np.random.SeedSequence().entropy % (2**31))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture
def pdl_launches(monkeypatch):
    """A race test of programmatic dependent launch is one only if its kernels were launched with
    it: runtime._pdl_config falls back to plain launches silently (an old cuda.core, QGEMM_PDL=0).
    Records, for every kernel launch of the test, whether it asked for PDL and got a launch
    configuration with it; `.check()` asserts that some did where the GPU has PDL (sm_90+)."""
    from qgemm import runtime

    class Launches(list):
        def check(self):
            if runtime.device_info().cc >= 90:
                assert any(self), f"no kernel launch of the test used PDL ({len(self)} launches)"

    seen = Launches()
    real = runtime.LoadedKernel.launch

    def spy(self, entry, grid, block, shmem, args, stream=None, pdl=False):
        geo = dict(grid=tuple(grid), block=tuple(block), shmem_size=shmem)
        seen.append(bool(pdl) and runtime._pdl_config(geo) is not None)
        return real(self, entry, grid, block, shmem, args, stream=stream, pdl=pdl)

    monkeypatch.setattr(runtime.LoadedKernel, "launch", spy)
    return seen
