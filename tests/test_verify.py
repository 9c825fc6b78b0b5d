"""dspark::verify: the verification rules' exact laws, losslessness of the op, greedy rows, plain
sampling (K = 0), padding rows, opcheck and torch.compile, on CPU; the `gpu` tests run the Triton
kernels on CUDA (losslessness, equality with the torch implementation at V = 200064, CUDA graphs).

The statistical tests use tests/stats.py (a false alarm 1e-7 per check), state the smallest
total-variation error each check detects with probability 0.99, and are sized so that the op's
residual, broken in any of the ways of verify_reference.BROKEN_RESIDUALS, is detected with probability
>= 0.99 (from the exact laws of the independent reference). Every check has a negative control that
must fail it, shown to have that probability first. Their draws derive from the `rng_seed` fixture
(DSPARK_TEST_SEED).
"""
import itertools
import math

import numpy as np
import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from dspark.ops.verify import greedy_verify, verify_torch
from dspark.sampling import apply_filters
from stats import POWER, assert_differs, assert_matches, design, noncentrality, power
from verify_reference import BROKEN_RESIDUALS, reference_law

verify = torch.ops.dspark.verify


# ---------------------------------------------------------------- exact laws (float64, from the spec)

def step_outcomes(p, q, drafts, rule):
    """For one draft block: P(n = j) for j = 0..K and the law of the token emitted after j accepted
    drafts. p: K+1 target rows, q: K proposal rows (float64 [V] each)."""
    K = len(drafts)
    ratio = [p[i][d] / q[i][d] if q[i][d] > 0 else 0.0 for i, d in enumerate(drafts)]
    if rule == "standard":
        accept = [min(1.0, r) for r in ratio]
        law_n = [math.prod(accept[:j]) * (1 - accept[j]) for j in range(K)] + [math.prod(accept)]
        scale = [1.0] * K
    else:  # block verification, kernels.md section 1.2
        scale = [1.0]
        for r in ratio:
            scale.append(min(1.0, scale[-1] * r))
        mass = [np.maximum(scale[i] * p[i] - q[i], 0).sum() for i in range(K)]
        h = [1.0] + [mass[i] / (mass[i] + 1 - scale[i]) if mass[i] + 1 - scale[i] > 0 else 1.0
                     for i in range(1, K)] + [scale[K]]
        law_n = [(h[j] if j else 1.0) * math.prod(1 - h[i] for i in range(j + 1, K + 1)) for j in range(K + 1)]
    tokens = []
    for j in range(K):
        residual = np.maximum(scale[j] * p[j] - q[j], 0)
        tokens.append(residual / residual.sum() if residual.sum() > 0 else p[j])
    return law_n, tokens + [p[K]]


def exact_step_law(P, Q, x0, K, rule, Q_draw=None):
    """Exact law of one verification step over a bigram target P[prev, next] and bigram proposals Q,
    by enumerating every draft block (drawn from Q_draw, default Q) and the verifier's randomness.
    Returns the law [V]*(K+1) of the first K+1 generated tokens (the emitted tokens, continued with
    target samples) and the law [K+1] of the accepted count."""
    V = P.shape[0]
    Q_draw = Q if Q_draw is None else Q_draw
    continuation = [np.ones(V)]  # continuation[m][y, ...]: law of the m tokens after y
    for m in range(K):
        continuation.append(np.einsum("yz,z...->yz...", P, continuation[-1]))
    tokens, accepted = np.zeros((V,) * (K + 1)), np.zeros(K + 1)
    for drafts in itertools.product(range(V), repeat=K):
        prev = (x0,) + drafts
        weight = math.prod(Q_draw[prev[i], drafts[i]] for i in range(K))
        law_n, law_token = step_outcomes([P[x] for x in prev], [Q[x] for x in prev[:K]], drafts, rule)
        for n in range(K + 1):
            accepted[n] += weight * law_n[n]
            then = np.einsum("y,y...->y...", law_token[n], continuation[K - n])  # the token, then the target
            tokens[drafts[:n]] += weight * law_n[n] * then
    return tokens, accepted


