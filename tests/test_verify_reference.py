"""dspark::verify decision by decision against the independent float64 reference (verify_reference.py),
and the reference's own law, exactly.

Decision by decision: thousands of random requests over vocabularies of 4 to 64 and K = 1 to 7,
greedy and sampled, with and without filters; the op emits exactly the reference's tokens and counts
for every request whose margin is at least TIE (verify_reference's docstring), the requests within
TIE of a tie are few, and every accepted count 0 .. K is reached by many requests. The op's CPU
implementation here, the CUDA kernels in the `gpu` test (the interpreter's in
tests/interpret/test_verify_kernels.py).

The law: for V <= 6 and K <= 3, every draft sequence drawn from a bigram proposal is enumerated and the
uniforms integrated exactly (the reference's decisions compare independent uniforms with thresholds:
each uniform's [0, 1] is split at its threshold and the reference's decision evaluated on each piece);
the next token follows the reference's weights, then the target; the first K + 1 tokens' joint law is
the target's to 1e-12, and a reference with one rule broken misses it by far more.
"""
import numpy as np
import pytest
import torch

from dspark.ops.verify import verify
from dspark.sampling import apply_filters
from test_verify import random_bigram, target_law
from verify_reference import BROKEN_RESIDUALS, TIE, random_requests, reference_law

MAX_SKIPPED = 0.01  # the share of requests within TIE of a tie that a test may skip
MIN_REACHED = 0.02  # the share of requests that reach each accepted count 0 .. K, at least
SHAPES = [(1, 4), (2, 64), (3, 8), (4, 16), (5, 5), (6, 32), (7, 12), (7, 64)]  # (K, V)
REQUESTS = 400  # per shape


def check_against_reference(requests, block: bool, filters: bool, device: str = "cpu") -> tuple[float, np.ndarray]:
    """Runs the op on `device` and asserts it emits the reference's tokens and counts wherever the
    reference's margin is at least TIE. Returns the skipped share and the histogram of counts."""
    on_device = requests.to(device)
    logits = on_device.logits
    if filters:
        logits = apply_filters(logits.float(), on_device.temperature, on_device.top_k, on_device.top_p,
                               on_device.min_p).to(logits.dtype)
    emitted, n = (t.cpu() for t in verify(*on_device.op_args(logits), block))
    want_emitted, want_n, margin = requests.reference(block, filters)
    clear = margin >= TIE
    wrong = clear & ((emitted != want_emitted).any(1) | (n != want_n))
    if wrong.any():
        b = int(wrong.nonzero()[0, 0])
        raise AssertionError(f"{int(wrong.sum())} requests differ from the reference, e.g. request {b} "
                             f"(T = {requests.temperature[b]:.3f}, margin {margin[b]:.2e}): op {emitted[b].tolist()}, "
                             f"reference {want_emitted[b].tolist()}")
    K = requests.drafts.shape[1]
    return 1.0 - clear.double().mean().item(), np.bincount(want_n.numpy(), minlength=K + 1)


def check_shapes(block: bool, filters: bool, seed: int, device: str = "cpu", dtype=torch.float32):
    for i, (K, V) in enumerate(SHAPES):
        requests = random_requests(REQUESTS, K, V, seed=seed * 1000 + i, dtype=dtype, filters=filters)
        skipped, reached = check_against_reference(requests, block, filters, device)
        assert skipped <= MAX_SKIPPED, f"K={K} V={V}: {skipped:.1%} of the requests within {TIE} of a tie"
        assert reached.min() >= MIN_REACHED * REQUESTS, f"K={K} V={V}: accepted counts reached {reached.tolist()}"


@pytest.mark.parametrize("filters", [False, True], ids=["temperature", "filtered"])
@pytest.mark.parametrize("block", [False, True], ids=["standard", "block"])
def test_op_emits_the_references_tokens(block, filters, rng_seed):
    check_shapes(block, filters, rng_seed)


def test_op_emits_the_references_tokens_from_bfloat16_logits(rng_seed):
    check_shapes(True, True, rng_seed + 1, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("filters", [False, True], ids=["temperature", "filtered"])
@pytest.mark.parametrize("block", [False, True], ids=["standard", "block"])
def test_cuda_op_emits_the_references_tokens(block, filters, dtype, rng_seed):
    check_shapes(block, filters, rng_seed, device="cuda", dtype=dtype)


# ---------------------------------------------------------------- the reference's law, exactly

def bigram_pair(V: int, seed: int):
    """A bigram target P and a proposal Q near it that never proposes some tokens the target may take
    (q = 0 where p > 0, after every previous token but the last)."""
    rng = np.random.default_rng(seed)
    P = random_bigram(V, rng)
    Q = P * np.exp(rng.normal(size=(V, V)))
    Q[np.arange(V - 1), (np.arange(V - 1) + 1) % V] = 0.0
    return P, Q / Q.sum(1, keepdims=True)


@pytest.mark.parametrize("block", [False, True], ids=["standard", "block"])
@pytest.mark.parametrize("V, K", [(3, 1), (3, 3), (4, 2), (5, 3), (6, 2), (6, 3)])
def test_reference_is_lossless_exactly(block, V, K):
    """The reference's law equals the target's to 1e-12, and its accepted counts sum to one. With one
    rule broken it misses by more than 1e-4: each residual of BROKEN_RESIDUALS (rho dropped only where
    it can matter: block verification with K > 1, rho_0 being 1)."""
    P, Q = bigram_pair(V, seed=10 * V + K)
    want = target_law(P, 0, K)
    law, counts = reference_law(P, Q, 0, K, block)
    np.testing.assert_allclose(law, want, rtol=0, atol=1e-12)
    assert counts.sum() == pytest.approx(1.0, abs=1e-12)
    for name, broken in BROKEN_RESIDUALS.items():
        if name != "rho dropped" or (block and K > 1):
            wrong, _ = reference_law(P, Q, 0, K, block, broken)
            assert np.abs(wrong - want).max() > 1e-4, name


def test_block_reference_accepts_the_papers_expected_length():
    """Sun et al.'s toy (p = (1/3, 2/3), q = (2/3, 1/3), context-free, K = 2): E[accepted] is 10/9 for
    standard and 11/9 for block verification, integrated over the reference's decisions."""
    P, Q = np.tile([1 / 3, 2 / 3], (2, 1)), np.tile([2 / 3, 1 / 3], (2, 1))
    for block, expected in ((False, 10 / 9), (True, 11 / 9)):
        _, counts = reference_law(P, Q, 0, 2, block)
        assert counts @ np.arange(3) == pytest.approx(expected, abs=1e-12)
