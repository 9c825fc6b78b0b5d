"""The drafting ops (dspark::gumbel_step, gumbel_pick) through torch on CPU: custom-op
registration, what they compute (statistics, tokens, proposals), determinism of the noise, and that
the draw follows softmax((logits + bias) / T) for a precomputed Markov bias (or one the step
computes from its low-rank factors). The Triton kernels are checked against the
same CPU implementation in tests/interpret/test_gumbel_kernels.py; the `gpu` tests run them on CUDA."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dspark.ops.gumbel_pick import gumbel_pick
from dspark.ops.gumbel_step import gumbel_step
from stats import assert_differs, assert_matches

K, V, R = 2, 40, 16
G = 8  # the draw's group size in these tests: 5 groups over V = 40, so the group race counts


def make_inputs(batch, dtype=torch.float32, vocab=V, seed=0):
    """logits [B, K, V], a Markov bias [B, V] float32 (u @ w2^T of a rank-R head: multiples of 1/32
    of magnitude at most 4, exact in bfloat16 too), temperature, seeds, offsets."""
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(batch, K, vocab, generator=g)).to(dtype)
    u = torch.randint(-4, 5, (batch, R), generator=g) / 4
    w2 = torch.randint(-4, 5, (vocab, R), generator=g) / 8
    temperature = 0.5 + torch.rand(batch, generator=g)
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 2**40, (batch,), generator=g)
    return logits, u @ w2.T, temperature, seeds, offsets


def make_factors(batch, dtype=torch.float32, vocab=V, seed=0):
    """A low-rank bias's factor v [B, R] and W2 [V, R] in `dtype`: multiples of 1/4 and 1/8, so that
    v W2^T is exact in float32 (and bfloat16) whatever the order of its sums."""
    g = torch.Generator().manual_seed(seed + 100)
    v = torch.randint(-4, 5, (batch, R), generator=g) / 4
    return v.to(dtype), (torch.randint(-4, 5, (vocab, R), generator=g) / 8).to(dtype)


def step_args(bias):
    """The step op's (bias, w2) for a dense bias [B, V], None, or a low-rank pair (v, W2)."""
    return bias if isinstance(bias, tuple) else (bias, None)


def cuda(x):
    return tuple(map(cuda, x)) if isinstance(x, tuple) else x.cuda()


def biased_buffer(batch, vocab=V, device="cpu"):
    return torch.full((batch, K, vocab), -7.0, device=device)


def pick_buffers(batch, vocab=V, device="cpu"):
    """tokens [B, K] int64, slots [B] (row b's slot: b), draft_probs [B, K, V] float32, the buffers
    filled with a marker value."""
    return (torch.full((batch, K), -7, dtype=torch.int64, device=device), torch.arange(batch, device=device),
            torch.full((batch, K, vocab), -7.0, device=device))


def position(logits, bias, temperature, seeds, offsets, k, biased, tokens, slots, probs, table=None, block_v=64,
             block_b=16, group_size=G):
    """The step and the pick of position k, as drafting runs them -> the pick's gathered rows. bias:
    see step_args; with a low-rank pair the pick reads the biased logits the step wrote (biased
    [B, K, V] required), else the logits and the bias (biased written if given)."""
    units = gumbel_step(logits, *step_args(bias), temperature, k, biased, block_v, block_b, group_size)
    source, added = (biased, None) if isinstance(bias, tuple) else (logits, bias)
    return gumbel_pick(*units, source, added, temperature, seeds, offsets, table, k, tokens, slots, probs,
                       block_v, group_size)


def draw(logits, bias, temperature, seeds, offsets, k=0, block_v=64, group_size=G):
    """Step and pick at position k -> (token [B], biased [B, K, V], proposals [B, K, V])."""
    batch, _, vocab = logits.shape
    biased, (tokens, slots, probs) = biased_buffer(batch, vocab), pick_buffers(batch, vocab)
    position(logits, bias, temperature, seeds, offsets, k, biased, tokens, slots, probs, block_v=block_v,
             group_size=group_size)
    return tokens[:, k], biased, probs


def softmax64(biased, temperature):
    return torch.softmax(biased.double() / temperature.double()[:, None], dim=-1)


