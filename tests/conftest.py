import os

import pytest
import torch
import torch._functorch.config

# AOTAutograd's on-disk cache keys a compiled graph by the names of the custom ops in it, not by their
# Python bodies, so a cache written before an op's CPU implementation changed replays the old one.
# Inductor's own caches key the lowered graph and stay on.
torch._functorch.config.enable_autograd_cache = False

# tests/interpret needs TRITON_INTERPRET=1 from the start of its own process (see its conftest).
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpret"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Runs a module's tests on one torch thread: their matmuls are too small for a second thread
    to help, and on a 2-core machine it mostly waits for the first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
