import os

import numpy as np
import pytest

# Each test session gets its own kernel cache unless the caller chose one, so tests never
# depend on (or pollute) the user's cache.
if "QGEMM_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["QGEMM_CACHE_DIR"] = tempfile.mkdtemp(prefix="qgemm-test-cache-")


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