# ---------------------------------------------------------------- registration

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    logits, bias, temperature, seeds, offsets = make_inputs(3, dtype)
    temperature[1] = 0
    logits[2] = float("nan")
    for b in (bias.to(dtype), None, make_factors(3, dtype)):
        for biased in (biased_buffer(3), None)[:1 if isinstance(b, tuple) else 2]:
            torch.library.opcheck(gumbel_step, (logits, *step_args(b), temperature, 1, biased, 16, 16, G))
    units = gumbel_step(logits, bias, None, temperature, 1, None, 16, 1, G)
    # each table and each added bias once (every pairing made the test take minutes, for the same checks)
    for table, added in zip((torch.randn(V, 4), torch.randn(V, 4, dtype=torch.bfloat16), None),
                            (bias.bfloat16(), None, bias)):
        torch.library.opcheck(gumbel_pick, (*units, logits, added, temperature, seeds, offsets, table, 1,
                                            *pick_buffers(3), 16, G))


def test_bad_inputs_are_named():
    logits, bias, temperature, seeds, offsets = make_inputs(3)
    with pytest.raises(ValueError, match="biased"):
        gumbel_step(logits, bias, None, temperature, 0, biased_buffer(2), 64, 1, G)
    with pytest.raises(ValueError, match="k=2"):
        gumbel_step(logits, bias, None, temperature, 2, biased_buffer(3), 64, 1, G)
    with pytest.raises(ValueError, match="temperature"):
        gumbel_step(logits, bias, None, temperature.double(), 0, biased_buffer(3), 64, 1, G)
    for tiles in ((24, 1, G), (64, 3, G), (64, 1, 6)):
        with pytest.raises(ValueError, match="powers of two"):
            gumbel_step(logits, bias, None, temperature, 0, biased_buffer(3), *tiles)
    with pytest.raises(ValueError, match="bias"):
        gumbel_step(logits, bias[:, :-1], None, temperature, 0, biased_buffer(3), 64, 1, G)
    v, w2 = make_factors(3)
    for bad_v, bad_w2, match in ((v, w2[:-1], "w2"), (v.double(), w2, "factor"), (v[:2], w2, "factor"),
                                 (None, w2, "factor")):
        with pytest.raises(ValueError, match=match):
            gumbel_step(logits, bad_v, bad_w2, temperature, 0, biased_buffer(3), 64, 16, G)
    with pytest.raises(ValueError, match="block_b = 1 or >= 16"):
        gumbel_step(logits, v, w2, temperature, 0, biased_buffer(3), 64, 8, G)
    with pytest.raises(ValueError, match="give biased"):
        gumbel_step(logits, v, w2, temperature, 0, None, 64, 16, G)
    m, s, index = gumbel_step(logits, bias, None, temperature, 0, None, 16, 1, G)
    tokens, slots, probs = pick_buffers(3)
    for bad, match in (((m, s, index.int(), logits, bias, temperature, seeds, offsets, None, 0), "int64"),
                       ((m, s, index, logits, bias, temperature, seeds, offsets, None, 2), "k=2"),
                       ((m, s, index, logits, bias, temperature, seeds.int(), offsets, None, 0), "seed"),
                       ((m, s, index, logits, bias[:, :-1], temperature, seeds, offsets, None, 0), "bias"),
                       ((m, s, index, logits[:2], bias, temperature, seeds, offsets, None, 0), "logits")):
        with pytest.raises(ValueError, match=match):
            gumbel_pick(*bad, tokens, slots, probs, 16, G)
    with pytest.raises(ValueError, match="slots"):
        gumbel_pick(m, s, index, logits, bias, temperature, seeds, offsets, None, 0, tokens, slots.int(), probs,
                    16, G)
    with pytest.raises(ValueError, match="draft_probs"):
        gumbel_pick(m, s, index, logits, bias, temperature, seeds, offsets, None, 0, tokens, slots,
                    probs[..., :-1], 16, G)
    with pytest.raises(ValueError, match="do not fit"):
        gumbel_pick(m, s, index, logits, bias, temperature, seeds, offsets, None, 0, tokens, slots, probs, 4, G)