def target_law(P, x0, K):
    law = P[x0]
    for _ in range(K):
        law = np.einsum("...y,yz->...yz", law, P)
    return law


def random_bigram(V, rng, scale=1.5):
    logits = rng.normal(size=(V, V)) * scale
    return np.exp(logits) / np.exp(logits).sum(1, keepdims=True)


@pytest.mark.parametrize("rule", ["standard", "block"])
@pytest.mark.parametrize("V, K", [(3, 1), (3, 2), (3, 3), (4, 2), (4, 3)])
def test_rules_are_lossless_exactly(rule, V, K):
    rng = np.random.default_rng(V * 10 + K)
    P, Q = random_bigram(V, rng), random_bigram(V, rng)
    Q[1, 2] = 0.0  # a token the drafter never proposes after token 1
    Q /= Q.sum(1, keepdims=True)
    tokens, accepted = exact_step_law(P, Q, 0, K, rule)
    np.testing.assert_allclose(tokens, target_law(P, 0, K), rtol=0, atol=1e-12)
    assert accepted.sum() == pytest.approx(1.0, abs=1e-12)
    if rule == "block":
        _, standard = exact_step_law(P, Q, 0, K, "standard")
        assert accepted @ np.arange(K + 1) >= standard @ np.arange(K + 1) - 1e-12
    wrong, _ = exact_step_law(P, Q, 0, K, rule, Q_draw=random_bigram(V, rng))
    assert np.abs(wrong - target_law(P, 0, K)).max() > 1e-3  # the check can fail


def test_block_verification_reproduces_the_papers_toy():
    """Sun et al.: binary vocabulary, p = (1/3, 2/3), q = (2/3, 1/3), context-free; expected accepted
    tokens 10/9 (standard) and 11/9 (block) for K = 2."""
    P = np.tile([1 / 3, 2 / 3], (2, 1))
    Q = np.tile([2 / 3, 1 / 3], (2, 1))
    for rule, expected in (("standard", 10 / 9), ("block", 11 / 9)):
        _, accepted = exact_step_law(P, Q, 0, 2, rule)
        assert accepted @ np.arange(3) == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------- the op against those laws

V, K, N = 8, 3, 50_000
N_CONTROL = 30_000  # draws of a negative control


def bigram_models(temperature, filters):
    """A bigram target: its logits table [prev, next] and its law P (float64) after the request's
    filter; and a bigram drafter near it: Q, the proposals at `temperature` (float32), which never
    proposes token 3 prev + 1 (mod V) after prev, where the target may (q = 0 where p > 0)."""
    rng = np.random.default_rng(123)
    table = torch.tensor(rng.normal(size=(V, V)) * 1.5, dtype=torch.float32)
    Q = torch.softmax((table + torch.tensor(rng.normal(size=(V, V)), dtype=torch.float32)) / temperature, -1)
    Q[torch.arange(V), (3 * torch.arange(V) + 1) % V] = 0.0
    P = torch.softmax(top_p_filter(table[None], temperature, filters)[0].double() / temperature, -1)
    return table, P, Q / Q.sum(-1, keepdim=True)


def top_p_filter(logits, temperature, filters):
    """The target side of requests with top_p = 0.9 (when `filters`); drafts use the temperature only."""
    if not filters:
        return logits
    B = logits.shape[0]
    return apply_filters(logits, torch.full((B,), temperature), torch.zeros(B, dtype=torch.int64),
                         torch.full((B,), 0.9), torch.zeros(B))


