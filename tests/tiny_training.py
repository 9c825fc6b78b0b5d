"""A tiny target and its own responses, shared by the drafter-training tests (tests/test_train_*.py).

The tiny target is random but has structure to learn: its LM head is scaled up so its next-token
distributions are peaked (entropy about 1 nat), and its own responses (self-distillation, as in
the real recipe) repeat n-grams of its near-deterministic transitions. A test module that uses the
fixtures imports them by name.
"""
import pytest
import torch

from dspark.config import DrafterConfig, TargetConfig
from dspark.data import Sequence
from dspark.train.self_distill import self_distill
from dspark.target import TargetModel

VOCAB = 64
PROMPT_LEN = 4


def random_prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (count, PROMPT_LEN), generator=generator).tolist()


def tiny_drafter_config(target: TargetModel, markov_rank: int = 16, markov_head_type: str = "vanilla") -> DrafterConfig:
    return DrafterConfig.for_target(
        target.config, num_hidden_layers=1, block_size=4, markov_rank=markov_rank, mask_token_id=0,
        target_layer_ids=[0, 2], enable_confidence_head=True, markov_head_type=markov_head_type)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    torch.manual_seed(0)
    target = TargetModel(TargetConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    return target.eval()


@pytest.fixture(scope="module")
def sequences(target, tmp_path_factory) -> list[Sequence]:
    path = tmp_path_factory.mktemp("data") / "sequences.jsonl"
    prompts = random_prompts(16, seed=1)
    sequences, done = self_distill(target, prompts, path, max_tokens=24, seed=0, stop_token_ids=[],
                                   responses_per_prompt=2, batch_size=32)
    assert done and len(sequences) == 32
    assert [s.tokens[:s.prompt_len] for s in sequences] == [p for p in prompts for _ in range(2)]
    return sequences
