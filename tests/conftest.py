import os

# Inductor's C++ code without SIMD: its code generation takes half the time (a compiled decode step:
# 72 s against 135 s on the CI machine), and the compile-heavy tests check graph counts and equality
# with eager, not the vector code. Set before torch reads its config, and inherited by the processes
# the tests start; `vectorized_inductor` turns SIMD back on for a test.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._functorch.config  # noqa: E402
import torch._inductor.config  # noqa: E402
import torch._inductor.cpu_vec_isa  # noqa: E402

# AOTAutograd's on-disk cache keys a compiled graph by the names of the custom ops in it, not by their
# Python bodies, so a cache written before an op's CPU implementation changed replays the old one.
# Inductor's own caches key the lowered graph and stay on.
torch._functorch.config.enable_autograd_cache = False

# Under pytest-xdist each worker gets one torch thread: two workers with two threads each on the CI's
# two cores made OpenMP's threads wait on each other (a 6-s test took 177 s next to a compilation).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# tests/interpret needs TRITON_INTERPRET=1 from the start of its own process (see its conftest).
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpret"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def vectorized_inductor():
    """Inductor's C++ code with SIMD, as users' CPU compilations get it (the suite runs without).
    Inductor caches the list of usable SIMD instruction sets, filtered by the flag when first asked,
    and Dynamo would replay code an earlier test of the worker compiled without SIMD: both are reset."""
    valid_isas = torch._inductor.cpu_vec_isa.valid_vec_isa_list
    valid_isas.cache_clear()
    torch._dynamo.reset()
    with torch._inductor.config.patch({"cpp.vec_isa_ok": None}):
        assert valid_isas(), "Inductor finds no SIMD instruction set on this CPU"
        yield
    valid_isas.cache_clear()
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_thread():
    """Runs a module's tests on one torch thread: their matmuls are too small for a second thread
    to help, and on a 2-core machine it mostly waits for the first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seeds_from_env() -> list[int]:
    """DSPARK_TEST_SEED: one seed ("7"), or a range ("0-19": each test that takes rng_seed runs once per
    seed, as bench/mutants.py runs them); 0 by default."""
    first, _, last = os.environ.get("DSPARK_TEST_SEED", "0").partition("-")
    return list(range(int(first), int(last or first) + 1))


@pytest.fixture(scope="session", params=seeds_from_env() if len(seeds_from_env()) > 1 else None,
                ids=lambda seed: f"seed{seed}")
def rng_seed(request) -> int:
    """The seed the randomised and statistical tests derive their inputs and draws from."""
    return getattr(request, "param", seeds_from_env()[0])


@pytest.fixture(scope="session")
def default_tokenizer():
    """SmolLM2's tokenizer from the default model's GGUF (read once: about 3 s)."""
    from dspark.loading import default_gguf_path
    from dspark.tokenizer import Tokenizer
    return Tokenizer.from_gguf(default_gguf_path())