def run_bigram(rule, temperature, filters, draw=None, seed=0, device="cpu", n=N):
    """n requests after token 0, each drafting K tokens ancestrally from `draw` (default Q) and verified
    by the op (on `device`) against Q. Returns the generated tokens [n, K+1] (the step's emitted tokens
    continued with target samples, as the next steps would) and the accepted counts [n]."""
    table, P, Q = bigram_models(temperature, filters)
    draw = Q if draw is None else draw
    generator = torch.Generator().manual_seed(seed)
    prev = torch.zeros(n, K + 1, dtype=torch.int64)
    for i in range(K):
        prev[:, i + 1] = torch.multinomial(draw[prev[:, i]], 1, generator=generator).squeeze(1)
    seeds = torch.randint(0, 2**62, (n,), generator=generator)
    offsets = torch.randint(0, 2**40, (n,), generator=generator)
    target_logits = top_p_filter(table[prev], temperature, filters)
    args = (target_logits, prev[:, 1:].contiguous(), Q[prev[:, :K]], torch.arange(n),
            torch.full((n,), temperature), seeds, offsets)
    emitted, n = (x.cpu() for x in verify(*(x.to(device) for x in args), rule == "block"))
    generated = emitted.clone()
    for j in range(1, K + 1):
        sample = torch.multinomial(P[generated[:, j - 1]], 1, generator=generator).squeeze(1)
        generated[:, j] = torch.where(j > n, sample, generated[:, j])
    return generated, n


def histogram(values, bins):
    return np.bincount(values.numpy(), minlength=bins)


def first_two(law):
    return law.sum(axis=tuple(range(2, law.ndim))).ravel()


def token_checks(law):
    """The laws the generated tokens are checked against, by name: each position's, the first two
    tokens' jointly, all K+1 jointly."""
    checks = {f"position {j}": law.sum(axis=tuple(a for a in range(K + 1) if a != j)) for j in range(K + 1)}
    return {**checks, "first two": first_two(law), "all": law.ravel()}


def token_counts(generated):
    """The generated tokens' counts over token_checks's bins."""
    counts = {f"position {j}": histogram(generated[:, j], V) for j in range(K + 1)}
    joint = np.ravel_multi_index(generated.T.numpy(), (V,) * (K + 1))
    return {**counts, "first two": histogram(generated[:, 0] * V + generated[:, 1], V * V),
            "all": np.bincount(joint, minlength=V ** (K + 1))}


def exact_laws(rule, temperature, filters, draw=None):
    """P and Q as float64, and the exact law of the generated tokens and of the accepted count when the
    drafts come from `draw` (default Q), by the independent reference (verify_reference.reference_law)."""
    _, P, Q = bigram_models(temperature, filters)
    P, Q = P.numpy(), Q.double().numpy()
    Q = Q / Q.sum(-1, keepdims=True)
    draw = Q if draw is None else draw
    tokens, accepted = reference_law(P, Q, 0, K, rule == "block", draw=draw)
    return P, Q, tokens, accepted


def detection(wrong: dict, expected: dict, n: int = N) -> float:
    """The probability that the strongest of the checks (n draws) detects laws `wrong`."""
    return max(power(noncentrality(wrong[what], law, n), design(law, n).df) for what, law in expected.items())


LOSSLESS_CASES = [(rule, t, f) for rule in ("standard", "block") for t, f in ((1.0, False), (0.7, True))]
DETECTS = {"position": 0.02, "first two": 0.026, "all": 0.043, "accepted count": 0.019}  # TV, probability 0.99


@pytest.mark.parametrize("rule, temperature, filters", LOSSLESS_CASES)
def test_op_is_lossless(rule, temperature, filters, rng_seed, device="cpu"):
    """N = 50k requests, V = 8, K = 3, proposals conditioned on the previous draft and zero at some
    tokens the target may take. Each position's tokens, the first two jointly and all four jointly
    follow the target, and the accepted counts the rule's exact law (so the op also accepts as much as
    the rule promises). Each check detects a total-variation error of DETECTS (0.02 at a position
    (df 7), 0.026 the pair (df 63), 0.043 all four (df 902), 0.019 the count (df 3); stats.design)
    with probability 0.99, and together they detect each of BROKEN_RESIDUALS (the op with its residual
    wrong in one way; their exact laws from the reference) with probability >= 0.99: N is chosen for
    that, the rarest being rho dropped at T = 0.7 (0.998 at 40k draws)."""
    P, Q, law, law_accepted = exact_laws(rule, temperature, filters)
    np.testing.assert_allclose(law, target_law(P, 0, K), rtol=0, atol=1e-12)
    expected = token_checks(law)
    for name, broken in BROKEN_RESIDUALS.items():
        if name != "rho dropped" or rule == "block":
            wrong, _ = reference_law(P, Q, 0, K, rule == "block", broken)
            assert detection(token_checks(wrong), expected) >= POWER, name
    generated, n = run_bigram(rule, temperature, filters, seed=rng_seed, device=device)
    observed = token_counts(generated)
    for what, probs in expected.items():
        assert_matches(observed[what], probs, what, detects=DETECTS[what.split()[0] if "position" in what else what])
    assert_matches(histogram(n, K + 1), law_accepted, "accepted count", detects=DETECTS["accepted count"])


