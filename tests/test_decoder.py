"""SpeculativeDecoder end to end: greedy equality with the target's own decoding, losslessness at
T > 0 (chi-square on the first three emitted tokens: jointly, the first two, the first; each check's
power stated, a negative control for every case), stop conditions, and the compiled step."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from dspark import DrafterConfig, DSparkDrafter, SamplingParams, SpeculativeDecoder, TargetConfig, TargetModel
from dspark.engine import generate
from dspark.output import GenerationResult, StopCondition
from dspark.sampling import apply_filters
from dspark.tokenizer import Tokenizer
from stats import POWER, assert_differs, assert_matches, design, noncentrality, power


def tiny_pair(vocab=16, architecture="llama", logit_std=0.15, block_size=4, markov_rank=8, seed=0,
              drafter_window=None):
    """A random target whose next-token laws have moderate entropy (an untied LM head with small
    weights), and a random drafter sharing its embedding and head (with a two-sided sliding window
    over its context if `drafter_window`)."""
    torch.manual_seed(seed)
    config = TargetConfig(architecture=architecture, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=False)
    target = TargetModel(config).eval()
    torch.nn.init.normal_(target.lm_head.weight, std=logit_std)
    drafter_config = DrafterConfig.for_target(config, num_hidden_layers=1, block_size=block_size,
                                              target_layer_ids=[0, 1], markov_rank=markov_rank,
                                              mask_token_id=vocab - 1, sliding_window=drafter_window)
    drafter = DSparkDrafter(drafter_config, embed_tokens=target.embed_tokens, lm_head=target.lm_head).eval()
    return target, drafter


@torch.inference_mode()
def target_greedy(target: TargetModel, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decoding by full forwards, no cache and no decoder."""
    ids = list(prompt)
    for _ in range(n):
        logits, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None])
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_greedy_equals_target_greedy(architecture, k, method):
    target, drafter = tiny_pair(vocab=64, architecture=architecture, logit_std=1.0, block_size=7)
    prompts = [[1, 2, 3], [5, 9, 11, 2, 7], [4]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=k, rejection_sample_method=method)
    for prompt, result in zip(prompts, generate(decoder, prompts, params)):
        assert result.tokens == target_greedy(target, prompt, 12)
        assert len(result.accepted_per_position) == k


