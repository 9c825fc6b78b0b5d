"""The drafting kernels (step, pick, proposal) under the Triton interpreter against the plain-torch
implementations: tokens and gathered rows exactly, statistics and proposals to float32 rounding
(numpy's exp/log may differ from torch's by an ulp)."""
import pytest
import torch

from dspark.ops.gumbel_max import (gumbel_pick_torch, gumbel_step_torch, launch_gumbel_pick,
                                   launch_gumbel_step, num_chunks)
from dspark.ops.proposal import launch_write_proposals, write_proposals_torch

B, K, V, R = 4, 2, 300, 8
TEMPERATURE = torch.tensor([1.0, 0.0, 1.0, 0.7])  # row 1 greedy, row 2 a NaN padding row


def run_kernel(kernel):
    """The launchers' `wrap`: under the interpreter the kernel is launched as it is."""
    return kernel


def inputs(dtype, with_bias=True):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(B, K, V, generator=g)).to(dtype)
    logits[1, :, [7, 290]] = 20.0  # greedy row: a tie across chunks goes to the smaller id
    logits[2] = float("nan")
    bias = torch.randn(B, V, generator=g) if with_bias else None
    if bias is not None:
        bias[1, [7, 290]] = 0.0  # keep the tie a tie once the bias is added
    seed = torch.tensor([5, 6, 7, 2**40 + 3])
    offset = torch.tensor([0, 11, 12, 2**33 + 1])
    return logits, bias, TEMPERATURE, seed, offset


def step_buffers(chunks):
    return (torch.full((B, K, V), -1.0), torch.full((B, K, chunks), -1.0),
            torch.full((B, K, chunks), -1.0))


def run_steps(step, logits, bias, temperature, seed, offset, chunk_size):
    """All K steps into fresh buffers; returns the buffers and each step's chunk winners."""
    biased, chunk_max, chunk_sum = step_buffers(num_chunks(V, chunk_size))
    winners = [step(logits, bias, temperature, seed, offset, k, biased, chunk_max, chunk_sum,
                    chunk_size) for k in range(K)]
    return biased, chunk_max, chunk_sum, winners


def kernel_step(logits, bias, temperature, seed, offset, k, biased, chunk_max, chunk_sum,
                chunk_size):
    best = torch.empty(B, chunk_max.shape[-1])
    index = torch.empty(B, chunk_max.shape[-1], dtype=torch.int64)
    launch_gumbel_step(run_kernel, logits, bias, temperature, seed, offset, k, biased, chunk_max,
                       chunk_sum, chunk_size, best, index)
    return best, index


@pytest.mark.parametrize("chunk_size", [512, 128], ids=["1chunk", "3chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_kernel_matches_torch(dtype, chunk_size):
    args = inputs(dtype)
    got = run_steps(kernel_step, *args, chunk_size)
    want = run_steps(gumbel_step_torch, *args, chunk_size)
    assert torch.equal(got[0], want[0])  # biased logits: one float32 add, exact
    assert torch.equal(got[1], want[1])  # chunk maxima of the correctly rounded biased / T
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=0)
    for (best, index), (want_best, want_index) in zip(got[3], want[3]):
        assert torch.equal(index, want_index)
        torch.testing.assert_close(best, want_best, rtol=1e-6, atol=1e-6)
    assert gumbel_pick_torch(*got[3][0], None)[0][1] == 7  # the greedy row's tie: smaller id


def test_step_kernel_without_bias():
    args = inputs(torch.float32, with_bias=False)
    got = run_steps(kernel_step, *args, 128)
    want = run_steps(gumbel_step_torch, *args, 128)
    assert torch.equal(got[0], want[0])
    for (_, index), (_, want_index) in zip(got[3], want[3]):
        assert torch.equal(index, want_index)


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16, None])
def test_pick_kernel_matches_torch(table_dtype):
    g = torch.Generator().manual_seed(1)
    chunks = 5
    best = torch.randn(B, chunks, generator=g)
    best[0, 3] = best[0, 1] = best[0].max() + 1  # tie between chunks: the first chunk wins
    best[1] = float("-inf")
    index = torch.randint(0, V, (B, chunks), generator=g)
    table = None if table_dtype is None else torch.randn(V, R, generator=g).to(table_dtype)
    token = torch.empty(B, dtype=torch.int64)
    rows = torch.empty(B, 0) if table is None else torch.empty(B, R, dtype=table_dtype)
    launch_gumbel_pick(run_kernel, best, index, table, token, rows)
    want_token, want_rows = gumbel_pick_torch(best, index, table)
    assert torch.equal(token, want_token) and token[0] == index[0, 1]
    assert torch.equal(rows, want_rows)


@pytest.mark.parametrize("chunk_size", [512, 128], ids=["1chunk", "3chunks"])
def test_proposal_kernel_matches_torch(chunk_size):
    args = inputs(torch.bfloat16)
    biased, chunk_max, chunk_sum, winners = run_steps(gumbel_step_torch, *args, chunk_size)
    tokens = torch.stack([gumbel_pick_torch(*w, None)[0] for w in winners], 1)
    slots = torch.tensor([4, 0, 2, 1])
    probs = [torch.full((6, K, V), -1.0) for _ in range(2)]
    launch_write_proposals(run_kernel, biased, chunk_max, chunk_sum, TEMPERATURE, tokens, slots,
                           probs[0])
    write_proposals_torch(biased, chunk_max, chunk_sum, TEMPERATURE, tokens, slots, probs[1])
    torch.testing.assert_close(probs[0], probs[1], rtol=1e-5, atol=1e-7)
    assert (probs[0][[3, 5]] == -1).all()  # slots of no row are left alone
    assert torch.equal(probs[0][0], torch.nn.functional.one_hot(tokens[1], V).float())