# ---------------------------------------------------------------- what the step computes

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_writes_biased_logits_and_the_pick_their_softmax(dtype):
    """The step's biased logits (when asked for) and the pick's proposal, softmax(biased / T), in the
    row's slot; padding rows read as the bias alone and get finite proposals; nothing else is written."""
    logits, bias, temperature, seeds, offsets = make_inputs(4, dtype)
    logits[3] = float("nan")  # a CUDA-graph padding row
    given = logits.clone()
    biased, (tokens, _, probs) = biased_buffer(4), pick_buffers(4)
    slots = torch.tensor([5, 1, 0, 3])
    probs = torch.full((6, K, V), -7.0)
    position(logits, bias, temperature, seeds, offsets, 1, biased, tokens, slots, probs, block_v=16)
    assert torch.equal(logits.view(torch.uint8), given.view(torch.uint8))  # read as they are
    assert torch.equal(biased[:3, 1], logits[:3, 1].float() + bias[:3])
    assert torch.equal(biased[3, 1], bias[3])
    assert (biased[:, 0] == -7).all() and (tokens[:, 0] == -7).all()  # other positions untouched
    assert (probs[:, 0] == -7).all() and (probs[[2, 4]] == -7).all()  # and slots of no row
    torch.testing.assert_close(probs[slots, 1].double(), softmax64(biased[:, 1], temperature), rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_rank_bias_is_its_dense_product(dtype):
    """Given the factors (v, W2), the step writes and draws what it does given v W2^T in float32 (the
    kernels: tests/interpret and the gpu tests)."""
    logits, _, temperature, seeds, offsets = make_inputs(4, dtype)
    logits[3] = float("nan")
    v, w2 = make_factors(4, dtype)
    low_rank = draw(logits, (v, w2), temperature, seeds, offsets, k=1, block_v=16)
    dense = draw(logits, v.float() @ w2.float().T, temperature, seeds, offsets, k=1, block_v=16)
    for got, want in zip(low_rank, dense):
        assert torch.equal(got, want)


def test_draw_depends_only_on_seed_offset_position_and_token():
    """Not on the tiles (groups of 8 in tiles of 64, 32 and 16 tokens, tiles of 4 in groups of 8),
    the batch row or the call; on the offset and the position."""
    logits, bias, temperature, seeds, offsets = make_inputs(64)
    tokens = draw(logits, bias, temperature, seeds, offsets)[0]
    for block_v in (32, 16, 8, 4):  # 2, 3, 5 and 10 tiles
        assert torch.equal(draw(logits, bias, temperature, seeds, offsets, block_v=block_v)[0], tokens)
    one_group = draw(logits, bias, temperature, seeds, offsets, group_size=64)[0]
    assert (one_group != tokens).float().mean() > 0.3  # the group size is part of the draw
    perm = torch.randperm(64)
    permuted = draw(logits[perm], bias[perm], temperature[perm], seeds[perm], offsets[perm])[0]
    assert torch.equal(permuted, tokens[perm])
    assert torch.equal(draw(logits, bias, temperature, seeds, offsets)[0], tokens)
    assert (draw(logits, bias, temperature, seeds, offsets + 1)[0] != tokens).float().mean() > 0.5
    other_position = draw(logits.flip(1), bias, temperature, seeds, offsets, k=1)[0]
    assert (other_position != tokens).float().mean() > 0.5


def test_greedy_rows_take_the_argmax_and_a_one_hot_proposal():
    logits, bias, temperature, seeds, offsets = make_inputs(3)
    logits[:2, 0, [3, 37]] = 100.0  # row 0: a tie across tiles, which the smaller id wins
    logits[1, 0, 37] = 101.0
    bias[:, 37] = bias[:, 3]  # the same bias at both
    temperature.zero_()
    tokens, _, probs = draw(logits, bias, temperature, seeds, offsets, block_v=16)
    assert tokens.tolist() == [3, 37, (logits[2, 0] + bias[2]).argmax()]
    assert torch.equal(draw(logits, bias, temperature, seeds + 1, offsets + 1)[0], tokens)
    assert torch.equal(probs[:, 0], F.one_hot(tokens, V).float())


# ---------------------------------------------------------------- the draw's distribution

N = 20_000  # draws per test; one row each, all rows alike but for the Philox seed


@pytest.mark.parametrize("block_v, group_size", [(64, 64), (64, 8), (16, 8), (4, 16)],
                         ids=["1tile-1group", "1tile-5groups", "3tiles-5groups", "10tiles-3groups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_follow_softmax_of_biased_logits(dtype, block_v, group_size):
    """Chi-square of N draws against softmax((logits + bias) / T) at tests/stats.py's threshold
    (df + 10 sqrt(2 df); about 23 bins stay after merging, so about 91). Power: a law whose expected
    statistic N * sum (p - q)^2 / q passes the threshold fails; the negative controls are the same
    draws against T * 1.1 (expected statistic about 195) and against the law without the bias
    (about 15,700)."""
    logits, bias, temperature, _, _ = make_inputs(1, dtype, seed=1)
    temperature.fill_(0.8)
    seeds, offsets = torch.arange(N), torch.full((N,), 12345)
    tokens = draw(logits.repeat(N, 1, 1), bias.repeat(N, 1), temperature.repeat(N), seeds, offsets,
                  k=1, block_v=block_v, group_size=group_size)[0]
    counts = np.bincount(tokens.numpy(), minlength=V)
    biased = logits[:, 1].float() + bias
    assert_matches(counts, softmax64(biased, temperature)[0].numpy())
    assert_differs(counts, softmax64(biased, 1.1 * temperature)[0].numpy())
    assert_differs(counts, softmax64(logits[:, 1].float(), temperature)[0].numpy())


def test_padding_rows_draw_from_the_bias_alone():
    _, bias, temperature, _, _ = make_inputs(1, seed=2)
    logits = torch.full((N, K, V), float("nan"))
    seeds, offsets = torch.arange(N), torch.zeros(N, dtype=torch.int64)
    tokens = draw(logits, bias.repeat(N, 1), temperature.repeat(N), seeds, offsets, block_v=16)[0]
    counts = np.bincount(tokens.numpy(), minlength=V)
    assert_matches(counts, softmax64(bias, temperature)[0].numpy())
    assert_differs(counts, np.full(V, 1 / V))


# ---------------------------------------------------------------- torch.compile

def block(logits, bias, temperature, seeds, offsets, table, slots, probs, block_v, block_b, group_size=G):
    """All K steps and picks -> tokens, rows, biased (-7 where the step wrote nothing)."""
    batch, _, vocab = logits.shape
    biased = torch.full((batch, K, vocab), -7.0, device=logits.device)
    tokens = torch.full((batch, K), -7, dtype=torch.int64, device=logits.device)
    rows = [position(logits, bias, temperature, seeds, offsets, k, biased if isinstance(bias, tuple) else None,
                     tokens, slots, probs, table, block_v, block_b, group_size) for k in range(K)]
    return tokens, torch.stack(rows, 1), biased


def test_ops_compile_with_inductor():
    logits, bias, temperature, seeds, offsets = make_inputs(5, torch.bfloat16)
    temperature[0] = 0
    logits[4] = float("nan")
    table, slots = torch.randn(V, 4), torch.tensor([4, 0, 3, 1, 2])
    probs = [torch.zeros(6, K, V), torch.zeros(6, K, V)]
    args = (logits, bias, temperature, seeds, offsets, table, slots)
    want = block(*args, probs[0], 16, 1)
    got = torch.compile(block, fullgraph=True)(*args, probs[1], 16, 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(probs[1], probs[0], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- the CUDA kernels

DENSE_TILES = [(1024, 1, 1024), (2048, 1, 1024), (4096, 4, 1024), (256, 2, 1024), (2048, 1, 512)]
LOW_RANK_TILES = [(128, 1, 1024), (128, 16, 1024), (128, 64, 1024), (256, 32, 1024), (64, 128, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("bias_kind, tiles",
                         [("dense", t) for t in DENSE_TILES] + [("low-rank", t) for t in LOW_RANK_TILES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_the_cpu_implementation(dtype, bias_kind, tiles):
    """B = 37 crosses row tiles of 2, 4, 16 and 32; the bias (in the logits' dtype) is added in float32
    on both sides, so the biased logits and tile maxima agree bit for bit and the tokens exactly. The
    low-rank step's tl.dot may take the logits as its accumulator (Triton folds dot + add), so there
    the logits are multiples of 1/8, and every partial sum is exact in float32."""
    vocab, batch = 50_000, 37
    logits, bias, temperature, seeds, offsets = make_inputs(batch, dtype, vocab=vocab)
    if bias_kind == "dense":
        bias = bias.to(dtype)
    else:
        bias = make_factors(batch, dtype, vocab)
        logits = ((logits.float() * 8).round() / 8).to(dtype)
    temperature[1] = 0
    logits[2] = float("nan")
    inputs = (logits, bias, temperature, seeds, offsets, torch.randn(vocab, 16).to(dtype), torch.randperm(batch))
    probs = [torch.full((batch + 1, K, vocab), -1.0) for _ in range(2)]
    cpu = block(*inputs, probs[0], *tiles)
    gpu_probs = probs[1].cuda()
    gpu = [t.cpu() for t in block(*map(cuda, inputs), gpu_probs, *tiles)]
    for name, want, got in zip(("tokens", "rows", "biased"), cpu, gpu):
        assert torch.equal(got, want), name
    torch.testing.assert_close(gpu_probs.cpu(), probs[0], rtol=1e-5, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(1024, 1, 1024), (2048, 1, 1024), (128, 128, 1024)],
                         ids=["1024", "2048", "low-rank-128x128"])
def test_cuda_draws_follow_softmax_at_the_default_models_vocabulary(tiles):
    """The shapes of the H200 evaluations and of the engine at 80 requests: V = 49,152 (SmolLM2's),
    80 rows per launch (one law in every row, a seed each), 250 launches: 20,000 draws of position 0
    against softmax((logits + bias) / T), 30 likely tokens and the rest merged into one bin; the
    negative control is the same draws against T x 1.1. With 128-row tiles the bias is given as the
    rank-16 product e_0 W2^T (W2's first column the bias), which the step computes."""
    vocab, batch, launches = 49_152, 80, 250
    g = torch.Generator().manual_seed(4)
    logits = torch.full((1, K, vocab), -6.0)
    logits[0, 0, :30] = 3 + torch.randn(30, generator=g)
    logits = logits.bfloat16()
    bias = torch.randint(-4, 5, (1, vocab), generator=g) / 8  # exact in bfloat16
    temperature = torch.full((batch,), 0.8, device="cuda")
    offsets, slots = torch.full((batch,), 777, device="cuda"), torch.arange(batch, device="cuda")
    probs = torch.zeros(batch, K, vocab, device="cuda")
    rows = logits.expand(batch, -1, -1).contiguous().cuda()
    row_bias = bias.expand(batch, -1).bfloat16().contiguous().cuda()
    if tiles[1] >= 16:
        v = torch.zeros(batch, R, dtype=torch.bfloat16, device="cuda")
        v[:, 0] = 1
        w2 = torch.zeros(vocab, R, dtype=torch.bfloat16)
        w2[:, 0] = bias[0]
        row_bias = (v, w2.cuda())
    counts = np.zeros(vocab)
    for i in range(launches):
        seeds = torch.arange(i * batch, (i + 1) * batch, device="cuda")
        tokens = block(rows, row_bias, temperature, seeds, offsets, None, slots, probs, *tiles)[0]
        counts += np.bincount(tokens[:, 0].cpu().numpy(), minlength=vocab)
    biased = logits[:, 0].float() + bias
    assert_matches(counts, softmax64(biased, temperature[:1].cpu())[0].numpy())
    assert_differs(counts, softmax64(biased, 1.1 * temperature[:1].cpu())[0].numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("low_rank, tiles", [(False, (1024, 1, 1024)), (False, (256, 2, 1024)),
                                             (True, (128, 1, 1024)), (True, (128, 16, 1024))],
                         ids=["1row", "2rows", "low-rank-1row", "low-rank-16rows"])
def test_block_replays_in_a_cuda_graph(low_rank, tiles):
    """A CUDA graph replay draws what the eager call draws; a new offset draws anew."""
    logits, bias, temperature, seeds, offsets = (
        t.cuda() for t in make_inputs(6, torch.bfloat16, vocab=5000))
    bias = cuda(make_factors(6, torch.bfloat16, 5000)) if low_rank else bias.bfloat16()
    table, slots = torch.randn(5000, 16, device="cuda"), torch.arange(6, device="cuda")
    probs = torch.zeros(6, K, 5000, device="cuda")
    args = (logits, bias, temperature, seeds, offsets, table, slots, probs, *tiles)
    eager = [t.clone() for t in block(*args)]
    eager_probs = probs.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block(*args)
    probs.zero_()
    graph.replay()
    assert all(torch.equal(c, e) for c, e in zip(captured, eager)) and torch.equal(probs, eager_probs)
    offsets.add_(1)
    graph.replay()
    assert (captured[0] != eager[0]).float().mean() > 0.5


@pytest.mark.gpu
def test_opcheck_cuda():
    logits, bias, temperature, seeds, offsets = (t.cuda() for t in make_inputs(3, torch.bfloat16))
    biased = biased_buffer(3, device="cuda")
    factors = cuda(make_factors(3, torch.bfloat16))
    for b, block_b in ((bias, 1), (bias.bfloat16(), 2), (None, 1), (factors, 1), (factors, 16)):
        for written in (biased, None)[:1 if isinstance(b, tuple) else 2]:
            torch.library.opcheck(gumbel_step, (logits, *step_args(b), temperature, 1, written, 16, block_b, G))
    units = gumbel_step(logits, bias, None, temperature, 0, None, 16, 2, G)
    for source, added in ((logits, bias), (logits, bias.bfloat16()), (biased, None)):
        torch.library.opcheck(gumbel_pick, (*units, source, added, temperature, seeds, offsets,
                                            torch.randn(V, 4, device="cuda"), 0, *pick_buffers(3, device="cuda"),
                                            16, G))
