"""What the analysis scripts share: the held-out prompts' responses, as `python -m dspark.train`
makes them, and a drafter's teacher-forced logits at every anchor of a sequence."""
from __future__ import annotations

from pathlib import Path

import torch

from dspark.data import Sequence, heldout_prompts
from dspark.drafter import DSparkDrafter
from dspark.target import TargetModel
from dspark.train import heldout_sequences, parse_args


def heldout_responses(target: TargetModel, tokenizer, cache: Path) -> dict[str, list[Sequence]]:
    """The target's greedy and sampled responses to the held-out prompts, with the training
    command's defaults, generated into (or read from) `cache`."""
    trainer = parse_args(["--out", "unused"])
    sets = heldout_sequences(target.eval(), tokenizer, heldout_prompts(), cache,
                             max_prompt_tokens=trainer.max_prompt_tokens, max_tokens=trainer.max_tokens,
                             seed=trainer.seed, batch_size=160)
    target.drop_caches()  # left by the responses' generation; the scripts run plain causal forwards
    return sets


def draft_logits(drafter: DSparkDrafter, features: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's logits at every slot of the blocks at `anchors`, teacher-forced (each slot's
    Markov bias from the true token before it). features [1, S, m * d]; tokens [1, S], S > the last
    anchor + K - 1; anchors [N] -> [N, K, V]."""
    base, hidden = drafter.forward_train(features, tokens, anchors[None])  # [1, N, K, V], [1, N, K, d]
    at = anchors[:, None] + torch.arange(drafter.block_size)  # slot j drafts the token after at[:, j]
    bias = drafter.teacher_forced_bias(tokens[:, at], hidden)
    return (base if bias is None else base + bias)[0]
