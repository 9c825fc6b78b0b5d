"""The drafting ops (dspark::gumbel_step, gumbel_pick, write_proposals) through torch on CPU: custom-op
registration, what they compute, determinism of the noise, and that the draw follows
softmax((logits + bias) / T). The Triton kernels are checked against the same CPU implementation
in tests/interpret/test_gumbel_kernels.py."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dspark.ops.gumbel_max import gumbel_pick, gumbel_step, num_chunks
from dspark.ops.proposal import write_proposals
from stats import assert_differs, assert_matches

K, V = 2, 40


def make_inputs(batch, dtype=torch.float32, vocab=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(batch, K, vocab, generator=g)).to(dtype)
    bias = torch.randn(batch, vocab, generator=g)
    temperature = 0.5 + torch.rand(batch, generator=g)
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 2**40, (batch,), generator=g)
    return logits, bias, temperature, seeds, offsets


def buffers(batch, chunk_size, vocab=V):
    """biased [B, K, V], chunk_max, chunk_sum [B, K, C], filled with a marker value."""
    chunks = num_chunks(vocab, chunk_size)
    return (torch.full((batch, K, vocab), -7.0), torch.full((batch, K, chunks), -7.0),
            torch.full((batch, K, chunks), -7.0))


def draw(logits, bias, temperature, seeds, offsets, k=0, chunk_size=64):
    """Step and pick at position k -> (token [B], biased [B, K, V], chunk_max, chunk_sum)."""
    biased, chunk_max, chunk_sum = buffers(logits.shape[0], chunk_size, logits.shape[-1])
    best, index = gumbel_step(logits, bias, temperature, seeds, offsets, k, biased, chunk_max,
                              chunk_sum, chunk_size)
    token, _ = gumbel_pick(best, index, None)
    return token, biased, chunk_max, chunk_sum


def softmax64(biased, temperature):
    return torch.softmax(biased.double() / temperature.double()[:, None], dim=-1)


# ---------------------------------------------------------------- registration

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    logits, bias, temperature, seeds, offsets = make_inputs(3, dtype)
    temperature[1] = 0
    logits[2] = float("nan")
    for b in (bias.to(dtype), None):
        torch.library.opcheck(gumbel_step,
                              (logits, b, temperature, seeds, offsets, 1, *buffers(3, 16), 16))
    best, index = torch.randn(3, 3), torch.randint(0, V, (3, 3))
    for table in (torch.randn(V, 4), torch.randn(V, 4, dtype=torch.bfloat16), None):
        torch.library.opcheck(gumbel_pick, (best, index, table))
    biased, chunk_max, chunk_sum = buffers(3, 16)
    for k in range(K):
        gumbel_step(logits, bias, temperature, seeds, offsets, k, biased, chunk_max, chunk_sum, 16)
    tokens = torch.randint(0, V, (3, K))
    torch.library.opcheck(write_proposals, (biased, chunk_max, chunk_sum, temperature, tokens,
                                            torch.tensor([2, 0, 3]), torch.zeros(4, K, V)))


def test_bad_inputs_are_named():
    logits, bias, temperature, seeds, offsets = make_inputs(3)
    with pytest.raises(ValueError, match="biased"):
        gumbel_step(logits, bias, temperature, seeds, offsets, 0, *buffers(2, 64))
    with pytest.raises(ValueError, match="chunk_max"):
        gumbel_step(logits, bias, temperature, seeds, offsets, 0, *buffers(3, 64), 16)
    with pytest.raises(ValueError, match="k=2"):
        gumbel_step(logits, bias, temperature, seeds, offsets, 2, *buffers(3, 64), 64)
    with pytest.raises(ValueError, match="seed"):
        gumbel_step(logits, bias, temperature, seeds.int(), offsets, 0, *buffers(3, 64), 64)
    with pytest.raises(ValueError, match="power of two"):
        gumbel_step(logits, bias, temperature, seeds, offsets, 0, *buffers(3, 64), 24)


# ---------------------------------------------------------------- what the step computes

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_writes_biased_logits_and_chunk_statistics(dtype):
    logits, bias, temperature, seeds, offsets = make_inputs(4, dtype)
    logits[3] = float("nan")  # a CUDA-graph padding row
    given = logits.clone()
    _, biased, chunk_max, chunk_sum = draw(logits, bias, temperature, seeds, offsets, k=1,
                                           chunk_size=16)
    assert torch.equal(logits.view(torch.uint8), given.view(torch.uint8))  # read as they are
    assert torch.equal(biased[:3, 1], logits[:3, 1].float() + bias[:3])
    assert torch.equal(biased[3, 1], bias[3])
    assert (biased[:, 0] == -7).all() and (chunk_max[:, 0] == -7).all()  # other positions untouched
    m, s = chunk_max[:, 1], chunk_sum[:, 1]
    merged = m.amax(-1) + torch.log((s * torch.exp(m - m.amax(-1, keepdim=True))).sum(-1))
    want = torch.logsumexp(biased[:, 1].double() / temperature.double()[:, None], -1)
    torch.testing.assert_close(merged.double(), want, rtol=1e-6, atol=1e-6)


def test_draw_depends_only_on_seed_offset_position_and_token():
    logits, bias, temperature, seeds, offsets = make_inputs(64)
    tokens = draw(logits, bias, temperature, seeds, offsets)[0]
    for chunk_size in (32, 16, 8):  # 2, 3 and 5 chunks
        chunked = draw(logits, bias, temperature, seeds, offsets, chunk_size=chunk_size)[0]
        assert torch.equal(chunked, tokens)
    perm = torch.randperm(64)
    permuted = draw(logits[perm], bias[perm], temperature[perm], seeds[perm], offsets[perm])[0]
    assert torch.equal(permuted, tokens[perm])
    assert torch.equal(draw(logits, bias, temperature, seeds, offsets)[0], tokens)
    assert (draw(logits, bias, temperature, seeds, offsets + 1)[0] != tokens).float().mean() > 0.5
    other_position = draw(logits.flip(1), bias, temperature, seeds, offsets, k=1)[0]
    assert (other_position != tokens).float().mean() > 0.5


def test_greedy_rows_take_the_argmax_and_a_one_hot_proposal():
    logits, bias, temperature, seeds, offsets = make_inputs(3)
    logits[:2, 0, [3, 37]] = 0.0
    bias[:2, [3, 37]] = 100.0  # row 0: a tie across chunks, which the smaller id wins
    bias[1, 37] = 101.0
    temperature.zero_()
    tokens, biased, chunk_max, chunk_sum = draw(logits, bias, temperature, seeds, offsets,
                                                chunk_size=16)
    assert tokens.tolist() == [3, 37, (logits[2, 0] + bias[2]).argmax()]
    assert torch.equal(draw(logits, bias, temperature, seeds + 1, offsets + 1)[0], tokens)
    probs = torch.zeros(3, K, V)
    write_proposals(biased, chunk_max, chunk_sum, temperature, tokens[:, None].repeat(1, K),
                    torch.arange(3), probs)
    assert torch.equal(probs[:, 0], F.one_hot(tokens, V).float())


# ---------------------------------------------------------------- the proposal op

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_proposal_is_softmax_of_biased_logits_over_temperature(dtype):
    logits, bias, temperature, seeds, offsets = make_inputs(4, dtype)
    logits[2] = float("nan")
    biased, chunk_max, chunk_sum = buffers(4, 16)
    tokens = torch.stack([
        gumbel_pick(*gumbel_step(logits, bias, temperature, seeds, offsets, k, biased, chunk_max,
                                 chunk_sum, 16), None)[0] for k in range(K)], dim=1)
    slots = torch.tensor([5, 1, 0, 3])
    probs = torch.full((6, K, V), -1.0)
    write_proposals(biased, chunk_max, chunk_sum, temperature, tokens, slots, probs)
    for k in range(K):
        torch.testing.assert_close(probs[slots, k].double(), softmax64(biased[:, k], temperature),
                                   rtol=1e-5, atol=1e-7)
    assert (probs[[2, 4]] == -1).all()
    assert torch.isfinite(probs[0]).all()  # the padding row's slot


# ---------------------------------------------------------------- the draw's distribution

N = 20_000  # draws per test; one row each, all rows alike but for the Philox seed


@pytest.mark.parametrize("chunk_size", [64, 16], ids=["1chunk", "3chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_follow_softmax_of_biased_logits(dtype, chunk_size):
    """Chi-square of N draws against softmax((logits + bias) / T) at tests/stats.py's threshold
    (df + 10 sqrt(2 df); about 23 bins stay after merging, so about 91). Power: a law whose expected
    statistic N * sum (p - q)^2 / q passes the threshold fails; the negative controls are the same
    draws against T * 1.1 (expected statistic about 335) and against the law without the bias
    (about 40,000)."""
    logits, bias, temperature, _, _ = make_inputs(1, dtype, seed=1)
    temperature.fill_(0.8)
    batch = lambda t: t.repeat(N, *[1] * (t.dim() - 1))
    seeds, offsets = torch.arange(N), torch.full((N,), 12345)
    tokens = draw(batch(logits), batch(bias), batch(temperature), seeds, offsets, k=1,
                  chunk_size=chunk_size)[0]
    counts = np.bincount(tokens.numpy(), minlength=V)
    biased = logits[:, 1].float() + bias
    assert_matches(counts, softmax64(biased, temperature)[0].numpy())
    assert_differs(counts, softmax64(biased, 1.1 * temperature)[0].numpy())
    assert_differs(counts, softmax64(logits[:, 1].float(), temperature)[0].numpy())


def test_padding_rows_draw_from_the_bias_alone():
    _, bias, temperature, _, _ = make_inputs(1, seed=2)
    logits = torch.full((N, K, V), float("nan"))
    seeds, offsets = torch.arange(N), torch.zeros(N, dtype=torch.int64)
    tokens = draw(logits, bias.repeat(N, 1), temperature.repeat(N), seeds, offsets,
                  chunk_size=16)[0]
    counts = np.bincount(tokens.numpy(), minlength=V)
    assert_matches(counts, softmax64(bias, temperature)[0].numpy())
    assert_differs(counts, np.full(V, 1 / V))


# ---------------------------------------------------------------- torch.compile

def test_ops_compile_with_inductor():
    logits, bias, temperature, seeds, offsets = make_inputs(5, torch.bfloat16)
    temperature[0] = 0
    logits[4] = float("nan")

    def block(logits, bias, temperature, seeds, offsets, table, slots, probs):
        biased, chunk_max, chunk_sum = (torch.empty(5, K, V), torch.empty(5, K, 3),
                                        torch.empty(5, K, 3))
        tokens, rows = [], []
        for k in range(K):
            best, index = gumbel_step(logits, bias, temperature, seeds, offsets, k, biased,
                                      chunk_max, chunk_sum, 16)
            token, row = gumbel_pick(best, index, table)
            tokens.append(token)
            rows.append(row)
        tokens = torch.stack(tokens, 1)
        write_proposals(biased, chunk_max, chunk_sum, temperature, tokens, slots, probs)
        return tokens, torch.stack(rows, 1)

    table, slots = torch.randn(V, 4), torch.tensor([4, 0, 3, 1, 2])
    probs = [torch.zeros(6, K, V), torch.zeros(6, K, V)]
    want = block(logits, bias, temperature, seeds, offsets, table, slots, probs[0])
    got = torch.compile(block, fullgraph=True)(logits, bias, temperature, seeds, offsets, table,
                                               slots, probs[1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(probs[1], probs[0], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- the CUDA kernels

def run_block(logits, bias, temperature, seeds, offsets, table, slots, chunk_size):
    """All K steps, picks and the proposal write -> tokens, rows, biased, chunk stats, proposals."""
    batch, _, vocab = logits.shape
    biased, chunk_max, chunk_sum = (t.to(logits.device) for t in buffers(batch, chunk_size, vocab))
    tokens, rows = [], []
    for k in range(K):
        best, index = gumbel_step(logits, bias, temperature, seeds, offsets, k, biased, chunk_max,
                                  chunk_sum, chunk_size)
        token, row = gumbel_pick(best, index, table)
        tokens.append(token)
        rows.append(row)
    tokens = torch.stack(tokens, 1)
    probs = torch.full((batch + 1, K, vocab), -1.0, device=logits.device)
    write_proposals(biased, chunk_max, chunk_sum, temperature, tokens, slots, probs)
    return tokens, torch.stack(rows, 1), biased, chunk_max, chunk_sum, probs


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [1024, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_the_cpu_implementation(dtype, chunk_size):
    vocab = 50_000
    logits, bias, temperature, seeds, offsets = make_inputs(8, dtype, vocab=vocab)
    temperature[1] = 0
    logits[2] = float("nan")
    inputs = (logits, bias.to(dtype), temperature, seeds, offsets,
              torch.randn(vocab, 16).to(dtype), torch.randperm(8))
    cpu = run_block(*inputs, chunk_size)
    gpu = [t.cpu() for t in run_block(*(t.cuda() for t in inputs), chunk_size)]
    for name, want, got in zip(("tokens", "rows", "biased", "chunk_max"), cpu, gpu):
        assert torch.equal(got, want), name
    torch.testing.assert_close(gpu[4], cpu[4], rtol=1e-5, atol=0)
    torch.testing.assert_close(gpu[5], cpu[5], rtol=1e-5, atol=1e-9)


@pytest.mark.gpu
def test_opcheck_cuda():
    logits, bias, temperature, seeds, offsets = (t.cuda() for t in make_inputs(3, torch.bfloat16))
    biased, chunk_max, chunk_sum = (t.cuda() for t in buffers(3, 16))
    torch.library.opcheck(gumbel_step, (logits, bias, temperature, seeds, offsets, 1, biased,
                                        chunk_max, chunk_sum, 16))
    best, index = gumbel_step(logits, bias, temperature, seeds, offsets, 0, biased, chunk_max,
                              chunk_sum, 16)
    torch.library.opcheck(gumbel_pick, (best, index, torch.randn(V, 4, device="cuda")))
    tokens = torch.randint(0, V, (3, K), device="cuda")
    torch.library.opcheck(write_proposals, (biased, chunk_max, chunk_sum, temperature, tokens,
                                            torch.arange(3, device="cuda"),
                                            torch.zeros(3, K, V, device="cuda")))