def test_greedy_rows_of_a_mixed_batch_equal_target_greedy():
    """A batch with a sampled request takes the ops' path (noise, proposals) for its greedy rows too."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=0)]
    for method in ("standard", "block"):
        decoder = SpeculativeDecoder(target, drafter, rejection_sample_method=method)
        greedy, _ = generate(decoder, [[1, 2, 3], [1, 2, 3]], params)
        assert greedy.tokens == target_greedy(target, [1, 2, 3], 12)


def test_greedy_drafts_without_rejection_sampling_are_lossless_and_plain_decoding_matches():
    target, drafter = tiny_pair(vocab=64, logit_std=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = target_greedy(target, [3, 1, 4], 10)
    assert generate(SpeculativeDecoder(target, None), [[3, 1, 4]], params)[0].tokens == expected
    greedy_drafts = SpeculativeDecoder(target, drafter, use_rejection_sampling=False)
    assert generate(greedy_drafts, [[3, 1, 4]], params)[0].tokens == expected
    no_drafts = SpeculativeDecoder(target, drafter, num_speculative_tokens=0)  # K = 0 with a drafter: none
    result = generate(no_drafts, [[3, 1, 4]], params)[0]
    assert (result.tokens, result.accepted_per_position, no_drafts.drafter) == (expected, [], None)


@torch.inference_mode()
def target_joint_law(target: TargetModel, prompt: list[int], temperature: float, top_p: float,
                     later_top_p: float | None = None) -> np.ndarray:
    """Exact law of the target's first three sampled tokens, [V, V, V] in float64; `later_top_p`: the
    top-p of the second and third tokens where it is not top_p (a negative control's law)."""
    vocab = target.config.vocab_size

    def next_probs(prefixes: list[list[int]], top_p: float) -> torch.Tensor:
        ids = torch.tensor([prompt + p for p in prefixes])
        logits, _ = target(ids, torch.arange(ids.shape[1]).expand_as(ids))
        logits = logits[:, -1:]
        n = len(prefixes)
        logits = apply_filters(logits, torch.full((n,), temperature), torch.zeros(n, dtype=torch.long),
                               torch.full((n,), top_p), torch.zeros(n))
        return (logits[:, 0].double() / temperature).softmax(-1)

    later = top_p if later_top_p is None else later_top_p
    p1 = next_probs([[]], top_p)[0]
    p2 = next_probs([[a] for a in range(vocab)], later)
    pairs = list(itertools.product(range(vocab), repeat=2))
    p3 = next_probs([list(pair) for pair in pairs], later).view(vocab, vocab, vocab)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def sample_first_three(decoder: SpeculativeDecoder, prompt: list[int], params: SamplingParams, n: int,
                       seed: int = 0) -> np.ndarray:
    """Counts [V^3] of the first three tokens of n requests (seeds seed n .. seed n + n - 1)."""
    params = [SamplingParams(**{**params.__dict__, "seed": seed * n + i}) for i in range(n)]
    results = generate(decoder, [prompt] * n, params)
    return first_three_counts([r.tokens for r in results], decoder.target.config.vocab_size)


def first_three_counts(tokens: list[list[int]], vocab: int) -> np.ndarray:
    first = np.array([t[:3] for t in tokens])
    return np.bincount(np.ravel_multi_index(first.T, (vocab,) * 3), minlength=vocab ** 3)


def first_three_checks(law: np.ndarray) -> dict[str, np.ndarray]:
    """The checks of the first three tokens, by name, as laws (or counts) over their bins: all three
    jointly, the first two jointly, the first alone."""
    vocab = round(len(law.ravel()) ** (1 / 3))
    law = law.reshape((vocab,) * 3)
    return {"all three": law.ravel(), "first two": law.sum(2).ravel(), "first token": law.sum((1, 2))}


# The smallest total-variation error each check detects with probability 0.99 at N_DRAWS (stats.design:
# the joint law's bins merge where few draws are expected, so their df is below V^3 - 1).
DETECTS = {"all three": 0.065, "first two": 0.045, "first token": 0.03}


def assert_first_three_match(counts: np.ndarray, law: np.ndarray, what: str, detects: dict = DETECTS) -> None:
    """Each check of the first three tokens passes, with at least the power `detects` states."""
    observed = first_three_checks(counts)
    for check, probs in first_three_checks(law).items():
        assert_matches(observed[check], probs, f"{what}, {check}", detects=detects[check])


def assert_first_two_differ(counts: np.ndarray, law: np.ndarray, what: str,
                            checks: tuple[str, ...] = ("all three", "first two")) -> None:
    """A negative control fails the joint checks (its first token, drawn at the prefill, may be right)."""
    observed, expected = first_three_checks(counts), first_three_checks(law)
    for check in checks:
        assert_differs(observed[check], expected[check], f"{what}, {check}")


N_DRAWS = 30000
N_CONTROL_DRAWS = 10000
# K = 4 checks several drafts verified in one step; K = 1 makes the three tokens come from
# different steps, so it checks what carries over from one step to the next (caches, offsets).
LOSSLESS_CASES = [("standard", 1.0, 1.0, 4), ("block", 1.0, 1.0, 4), ("standard", 0.7, 0.9, 4),
                  ("block", 0.7, 0.9, 4), ("standard", 1.0, 1.0, 1)]


@pytest.mark.parametrize("method,temperature,top_p,k", LOSSLESS_CASES)
def test_lossless_joint_law_of_first_three_tokens(method, temperature, top_p, k, rng_seed):
    """N_DRAWS requests of one prompt (V = 16): all three tokens jointly (df up to V^3 - 1, bins
    merged), the first two jointly and the first alone follow the target's exact law, each check with
    the power DETECTS states. The first token's check has power too: the same draws tested against the
    law at 0.8 T fail it (probability >= 0.99 from the exact laws); the joint checks' controls are the
    tests below (one per case)."""
    target, drafter = tiny_pair()
    prompt = [3, 7, 1]
    law = target_joint_law(target, prompt, temperature, top_p)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, ignore_eos=True)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=k, rejection_sample_method=method)
    counts = sample_first_three(decoder, prompt, params, N_DRAWS, rng_seed)
    assert_first_three_match(counts, law, f"{method} T={temperature} top_p={top_p} K={k}")
    colder = first_three_checks(target_joint_law(target, prompt, 0.8 * temperature, top_p))["first token"]
    assert power(noncentrality(first_three_checks(law)["first token"], colder, N_DRAWS),
                 design(colder, N_DRAWS).df) >= POWER
    assert_differs(first_three_checks(counts)["first token"], colder, "first token against the law at 0.8 T")


