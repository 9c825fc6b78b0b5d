"""The training recipe (TrainConfig) and the drafter it trains for a target (default_drafter_config)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from dspark.config import DrafterConfig, TargetConfig


@dataclass
class TrainConfig:
    """The recipe: everything that decides the trained weights (a resumed run must match it)."""
    steps: int = 6000
    batch_size: int = 64  # sequences per step
    bucket_batches: int = 1  # batches drawn together and sorted by length (see BatchOrder); 1: random
    num_anchors: int = 64  # blocks per sequence (fewer when the response is shorter)
    lr: float = 1e-3
    warmup: float = 0.04  # fraction of the steps
    grad_clip: float = 1.0
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    argmax_weight: float = 0.0  # CE against the target's argmax: aims at greedy (T = 0) agreement
    kl_weight: float = 0.0  # KL(target || draft): covers the target's mass where TV's gradient vanishes
    decay_gamma: float = 4.0  # position k weighs exp(-k / decay_gamma)
    reach_weights: bool = False  # and a slot by its reach along the text, relative to its position's (loss.py)
    followup_anchors: float = 0.0  # share of a sequence's anchors where a greedy decode steps (FollowUps)
    seed: int = 0
    rank0_twin: bool = True

    def __post_init__(self):
        # a negative clip norm ascends the gradient, a zero one never steps; gamma 0 makes the weights NaN
        checks = [(("steps", "batch_size", "bucket_batches", "num_anchors"), lambda v: v >= 1, "must be >= 1"),
                  (("lr", "grad_clip", "decay_gamma"), lambda v: math.isfinite(v) and v > 0, "must be > 0"),
                  (("ce_weight", "tv_weight", "confidence_weight", "argmax_weight", "kl_weight"),
                   lambda v: math.isfinite(v) and v >= 0, "must be >= 0"),
                  (("warmup", "followup_anchors"), lambda v: 0.0 <= v <= 1.0, "is a share, in [0, 1]")]
        for names, valid, rule in checks:
            for name in names:
                if not valid(getattr(self, name)):
                    raise ValueError(f"{name} {rule}, got {getattr(self, name)}")


# Five feature layers, not one per drafter layer: for SmolLM2 five decode better than three at T = 0,
# and seven no better than five (docs/training.md, the recipes tried).
NUM_FEATURE_LAYERS = 5


def build_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` target layers spread evenly over [1, n-3] (never the last layer, whose output is
    post-norm in HF), the middle one for a count of 1: z-lab's choice, whose drafters read one layer
    per drafter layer."""
    if count == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (count - 1)) for i in range(count)]


def default_drafter_config(target: TargetConfig, mask_token_id: int, num_layers: int = 3, block_size: int = 7,
                           markov_rank: int = 64, target_layer_ids: list[int] | None = None,
                           markov_head_type: str = "vanilla") -> DrafterConfig:
    """The drafter trained for `target`; its features come from `target_layer_ids` (default:
    NUM_FEATURE_LAYERS of them, build_target_layer_ids), of which none may be the target's last
    layer (DrafterConfig checks)."""
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(target.num_hidden_layers, NUM_FEATURE_LAYERS)
    return DrafterConfig.for_target(
        target, num_hidden_layers=num_layers, block_size=block_size, markov_rank=markov_rank,
        markov_head_type=markov_head_type, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
        enable_confidence_head=True)