@pytest.mark.parametrize("rule, temperature, filters", LOSSLESS_CASES)
def test_negative_controls_fail_every_check(rule, temperature, filters, rng_seed):
    """The checks of test_op_is_lossless have power, each of them:
    - drafts drawn at temperature 0.6 relative to the proposals the op is told (q' ~ q^(1/0.6), a
      proposal stored at the wrong temperature) fail every token check and the count check;
    - verification by the other rule (lossless too) fails the count check.
    N_CONTROL = 30k draws each; each failure is first shown to have probability >= 0.99 from the
    exact laws."""
    P, Q, law, law_accepted = exact_laws(rule, temperature, filters)
    draw = Q ** (1 / 0.6)
    draw /= draw.sum(-1, keepdims=True)
    _, _, wrong, wrong_accepted = exact_laws(rule, temperature, filters, draw)
    expected, wrong = token_checks(law), {**token_checks(wrong), "accepted count": wrong_accepted}
    expected["accepted count"] = law_accepted
    for what, probs in expected.items():
        assert detection({what: wrong[what]}, {what: probs}, N_CONTROL) >= POWER, what
    generated, n = run_bigram(rule, temperature, filters, torch.tensor(draw, dtype=torch.float32), rng_seed,
                              n=N_CONTROL)
    observed = {**token_counts(generated), "accepted count": histogram(n, K + 1)}
    for what, probs in expected.items():
        assert_differs(observed[what], probs, f"wrong proposals, {what}")

    other = "block" if rule == "standard" else "standard"
    _, _, _, other_accepted = exact_laws(other, temperature, filters)
    assert detection({"count": other_accepted}, {"count": law_accepted}, N_CONTROL) >= POWER
    _, n = run_bigram(other, temperature, filters, seed=rng_seed, n=N_CONTROL)
    assert_differs(histogram(n, K + 1), law_accepted, f"{other} verification's counts")


# ---------------------------------------------------------------- greedy rows, K = 0, padding