@pytest.mark.gpu
@pytest.mark.parametrize("method,temperature,top_p,k", LOSSLESS_CASES[:4])
def test_cuda_decoder_is_lossless(method, temperature, top_p, k, rng_seed):
    """The same test with the decoder on CUDA: its Triton kernels get their inputs as the decoder
    passes them (the drafts as a view of the step's token block). The law is the CPU model's."""
    target, drafter = tiny_pair()
    prompt = [3, 7, 1]
    law = target_joint_law(target, prompt, temperature, top_p)
    target.cuda(), drafter.cuda()
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, ignore_eos=True)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=k, rejection_sample_method=method)
    counts = sample_first_three(decoder, prompt, params, N_DRAWS, rng_seed)
    assert_first_three_match(counts, law, f"cuda {method} T={temperature}")


class MisstatedProposals(SpeculativeDecoder):
    """Negative control: drafts are drawn from the drafter's q, but verification is told they
    came from the uniform distribution."""

    def draft(self, anchor, start, draft_probs, *args, **kwargs):
        drafts = super().draft(anchor, start, draft_probs, *args, **kwargs)
        draft_probs.fill_(1.0 / draft_probs.shape[-1])
        return drafts


class RecordedProposals(SpeculativeDecoder):
    """Keeps every draft block and the proposals stored for it."""

    def draft(self, anchor, start, draft_probs, *args, **kwargs):
        drafts = super().draft(anchor, start, draft_probs, *args, **kwargs)
        self.recorded.append((drafts.clone(), draft_probs.clone()))
        return drafts


class TopPOnDrafts(SpeculativeDecoder):
    """Negative control for the filtered requests: top-p applied to the drafts' law instead of the
    target's. The steps verify against the unfiltered target (the prefill's first token keeps the
    filter), and the drafter's logits are filtered (see top_p_on_drafts). The output then follows the
    unfiltered law after the first token: exactly target_joint_law(..., later_top_p=1)."""

    def _verify(self, logits, drafts, draft_probs, sampling, offset):
        if drafts.shape[1]:
            sampling = dataclasses.replace(sampling, uses_filters=False)
        return super()._verify(logits, drafts, draft_probs, sampling, offset)


def top_p_on_drafts(monkeypatch, top_p: float) -> None:
    """Filters the drafter's base logits [B, K, V] at top_p before ancestral drafting draws from them."""
    import dspark.decoder as decoder_module
    draft = decoder_module.ancestral_draft

    def filtered_draft(logits, hidden, head, anchor, temperature, *rest):
        B = logits.shape[0]
        logits = apply_filters(logits.float(), temperature, torch.zeros(B, dtype=torch.long),
                               torch.full((B,), top_p), torch.zeros(B))
        return draft(logits, hidden, head, anchor, temperature, *rest)
    monkeypatch.setattr(decoder_module, "ancestral_draft", filtered_draft)


