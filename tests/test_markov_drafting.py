"""Markov heads and ancestral drafting of a block (the bias through the head, then the step and pick
ops per position): the heads compute DeepSpec's biases, the drafts follow the chained distribution
(position 0, position 1 given the drawn position 0, and the pair), the stored proposals are the
distributions the drafts were drawn from, greedy rows draw greedy_draft's argmax chain, and the block
compiles with torch.compile(fullgraph=True) to the eager result; the `gpu` test checks CUDA against
the CPU implementation and CUDA-graph replay."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dspark.config import DrafterConfig
from dspark.drafting import ancestral_draft, greedy_draft
from dspark.markov import GatedMarkov, RNNMarkov, VanillaMarkov, build_markov_head
from dspark.ops.gumbel_max import STEP_TILES
from stats import assert_differs, assert_matches

V, R, D = 10, 4, 8


def make_head(kind="vanilla", seed=0, scale=0.6):
    torch.manual_seed(seed)
    head = build_markov_head(DrafterConfig(vocab_size=V, hidden_size=D, markov_rank=R,
                                           markov_head_type=kind))
    with torch.no_grad():
        head.markov_w2.weight.mul_(scale / head.markov_w2.weight.std())  # biases of about 1.2
    return head


# ---------------------------------------------------------------- the heads

def test_build_markov_head_uses_deepspec_names_and_shapes():
    assert build_markov_head(DrafterConfig(vocab_size=V, hidden_size=D, markov_rank=0)) is None
    shapes = {name: tuple(p.shape) for name, p in make_head("rnn").state_dict().items()}
    assert shapes == {"markov_w1.weight": (V, R), "markov_w2.weight": (V, R),
                      "joint_proj.weight": (3 * R, 2 * R + D), "joint_proj.bias": (3 * R,)}
    gated = make_head("gated")
    assert isinstance(gated, GatedMarkov) and gated.gate_proj.weight.shape == (R, D + R)
    assert type(make_head("vanilla")) is VanillaMarkov and isinstance(make_head("rnn"), RNNMarkov)


def test_vanilla_bias_is_w1_of_previous_token_times_w2():
    head = make_head()
    prev = torch.tensor([3, 0, 9])
    bias, state = head.bias(head.markov_w1(prev), None, head.initial_state(3))
    torch.testing.assert_close(bias, head.markov_w1.weight[prev] @ head.markov_w2.weight.T)
    assert bias.shape == (3, V) and state is None


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_teacher_forced_forward_equals_stepping(kind):
    head = make_head(kind)
    prev_tokens, hidden = torch.randint(0, V, (5, 3)), torch.randn(5, 3, D)
    state, stepped = head.initial_state(5), []
    for k in range(3):
        bias, state = head.bias(head.markov_w1(prev_tokens[:, k]), hidden[:, k], state)
        stepped.append(bias)
    torch.testing.assert_close(head(prev_tokens, hidden), torch.stack(stepped, 1))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_only_the_rnn_head_remembers_earlier_tokens(kind):
    head = make_head(kind)
    prev_tokens, hidden = torch.randint(0, V, (5, 3)), torch.randn(5, 3, D)
    changed = prev_tokens.clone()
    changed[:, 0] = (changed[:, 0] + 1) % V
    last = head(prev_tokens, hidden)[:, 2], head(changed, hidden)[:, 2]
    assert torch.equal(*last) != (kind == "rnn")


# ---------------------------------------------------------------- the distribution of the drafts

N, ANCHOR, TEMPERATURE = 20_000, 2, 0.8


def draft(logits, head, hidden=None, temperature=None, seed=None, offset=None, anchor=None,
          tiles=(16, 16)):
    """ancestral_draft with slot b for row b -> (tokens [B, K], draft_probs [B, K, V])."""
    batch, k, _ = logits.shape
    temperature = torch.full((batch,), TEMPERATURE) if temperature is None else temperature
    seed = torch.arange(batch) if seed is None else seed
    offset = torch.full((batch,), 77) if offset is None else offset
    anchor = torch.full((batch,), ANCHOR) if anchor is None else anchor
    probs = torch.full((batch, k, V), -1.0)
    tokens = ancestral_draft(logits, hidden, head, anchor, temperature, seed, offset,
                             torch.arange(batch), probs, tiles)
    return tokens, probs


def softmax64(logits, temperature=TEMPERATURE):
    return torch.softmax(logits.double() / temperature, dim=-1).numpy()


class Sample:
    """N blocks of K = 2 drafts, all rows alike but for the seed, and the laws they should follow."""

    def __init__(self, dtype, tiles):
        g = torch.Generator().manual_seed(3)
        self.base = (1.5 * torch.randn(2, V, generator=g)).to(dtype).double()
        head = make_head()
        logits = self.base.to(dtype)[None].repeat(N, 1, 1)
        tokens, _ = draft(logits, head, tiles=tiles)
        self.d0, self.d1 = tokens[:, 0].numpy(), tokens[:, 1].numpy()
        with torch.no_grad():
            self.transition = (head.markov_w1.weight @ head.markov_w2.weight.T).double()  # [prev, V]
        self.p0 = softmax64(self.base[0] + self.transition[ANCHOR])
        self.p1_given_d0 = softmax64(self.base[1] + self.transition)  # [d0, V]

    def counts(self):
        return np.bincount(self.d0 * V + self.d1, minlength=V * V).reshape(V, V)  # [d0, d1]


@pytest.fixture(scope="module", params=[(torch.float32, (16, 16)), (torch.float32, (4, 16)),
                                        (torch.bfloat16, None), (torch.bfloat16, (4, 16))],
                ids=["f32-1tile", "f32-3tiles", "bf16-default", "bf16-3tiles"])
def sample(request):
    return Sample(*request.param)


# Power: tests/stats.py's threshold is df + 10 sqrt(2 df): 51 for the 10 bins of position 0, about
# 185 for the ~70 bins of the pair tests that keep 5 expected draws. A wrong law q is rejected once
# its expected statistic N * sum (p - q)^2 / q passes that; each negative control below is such a
# law (expected statistic in its comment) and must be rejected by the same draws.

def test_position_0_follows_the_anchor_biased_law(sample):
    counts = np.bincount(sample.d0, minlength=V)
    assert_matches(counts, sample.p0, "position 0")
    assert_differs(counts, softmax64(sample.base[0]), "position 0 without the bias")  # ~ 20,000
    assert_differs(counts, softmax64(sample.base[0] + sample.transition[ANCHOR], 1.2 * TEMPERATURE),
                   "position 0 at 1.2 T")  # ~ 450


def test_position_1_follows_the_law_given_the_drawn_position_0(sample):
    counts = sample.counts()
    per_d0 = counts.sum(1, keepdims=True)
    assert_matches(counts, per_d0 * sample.p1_given_d0 / N, "position 1 given position 0")
    unchained = softmax64(sample.base[1] + sample.transition[ANCHOR])  # bias of the anchor
    assert_differs(counts, per_d0 * unchained / N, "position 1 biased by the anchor")  # ~ 60,000
    assert_differs(counts, per_d0 * softmax64(sample.base[1]) / N,
                   "position 1 without the bias")  # ~ 40,000


def test_the_pair_follows_the_chained_law(sample):
    joint = sample.p0[:, None] * sample.p1_given_d0
    assert_matches(sample.counts(), joint, "(position 0, position 1)")
    independent = sample.p0[:, None] * joint.sum(0)[None]  # right marginals, no chain
    assert_differs(sample.counts(), independent, "independent positions")  # ~ 15,000


# ---------------------------------------------------------------- proposals, greedy, padding

def reference_proposals(logits, head, hidden, anchor, tokens, temperature):
    """q_k = softmax((base_k + bias(d_{k-1})) / T) in float64 from the drawn chain; NaN base logits
    count as 0; greedy rows one-hot at the argmax, which must be the drawn token."""
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
    with torch.no_grad():
        biased = torch.nan_to_num(logits.double(), nan=0.0) + head(prev, hidden).double()
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], biased[greedy].argmax(-1))
    q = torch.softmax(biased / torch.where(greedy, 1.0, temperature).double()[:, None, None], -1)
    q[greedy] = F.one_hot(tokens[greedy], V).double()
    return q


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_proposals_are_the_drawn_distributions(kind, dtype):
    head = make_head(kind)
    logits = (2 * torch.randn(6, 3, V)).to(dtype)
    logits[4] = float("nan")  # a CUDA-graph padding row
    hidden = torch.randn(6, 3, D)
    anchor = torch.randint(0, V, (6,))
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.7, 1.0, 0.0])
    given = logits.clone()
    tokens, probs = draft(logits, head, hidden, temperature, anchor=anchor)
    assert logits.view(torch.uint8).equal(given.view(torch.uint8))
    assert tokens.dtype == torch.int64 and ((tokens >= 0) & (tokens < V)).all()
    want = reference_proposals(logits, head, hidden, anchor, tokens, temperature)
    torch.testing.assert_close(probs.double(), want, rtol=1e-5, atol=1e-7)


def test_drafting_without_a_markov_head_draws_positions_independently():
    logits = torch.randn(4, 3, V)
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0])
    tokens, probs = draft(logits, None, temperature=temperature)
    scale = torch.where(temperature == 0, 1.0, temperature).double()[:, None, None]
    want = torch.softmax(logits.double() / scale, -1)
    want[2] = F.one_hot(logits[2].argmax(-1), V).double()
    assert torch.equal(tokens[2], logits[2].argmax(-1))
    torch.testing.assert_close(probs.double(), want, rtol=1e-5, atol=1e-7)


def test_drafts_depend_on_seed_and_offset_only():
    head = make_head("rnn")
    logits, hidden = torch.randn(1, 3, V).repeat(400, 1, 1), torch.randn(1, 3, D).repeat(400, 1, 1)
    seed, offset = torch.full((400,), 9), torch.full((400,), 5)
    first, _ = draft(logits, head, hidden, seed=seed, offset=offset)
    assert (first == first[0]).all()  # the same key draws the same block in every row
    again, _ = draft(logits, head, hidden, seed=seed, offset=offset, tiles=(4, 16))
    assert torch.equal(again, first)
    moved, _ = draft(logits, head, hidden, seed=seed, offset=offset + torch.arange(400))
    assert len(set(map(tuple, moved.tolist()))) > 50  # each new offset draws anew


def test_ancestral_draft_compiles_to_the_eager_result():
    head = make_head("rnn")
    logits, hidden = torch.randn(5, 3, V).to(torch.bfloat16), torch.randn(5, 3, D)
    logits[3] = float("nan")
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 1.3])
    args = (hidden, head, torch.randint(0, V, (5,)), temperature, torch.arange(5) + 100,
            torch.arange(5), torch.tensor([4, 2, 0, 1, 3]))
    probs = [torch.zeros(5, 3, V), torch.zeros(5, 3, V)]
    want = ancestral_draft(logits, *args, probs[0], (4, 16))
    compiled = torch.compile(ancestral_draft, fullgraph=True, backend="aot_eager")
    got = compiled(logits, *args, probs[1], (4, 16))
    assert torch.equal(got, want)
    torch.testing.assert_close(probs[1], probs[0], rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles, fuse_bias", [(None, True), ((64, 32), True), (STEP_TILES, False), ((256, 2), False)],
                         ids=["default", "32rows", "bias-gemm", "bias-gemm-2rows"])
def test_cuda_graph_and_compiled_block_draw_what_eager_and_cpu_draw(tiles, fuse_bias):
    vocab, batch = 5000, 6
    torch.manual_seed(0)
    head = RNNMarkov(vocab, 32, D)
    cpu_inputs = [torch.randn(batch, 7, vocab).to(torch.bfloat16), torch.randn(batch, 7, D), head,
                  torch.randint(0, vocab, (batch,)), torch.tensor([1.0, 0.0, 0.7, 1.0, 1.3, 1.0]),
                  torch.arange(batch) + 5, torch.full((batch,), 3), torch.randperm(batch),
                  torch.zeros(batch, 7, vocab)]
    cpu_inputs[0][5] = float("nan")
    inputs = [copy.deepcopy(t).cuda() for t in cpu_inputs]
    offset, probs = inputs[6], inputs[8]
    with torch.inference_mode():
        cpu = ancestral_draft(*cpu_inputs, tiles, fuse_bias)
        eager = ancestral_draft(*inputs, tiles, fuse_bias)
        assert torch.equal(eager.cpu(), cpu)
        torch.testing.assert_close(probs.cpu(), cpu_inputs[8], rtol=1e-5, atol=1e-9)

        eager_probs = probs.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ancestral_draft(*inputs, tiles, fuse_bias)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ancestral_draft(*inputs, tiles, fuse_bias)
        probs.zero_()
        graph.replay()
        assert torch.equal(captured, eager) and torch.equal(probs, eager_probs)
        offset.add_(1)
        graph.replay()
        assert (captured != eager).float().mean() > 0.5  # a new offset draws anew
        assert torch.equal(captured, ancestral_draft(*inputs, tiles, fuse_bias))
        assert torch.equal(torch.compile(ancestral_draft, fullgraph=True)(*inputs, tiles, fuse_bias), captured)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn", None])
def test_greedy_draft_is_what_ancestral_draft_draws_for_greedy_rows(kind):
    head = make_head(kind) if kind else None
    B, K = 6, 4
    logits, hidden, anchor = 3 * torch.randn(B, K, V), torch.randn(B, K, D), torch.randint(0, V, (B,))
    logits[1, :, [2, 5]] = 30.0  # a tie: the smaller id
    logits[4] = float("nan")  # a padding row draws from the bias alone
    draft_probs = torch.zeros(B, K, V)
    seed, offset, slots = torch.arange(B), torch.zeros(B, dtype=torch.long), torch.arange(B)
    want = ancestral_draft(logits, hidden, head, anchor, torch.zeros(B), seed, offset, slots, draft_probs)
    assert torch.equal(greedy_draft(logits, hidden, head, anchor), want)
