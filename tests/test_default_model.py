"""The real default target (SmolLM2-135M-Instruct from its GGUF): speculative decoding at T = 0 is
token-identical to the target's own greedy decoding, with a randomly initialised drafter (which
exercises rejections everywhere) and with the shipped, trained drafter; and the prompts it writes
for its own training data."""
from __future__ import annotations

import json

import pytest
import torch

from dspark import DrafterConfig, DSparkDrafter, SamplingParams, SpeculativeDecoder, load_default
from dspark.engine import generate
from test_decoder import target_greedy as greedy_continuation

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def default_pair():
    return load_default()


@pytest.fixture(scope="module")
def prompt(default_pair):
    _, _, tokenizer = default_pair
    return tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                         tokenize=True)


@pytest.fixture(scope="module")
def target_greedy(default_pair, prompt):
    return greedy_continuation(default_pair[0], prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def random_drafter(default_pair):
    target, _, _ = default_pair
    torch.manual_seed(0)
    config = DrafterConfig.for_target(target.config, num_hidden_layers=1, block_size=7, target_layer_ids=[1, 14],
                                      markov_rank=16, mask_token_id=16)
    return DSparkDrafter(config, embed_tokens=target.embed_tokens, lm_head=target.lm_head).eval()


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 7])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_random_drafter_greedy_is_the_targets(default_pair, random_drafter, prompt, target_greedy, k, method):
    target, _, _ = default_pair
    decoder = SpeculativeDecoder(target, random_drafter, num_speculative_tokens=k, rejection_sample_method=method)
    assert generate(decoder, [prompt], GREEDY)[0].tokens == target_greedy


def test_shipped_drafter_greedy_is_the_targets_and_accepts(default_pair, prompt, target_greedy):
    target, drafter, _ = default_pair
    result = generate(SpeculativeDecoder(target, drafter), [prompt], GREEDY)[0]
    assert result.tokens == target_greedy
    assert result.accepted_per_position[1] > 0  # the trained drafter gets several drafts accepted in a step


def test_the_target_writes_prompts_that_end_and_are_kept_once(default_pair, tmp_path):
    """dspark.train.self_distill.synthetic_prompts on SmolLM2: of 12 attempts at a user message (48 tokens at most)
    the kept ones are those the target ended itself, each text once, no template token inside; a
    prompt given as held-out is left out, and a second call reads the cache."""
    from dspark.data import Prompt
    from dspark.train.self_distill import synthetic_prompts
    target, _, tokenizer = default_pair
    kept = synthetic_prompts(target, tokenizer, tmp_path / "w.jsonl", 12, seed=0, max_tokens=48, batch_size=12)
    rows = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()[1:]]
    ended = [r for r in rows if r["tokens"][-1] in tokenizer.eos_token_ids]
    assert len(rows) == 12 and 0 < len(kept) <= len(ended) < 12
    assert len({p.text for p in kept}) == len(kept)
    assert all(p.text and "<|" not in p.text for p in kept)
    again = synthetic_prompts(target, tokenizer, tmp_path / "w.jsonl", 12, seed=0, max_tokens=48, batch_size=12,
                              exclude=[Prompt(kept[0].text, "chat")])
    assert again == kept[1:]