@pytest.mark.parametrize("method", ["standard", "block"])
def test_greedy_drafts_at_temperature_one_are_lossless_with_one_hot_proposals(method, rng_seed):
    """use_rejection_sampling=False at T = 1: the argmax chain, stated as one-hot proposals, and the
    output still the target's law (the same checks and power as the cases above; the control is
    test_misstated_proposals_fail_the_same_test's greedy case)."""
    target, drafter = tiny_pair()
    prompt = [3, 7, 1]
    law = target_joint_law(target, prompt, 1.0, 1.0)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    decoder = RecordedProposals(target, drafter, num_speculative_tokens=4, rejection_sample_method=method,
                                use_rejection_sampling=False)
    decoder.recorded = []
    assert_first_three_match(sample_first_three(decoder, prompt, params, N_DRAWS, rng_seed), law,
                             f"{method} greedy drafts")
    vocab = target.config.vocab_size
    for drafts, proposals in decoder.recorded:
        assert torch.equal(proposals, torch.nn.functional.one_hot(drafts, vocab).float())


@pytest.mark.parametrize("greedy_drafts", [False, True], ids=["sampled", "greedy drafts"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_misstated_proposals_fail_the_same_test(method, greedy_drafts, rng_seed):
    """The control of the T = 1, K = 4 cases (sampled drafts) and of the greedy-draft cases: drafts
    verified as if drawn from the uniform law fail the joint checks (N_CONTROL_DRAWS draws)."""
    target, drafter = tiny_pair()
    prompt = [3, 7, 1]
    law = target_joint_law(target, prompt, 1.0, 1.0)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    decoder = MisstatedProposals(target, drafter, num_speculative_tokens=4, rejection_sample_method=method,
                                 use_rejection_sampling=not greedy_drafts)
    counts = sample_first_three(decoder, prompt, params, N_CONTROL_DRAWS, rng_seed)
    assert_first_two_differ(counts, law, "misstated proposals")


@pytest.mark.parametrize("method", ["standard", "block"])
def test_top_p_on_the_drafts_instead_of_the_target_fails_the_same_test(method, monkeypatch, rng_seed):
    """The control of the T = 0.7, top-p 0.9 cases: TopPOnDrafts fails the joint checks, with
    probability >= 0.99 by its exact law (N_CONTROL_DRAWS draws)."""
    target, drafter = tiny_pair()
    prompt = [3, 7, 1]
    law = target_joint_law(target, prompt, 0.7, 0.9)
    wrong = target_joint_law(target, prompt, 0.7, 0.9, later_top_p=1.0)
    for check, probs in first_three_checks(law).items():
        if check != "first token":
            lam = noncentrality(first_three_checks(wrong)[check], probs, N_CONTROL_DRAWS)
            assert power(lam, design(probs, N_CONTROL_DRAWS).df) >= POWER, check
    top_p_on_drafts(monkeypatch, 0.9)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=3, ignore_eos=True)
    decoder = TopPOnDrafts(target, drafter, num_speculative_tokens=4, rejection_sample_method=method)
    assert_first_two_differ(sample_first_three(decoder, prompt, params, N_CONTROL_DRAWS, rng_seed), law,
                            "top-p on the drafts")


def test_noise_reused_across_steps_fails_the_same_test(monkeypatch, rng_seed):
    """The control of the K = 1 case, at the step boundary: every step draws with offset 0, so the
    steps of a request reuse one another's noise; it fails the joint checks."""
    import dspark.decoder as decoder_module
    verify, draft = decoder_module.verify, decoder_module.ancestral_draft
    monkeypatch.setattr(decoder_module, "verify", lambda *a: verify(*a[:6], torch.zeros_like(a[6]), a[7]))
    monkeypatch.setattr(decoder_module, "ancestral_draft",
                        lambda *a: draft(*a[:6], torch.zeros_like(a[6]), *a[7:]))
    target, drafter = tiny_pair()
    prompt = [3, 7, 1]
    law = target_joint_law(target, prompt, 1.0, 1.0)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=1)
    assert_first_two_differ(sample_first_three(decoder, prompt, params, N_CONTROL_DRAWS, rng_seed), law,
                            "noise reused")