def random_inputs(B, K, V, seed, temperature, slots=None):
    """Random verifier inputs: drafts drawn from random proposals, one slot per request."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=generator) * 2
    draft_probs = torch.softmax(logits[:, :K] + torch.randn(B, K, V, generator=generator), -1)
    drafts = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=generator).view(B, K)
    seeds = torch.randint(0, 2**62, (B,), generator=generator)
    offsets = torch.randint(0, 2**40, (B,), generator=generator)
    return [logits, drafts, draft_probs, torch.arange(B), torch.tensor(temperature).float().expand(B).clone(),
            seeds, offsets]


@pytest.mark.parametrize("block", [False, True])
def test_greedy_rows_follow_the_argmax(block):
    B, K, V = 6, 4, 50
    logits, drafts, draft_probs, slots, temperature, seeds, offsets = random_inputs(B, K, V, 0, 0.0)
    temperature[1] = 1.0  # a sampled row in the batch changes nothing for the others
    logits[2, 2, [7, 30]] = logits[2, 2].max() + 1  # a tie at a position row 2 emits: the smaller id wins
    argmax = logits.argmax(-1)
    agree = [1, 0, 4, 2, 0, 3]  # leading drafts that equal the argmax
    for b, m in enumerate(agree):
        drafts[b, :m] = argmax[b, :m]
        if m < K:
            drafts[b, m] = (argmax[b, m] + 1) % V
    emitted, n = verify(logits, drafts, draft_probs, slots, temperature, seeds, offsets, block)
    assert argmax[2, 2] == 7 and emitted[2, 2] == 7
    for b, m in enumerate(agree):
        if b == 1:
            continue
        assert n[b] == m
        assert emitted[b, :m + 1].tolist() == argmax[b, :m + 1].tolist()
        assert (emitted[b, m + 1:] == -1).all()


def test_plain_sampling_without_drafts(rng_seed):
    """K = 0 draws one token from softmax(logits / T): 20k requests with one logits row, V = 16, T = 0.7
    (detecting a TV of 0.034). Negative control: the same draws tested against T = 1 must fail (with
    probability >= 0.99 by the exact laws)."""
    B, V = 20_000, 16
    generator = torch.Generator().manual_seed(3 + rng_seed)
    row = torch.randn(V, generator=generator) * 1.5
    seeds = torch.randint(0, 2**62, (B,), generator=generator)
    offsets = torch.randint(0, 2**40, (B,), generator=generator)
    args = [row.expand(B, 1, V), torch.zeros(B, 0, dtype=torch.int64), torch.zeros(1, 0, V),
            torch.zeros(B, dtype=torch.int64), torch.full((B,), 0.7), seeds, offsets]
    emitted, n = verify(*args, False)
    assert emitted.shape == (B, 1) and (n == 0).all()
    assert torch.equal(verify(*args, True)[0], emitted)  # block verification of nothing is the same draw
    counts = histogram(emitted[:, 0], V)
    law = torch.softmax(row.double() / 0.7, -1).numpy()
    assert_matches(counts, law, "K = 0 sample", detects=0.034)
    at_one = torch.softmax(row.double(), -1).numpy()
    assert power(noncentrality(law, at_one, B), design(at_one, B).df) >= POWER
    assert_differs(counts, at_one, "K = 0 sample at the wrong temperature")

    assert torch.equal(verify(*args, False)[0], emitted)  # same seed and offset, same tokens
    args[6] = offsets + 1
    assert (verify(*args, False)[0] != emitted).float().mean() > 0.5


@pytest.mark.parametrize("block", [False, True])
def test_nan_rows_give_in_range_tokens(block):
    B, K, V = 4, 3, 40
    args = random_inputs(B, K, V, 1, 1.0)
    args[0][1:] = float("nan")
    args[4][3] = 0.0
    emitted, n = verify(*args, block)
    assert ((0 <= n) & (n <= K)).all()
    token = emitted.gather(1, n[:, None])
    assert ((0 <= token) & (token < V)).all()


def test_bad_inputs_name_the_tensor():
    args = random_inputs(2, 3, 10, 2, 1.0)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(args[0], args[1][:, :2], *args[2:], False)
    with pytest.raises(ValueError, match="temperature"):
        verify(*args[:4], args[4].double(), *args[5:], False)


# ---------------------------------------------------------------- registration and compile

@pytest.mark.parametrize("block, dtype, K",
                         [(False, torch.float32, 2), (True, torch.bfloat16, 2), (True, torch.float32, 0)])
def test_opcheck(block, dtype, K):
    args = random_inputs(3, K, 24, 4, [0.8, 0.0, 1.0])
    args[0] = args[0].to(dtype)
    torch.library.opcheck(verify, (*args, block))


def no_host_sync(gm, example_inputs):
    """A compile backend that fails on host syncs in the traced (decomposed) graph."""
    def inspect(graph_module, inputs):
        for node in graph_module.graph.nodes:
            assert node.target not in (torch.ops.aten._local_scalar_dense.default,
                                       torch.ops.aten.nonzero.default), node
            assert not (node.op == "call_method" and node.target in ("item", "tolist")), node
        return graph_module.forward
    return aot_autograd(fw_compiler=inspect)(gm, example_inputs)


@pytest.mark.parametrize("backend, block", [("aot_eager", False), ("aot_eager", True), (no_host_sync, False),
                                            (no_host_sync, True), ("inductor", True)])
def test_compiles_fullgraph_and_matches_eager(backend, block):
    def step(logits, drafts, draft_probs, slots, temperature, seeds, offsets):
        return verify(logits, drafts, draft_probs, slots, temperature, seeds, offsets, block)

    args = random_inputs(4, 3, 32, 6, [1.0, 0.0, 0.7, 1.0])
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for got, expected in zip(compiled(*args), step(*args)):
        assert torch.equal(got, expected)


# ---------------------------------------------------------------- GPU: the Triton kernels

@pytest.mark.gpu
@pytest.mark.parametrize("rule, temperature, filters", LOSSLESS_CASES)
def test_gpu_op_is_lossless(rule, temperature, filters, rng_seed):
    test_op_is_lossless(rule, temperature, filters, rng_seed, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernels_match_torch_at_full_vocabulary(block, dtype):
    """B = 32, K = 7, V = 200064: the kernels and the torch implementation on the GPU draw the same
    tokens; rows 0-3 are greedy, row 4 is padding (NaN), the others sample at T between 0.5 and 1.5."""
    B, K, V = 32, 7, 200064
    generator = torch.Generator().manual_seed(8)
    logits = (torch.randn(B, K + 1, V, generator=generator) * 3).cuda()
    probs = torch.softmax(logits[:, :K] + torch.randn(B, K, V, generator=generator).cuda(), -1)
    drafts = torch.multinomial(probs.view(-1, V), 1).view(B, K)
    drafts[:4, :3] = logits[:4, :3].argmax(-1)
    logits[4] = float("nan")
    temperature = (torch.rand(B, generator=generator) + 0.5).cuda()
    temperature[:4] = 0.0
    seeds = torch.randint(0, 2**62, (B,), generator=generator).cuda()
    offsets = torch.randint(0, 2**40, (B,), generator=generator).cuda()
    args = (logits.to(dtype), drafts, probs, torch.arange(B, device="cuda"), temperature, seeds, offsets, block)
    emitted, n = verify(*args)
    expected, expected_n = verify_torch(*args)
    assert torch.equal(n, expected_n) and torch.equal(emitted, expected)
    assert (n[5:] > 0).sum() >= 4  # sampled rows accept drafts too: the comparison covers acceptance


@pytest.mark.gpu
@pytest.mark.parametrize("block", [False, True])
def test_gpu_compile_and_cuda_graph_match_eager(block):
    args = [x.cuda() for x in random_inputs(8, 7, 5000, 9, [1.0, 0.0, 0.7, 1.0] * 2)]
    expected = verify(*args, block)

    def step(*a):
        return verify(*a, block)

    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(*args), expected):
        assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = verify(*args, block)
    args[6].add_(1)  # a new offset draws anew; restoring it replays the eager draw
    graph.replay()
    moved = [x.clone() for x in static]
    args[6].sub_(1)
    graph.replay()
    for got, want in zip(static, expected):
        assert torch.equal(got, want)
    assert not torch.equal(moved[0], expected[0])


def test_greedy_verify_is_what_verify_does_for_greedy_rows():
    B, K, V = 8, 4, 50
    logits, drafts, draft_probs, slots, temperature, seeds, offsets = random_inputs(B, K, V, 0, 0.0)
    argmax = logits.argmax(-1)
    for b in range(B):  # row b agrees with the argmax for its first b % (K + 1) drafts
        m = b % (K + 1)
        drafts[b, :m] = argmax[b, :m]
    logits[3, 1, [4, 9]] = logits[3, 1].max() + 1  # a tie
    logits[6] = float("nan")
    for block in (False, True):
        want = verify(logits, drafts, draft_probs, slots, temperature, seeds, offsets, block)
        got = greedy_verify(logits, drafts)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
