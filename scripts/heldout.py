"""What the analysis scripts share: the models (float32, CPU), the held-out prompts' responses, as
`python -m dspark.train` makes them, the target's forward over a sequence and a drafter's
teacher-forced logits at every anchor of it."""
from __future__ import annotations

from pathlib import Path

import torch

from dspark.checkpoint import load_drafter
from dspark.data import Sequence, heldout_prompts
from dspark.drafter import DSparkDrafter
from dspark.loading import load_default, load_default_target
from dspark.target import TargetModel
from dspark.train import heldout_sequences, parse_args


def load_pair(drafter: Path | None) -> tuple[TargetModel, DSparkDrafter, object]:
    """The default target in float32 on the CPU, the drafter at `drafter` (default: the shipped one;
    not read only to be replaced) and the tokenizer."""
    if drafter is None:
        return load_default(dtype=torch.float32, device="cpu")
    target, tokenizer = load_default_target(dtype=torch.float32, device="cpu")
    return target, load_drafter(drafter, target), tokenizer


def target_forward(target: TargetModel, drafter: DSparkDrafter, tokens: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's plain forward over `tokens` padded with K zeros (so every anchor has K slots;
    those past the end have no label): ids [1, S + K], logits [1, S + K, V] and the drafter's context
    features [1, S + K, m * d]."""
    ids = torch.tensor(tokens + [0] * drafter.block_size)[None]
    logits, features = target(ids, torch.arange(ids.shape[1])[None], hidden_layer_ids=drafter.config.target_layer_ids)
    return ids, logits, features


def heldout_responses(target: TargetModel, tokenizer, cache: Path) -> dict[str, list[Sequence]]:
    """The target's greedy and sampled responses to the held-out prompts, with the training
    command's defaults, generated into (or read from) `cache`."""
    trainer = parse_args(["--out", "unused"])
    return heldout_sequences(target.eval(), tokenizer, heldout_prompts(), cache,
                             max_prompt_tokens=trainer.max_prompt_tokens, max_tokens=trainer.max_tokens,
                             seed=trainer.seed, batch_size=160)


def draft_logits(drafter: DSparkDrafter, features: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's logits at every slot of the blocks at `anchors`, teacher-forced (each slot's
    Markov bias from the true token before it). features [1, S, m * d]; tokens [1, S], S > the last
    anchor + K - 1; anchors [N] -> [N, K, V]."""
    base, hidden = drafter.forward_train(features, tokens, anchors[None])  # [1, N, K, V], [1, N, K, d]
    at = anchors[:, None] + torch.arange(drafter.block_size)  # slot j drafts the token after at[:, j]
    bias = drafter.teacher_forced_bias(tokens[:, at], hidden)
    return (base if bias is None else base + bias)[0]