def test_same_seed_reproduces_and_differs_across_seeds():
    target, drafter = tiny_pair(vocab=64)
    decoder = SpeculativeDecoder(target, drafter)
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    first, again, other = generate(decoder, [[1, 2, 3]] * 3, params)
    alone = generate(decoder, [[1, 2, 3]], params[0])[0]
    assert first.tokens == again.tokens == alone.tokens
    assert first.tokens != other.tokens


def test_stop_tokens_strings_and_max_tokens_end_where_plain_decoding_does():
    target, drafter = tiny_pair(vocab=64, logit_std=1.0)
    plain = target_greedy(target, [1, 2, 3], 20)
    stop_token = plain[5]
    cut = plain.index(stop_token) + 1

    class Digits:  # a tokenizer whose text is the ids joined by spaces
        eos_token_ids: list[int] = []

        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    stop_text = f"{plain[3]} {plain[4]}"
    decoder = SpeculativeDecoder(target, drafter, tokenizer=Digits())
    by_token, by_string, by_length = generate(decoder, [[1, 2, 3]] * 3, [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=20, stop=stop_text),
        SamplingParams(temperature=0, max_tokens=7)])
    assert by_token.tokens == plain[:cut] and by_token.finish_reason == "stop"
    text_end = next(i for i in range(1, 21) if stop_text in Digits().decode(plain[:i]))
    assert by_string.tokens == plain[:text_end] and by_string.finish_reason == "stop"
    assert by_length.tokens == plain[:7] and by_length.finish_reason == "length"


STOP_TEXT = "The fox, naïve café, 日本語 🤗🚀 Привет\n\n  def f(x): return x**2  # e\u0301 done"


def complete_text(tok: Tokenizer, ids: list[int]) -> str:
    """What a client has been sent of `ids`: the decode of their longest prefix that does not end
    in an incomplete character, special tokens skipped."""
    texts = (tok.decode(ids[:n], skip_special_tokens=True) for n in range(len(ids), -1, -1))
    return next(text for text in texts if not text.endswith("\ufffd"))


@pytest.mark.parametrize("stop", [["日本"], ["🚀 "], ["\n\n "], ["x**2", "Прив"], ["x"], ["e\u0301 d"],
                                  ["The fox,"], ["absent"]])
def test_stop_strings_end_at_the_first_token_whose_sent_text_holds_one(default_tokenizer, stop):
    tok = default_tokenizer
    ids = tok.encode(STOP_TEXT)  # byte-level BPE: several characters here span tokens
    ids[1:1] = [tok.token_to_id("<|im_start|>")] * 30  # skipped: "The fox," is text a client is sent
    expected = next((i for i in range(1, len(ids) + 1) if any(s in complete_text(tok, ids[:i]) for s in stop)), None)
    condition = StopCondition(SamplingParams(max_tokens=len(ids) + 1, stop=stop), eos_ids=[], tokenizer=tok)
    result = GenerationResult(tokens=[])
    condition.extend(result, ids)
    assert len(result.tokens) == (expected or len(ids))
    assert result.finished == (expected is not None)


def test_forced_acceptance_accepts_exactly_n_per_step():
    target, drafter = tiny_pair(vocab=64)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=4, forced_num_accepted=2)
    result = generate(decoder, [[1, 2]], SamplingParams(temperature=1.0, max_tokens=31, ignore_eos=True))[0]
    assert result.num_steps == 10  # 1 token from the prefill, then 3 per step
    assert result.accepted_per_position == [10, 10, 0, 0]


def test_prefill_attention_keeps_cudnn_out(monkeypatch):
    """cuDNN's attention plans every new shape anew; the prefill meets one per prompt length (decode
    steps have a shape per bucket: on CUDA they read the cache through dspark::paged_attention, on
    the CPU through SDPA, where cuDNN plays no part)."""
    target, drafter = tiny_pair(vocab=64)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=3)
    phase, cudnn_allowed = ["decode"], {"prefill": set(), "decode": set()}
    attention = torch.nn.functional.scaled_dot_product_attention

    def recording_attention(*args, **kwargs):
        cudnn_allowed[phase[0]].add(torch.backends.cuda.cudnn_sdp_enabled())
        return attention(*args, **kwargs)

    def recording_prefill(*args, **kwargs):
        phase[0] = "prefill"
        try:
            return SpeculativeDecoder.prefill(decoder, *args, **kwargs)
        finally:
            phase[0] = "decode"

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_attention)
    monkeypatch.setattr(decoder, "prefill", recording_prefill)
    generate(decoder, [[1, 2, 3], [4, 5]], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True))
    assert cudnn_allowed["prefill"] == {False}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the prefill


