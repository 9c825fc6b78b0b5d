"""The verification kernels under TRITON_INTERPRET=1 against the torch implementation: the same
emitted tokens and accepted counts, bit for bit, on small vocabularies split into several chunks
(the last one partial); and against the independent float64 reference (tests/verify_reference.py),
decision by decision."""
import pytest
import torch

from dspark.ops.verify import launch_verify, verify_torch
from verify_reference import TIE, random_requests

# numpy evaluates log(0) and -inf - -inf in lanes the kernels then mask out
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                                        "ignore:invalid value:RuntimeWarning")


def run_kernel(kernel):
    """The launcher's `wrap`: under the interpreter the kernel is launched as it is."""
    return kernel


def inputs(B, K, V, seed, dtype, temperature):
    """Drafts drawn from proposals near the target at the first positions and far from it at the last
    (noise of 0.1 to 4 on the logits), so that most requests stop inside the block (0 < n < K), where
    the residual is drawn; greedy rows draft the argmax but at the last position. Request b sits at
    slot B - 1 - b of a larger proposal buffer."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=generator) * 2
    noise = torch.linspace(0.1, 4.0, K).view(1, K, 1) * torch.randn(B, K, V, generator=generator)
    probs = torch.softmax(logits[:, :K] + noise, -1)
    drafts = torch.multinomial(probs.reshape(-1, V), 1, generator=generator).view(B, K)
    greedy = torch.tensor(temperature) == 0
    drafts[greedy, :K - 1] = logits[greedy, :K - 1].argmax(-1)
    slots = torch.arange(B - 1, -1, -1)
    draft_probs = torch.zeros(B + 1, K, V)
    draft_probs[slots] = probs
    seeds = torch.randint(0, 2**62, (B,), generator=generator)
    offsets = torch.randint(0, 2**40, (B,), generator=generator)
    return [logits.to(dtype), drafts, draft_probs, slots, torch.tensor(temperature), seeds, offsets]


def check(args, block, chunk):
    expected = verify_torch(*args, block)
    got = launch_verify(run_kernel, *args, block, chunk=chunk, resample_chunk=chunk // 2)
    assert torch.equal(got[1], expected[1])
    assert torch.equal(got[0], expected[0])
    return expected[1]


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_torch(block, dtype):
    accepted = []
    for seed in range(3):
        args = inputs(4, 3, 150, seed, dtype, [1.0, 0.7, 0.0, 1.3])
        accepted += check(args, block, chunk=32).tolist()
    assert len(set(accepted)) >= 3  # the cases reach several acceptance lengths
    assert sum(0 < n < 3 for n in accepted) >= len(accepted) / 2  # most draw from the residual


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("K", [0, 1])
def test_short_blocks(block, K):
    check(inputs(3, K, 60, K, torch.float32, [1.0, 0.0, 0.5]), block, chunk=16)


@pytest.mark.parametrize("block", [False, True])
def test_greedy_ties_and_nan_rows(block):
    args = inputs(4, 2, 50, 7, torch.float32, [0.0, 0.0, 1.0, 0.0])
    logits, drafts = args[0], args[1]
    logits[0, 0, [3, 40]] = logits[0, 0].max() + 1  # tie across chunks: the smaller id wins
    drafts[0, 0] = 3
    logits[2:] = float("nan")  # padding rows, sampled and greedy
    emitted, n = launch_verify(run_kernel, *args, block, chunk=16, resample_chunk=16)
    assert n[0] >= 1 and emitted[0, 0] == 3
    token = emitted.gather(1, n[:, None])
    assert ((0 <= token) & (token < 50)).all()
    check(args, block, chunk=16)


@pytest.mark.parametrize("block", [False, True])
def test_drafts_may_be_a_view_of_the_token_block(block):
    """The decoder passes its [B, K+1] block of (anchor, drafts) as tokens[:, 1:], rows K+1 apart:
    the kernels read the drafts through their strides, as the torch implementation does (until
    this test, they read rows K apart: on CUDA, every T > 0 step verified and emitted the wrong
    tokens). A transposed buffer checks the column stride."""
    args = inputs(5, 3, 90, 11, torch.float32, [1.0, 0.7, 0.0, 1.3, 1.0])
    drafts = args[1]
    args[1] = torch.cat([torch.randint(0, 90, (5, 1)), drafts], dim=1)[:, 1:]
    check(args, block, chunk=32)
    args[1] = drafts.T.contiguous().T
    check(args, block, chunk=32)


@pytest.mark.parametrize("block", [False, True])
def test_kernels_emit_the_references_tokens(block, rng_seed):
    """16 requests (greedy and sampled, some with zero proposals where the target is not zero), K = 3,
    V = 24 in chunks of 16: the kernels emit the float64 reference's tokens and counts, but for the
    requests within TIE of a tie (at most one)."""
    requests = random_requests(16, 3, 24, seed=rng_seed)
    emitted, n = launch_verify(run_kernel, *requests.op_args(), block, chunk=16, resample_chunk=8)
    want_emitted, want_n, margin = requests.reference(block, False)
    clear = margin >= TIE
    assert clear.sum() >= 15
    assert torch.equal(n[clear], want_n[clear]) and torch.equal(emitted[clear], want_emitted[clear])