def test_bad_arguments_raise():
    target, drafter = tiny_pair()
    with pytest.raises(ValueError, match="exceeds the drafter's block_size"):
        SpeculativeDecoder(target, drafter, num_speculative_tokens=9)
    with pytest.raises(ValueError, match="rejection_sample_method"):
        SpeculativeDecoder(target, drafter, rejection_sample_method="tree")
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeDecoder(target, None, num_speculative_tokens=3)
    for k in (2.0, True, -1):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an int"):
            SpeculativeDecoder(target, drafter, num_speculative_tokens=k)
    assert SpeculativeDecoder(target, drafter, max_draft_len=2).k == 2  # TensorRT-LLM's name
    with pytest.raises(ValueError, match="num_speculative_tokens=2 and its alias max_draft_len=3 disagree"):
        SpeculativeDecoder(target, drafter, num_speculative_tokens=2, max_draft_len=3)
    decoder = SpeculativeDecoder(target, drafter)
    with pytest.raises(ValueError, match="0 SamplingParams for 1 prompts"):  # [] once meant the defaults
        generate(decoder, [[1]], [])
    with pytest.raises(ValueError, match="outside"):
        generate(decoder, [[1, 99]])
    with pytest.raises(ValueError, match="need a tokenizer"):
        generate(decoder, [[1]], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        generate(decoder, [[1]], cuda_graphs=True)
    for prompts in ([[1.0, 2.5]], [[True, 2]], [1, 2, 3], [torch.tensor([1, 2])], ["hello"]):
        with pytest.raises(ValueError, match="prompt 0 must be a list of token ids"):  # once deep in torch
            generate(decoder, prompts)
    with pytest.raises(ValueError, match="params must be SamplingParams, got dict"):
        generate(decoder, [[1]], [dict(max_tokens=3)])


def test_a_drafter_that_does_not_fit_the_target_is_refused_naming_why():
    """Each once failed deep inside the first step (a matmul of other dtypes or shapes, an index)."""
    target, drafter = tiny_pair()
    with pytest.raises(ValueError, match="the drafter is torch.bfloat16 on cpu, the target torch.float32"):
        SpeculativeDecoder(target, DSparkDrafter(drafter.config).to(torch.bfloat16))
    for change, words in [(dict(vocab_size=32), "vocab_size 32 does not match the target's 16"),
                          (dict(hidden_size=64, head_dim=16), "hidden_size 64 does not match the target's 32"),
                          (dict(target_layer_ids=[0, 5], num_target_layers=None), "out of range for a 3-layer")]:
        other = DSparkDrafter(dataclasses.replace(drafter.config, **change))
        with pytest.raises(ValueError, match=words):
            SpeculativeDecoder(target, other)


def test_an_eager_generate_frees_the_caches_and_the_target_runs_plainly_after_it():
    """A plain forward after generate once failed (the caches were left: inference tensors, too
    short, one row); the same forward gives the same logits as before."""
    target, drafter = tiny_pair(vocab=64)
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        before, _ = target(ids, torch.arange(12).expand(2, 12))
    generate(SpeculativeDecoder(target, drafter), [[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=4))
    assert target.kv_block_size is None and drafter.kv_block_size is None
    with torch.no_grad():
        after, _ = target(ids, torch.arange(12).expand(2, 12))
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("k", [0, 4])
def test_queuing_the_next_step_before_reading_this_one_changes_nothing(k):
    """With overlap (the engine's default on CUDA) generate queues step n + 1 before it reads step
    n, so a row runs one step past the step that ends it: the same tokens, counts and finish reasons
    as reading each step at once, for rows of other lengths, temperatures and ends (stop token,
    max_tokens), the cache big enough."""
    target, drafter = tiny_pair(vocab=64)
    decoder = SpeculativeDecoder(target, drafter if k else None, num_speculative_tokens=k)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]
    params = [SamplingParams(temperature=float(i % 2), max_tokens=12 + 5 * i, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    stop = generate(decoder, prompts, params)[0].tokens[5]  # a token the first row emits
    params = [dataclasses.replace(p, stop_token_ids=[stop]) for p in params]
    at_once = generate(decoder, prompts, params, overlap=False)
    behind = generate(decoder, prompts, params, overlap=True)
    fields = lambda r: (r.tokens, r.accepted_per_position, r.num_steps, r.finish_reason)
    assert [fields(r) for r in behind] == [fields(r) for r in at_once]
    assert {r.finish_reason for r in at_once} == {"stop", "length"}
    if k:  # the step past the end reaches furthest when every step accepts all K drafts
        full = SpeculativeDecoder(target, drafter, num_speculative_tokens=k, forced_num_accepted=k)
        for max_tokens in range(2, 3 * (k + 1)):
            result = generate(full, [[1, 2, 3]], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              overlap=True)[0]
            assert len(result.tokens) == max_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 4])
def test_generate_replayed_from_a_cuda_graph_equals_eager_steps(k):
    """cuda_graphs=True (self-distillation's generation on the GPU): the same tokens and acceptance
    counts as eager steps, for greedy and seeded sampled rows of other lengths in one batch, some
    ending early at a stop token."""
    target, drafter = tiny_pair(vocab=64)
    target.cuda(), drafter.cuda()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]
    decoder = SpeculativeDecoder(target, drafter if k else None, num_speculative_tokens=k)
    params = [SamplingParams(temperature=float(i % 2), max_tokens=12 + 5 * i, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    stop = generate(decoder, prompts, params)[0].tokens[5]  # a token the first row emits
    params = [dataclasses.replace(p, stop_token_ids=[stop]) for p in params]
    eager = generate(decoder, prompts, params, cuda_graphs=False)
    graphed = generate(decoder, prompts, params, cuda_graphs=True)
    assert [(r.tokens, r.accepted_per_position) for r in graphed] == \
        [(r.tokens, r.accepted_per_position) for r in eager]
    assert {r.finish_reason for r in eager} == {"stop", "length"}


def test_a_compiled_decoder_serves_any_length_and_batch_without_failing():
    """generate sizes the caches to each call, and the compiled step's graphs are specialized to
    the cache shape: every new length compiled again until Dynamo's recompile limit (8) failed the
    call. Twelve calls of other lengths and batch sizes, greedy and sampled: they run, and the
    caches grow by powers of two, so few graphs are compiled."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    target, drafter = tiny_pair(vocab=64)
    decoder = SpeculativeDecoder(target, drafter, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    for n in range(12):
        prompts = [[1 + i] * (2 + n + i) for i in range(1 + n % 2)]
        generate(decoder, prompts, SamplingParams(temperature=float(n % 2), max_tokens=3 + n, seed=n))
    assert target.layers[0].kv_cache.k_pool.shape[1] == 8  # 1 + 2 rows x 3 blocks of 16 (14 + 14 + 2 (K + 1)), to 8
    assert counters["stats"]["unique_graphs"] - graphs <= 6


def test_compiled_step_matches_eager(vectorized_inductor):
    """compile=True: the whole step through torch.compile(fullgraph=True) with Inductor and its SIMD
    code (about two minutes on 2 cores), a greedy and a sampled row in one batch."""
    target, drafter = tiny_pair(vocab=64)
    params = [SamplingParams(temperature=t, max_tokens=8, seed=5, ignore_eos=True) for t in (0.0, 1.0)]
    eager = generate(SpeculativeDecoder(target, drafter), [[1, 2, 3], [4, 5]], params)
    compiled = generate(SpeculativeDecoder(target, drafter, compile=True), [[1, 2, 3], [4, 5]], params)
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]
