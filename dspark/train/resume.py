"""A run's checkpoint (resumable: weights, optimizer and scheduler states, step, follow-ups) and its
export in DeepSpec's format."""
from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import torch

from dspark.checkpoint import save_drafter
from dspark.config import DrafterConfig
from dspark.data import Sequence
from dspark.train.batches import FollowUps
from dspark.train.recipe import TrainConfig
from dspark.train.students import Student

CHECKPOINT = "checkpoint.pt"


def refuse_overwrite(checkpoint: Path, resume: bool) -> None:
    """FileExistsError if `checkpoint` exists and the run does not resume it."""
    if checkpoint.exists() and not resume:
        raise FileExistsError(f"{checkpoint} exists: pass --resume to continue it, or use another --out")


def data_signature(sequences: list[Sequence]) -> dict[str, int]:
    """What a checkpoint records of its training data, to be met again on a resume: other generation
    options (prompts, responses, lengths) make other counts."""
    return {"sequences": len(sequences), "prompt_tokens": sum(s.prompt_len for s in sequences),
            "tokens": sum(len(s.tokens) for s in sequences)}


def save_checkpoint(path: Path, step: int, students: list[Student], config: TrainConfig,
                    drafter_config: DrafterConfig, data: dict[str, int], followups: FollowUps | None = None) -> None:
    """Written to a temporary file first, so a run killed while saving keeps its last checkpoint.
    `data`: data_signature of the training sequences."""
    state = {"step": step, "train_config": dataclasses.asdict(config), "drafter_config": drafter_config.to_dict(),
             "data": data, "students": {s.name: s.state_dict() for s in students},
             "followups": None if followups is None else followups.table}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, students: list[Student], config: TrainConfig,
                    drafter_config: DrafterConfig, data: dict[str, int], followups: FollowUps | None = None) -> int:
    """Restores the students (and the follow-ups) from `path` and returns the step to continue from;
    ValueError if it was trained with another recipe or drafter, or on other data."""
    state = torch.load(path, map_location=students[0].drafter.fc.weight.device, weights_only=True)
    recipe = dataclasses.asdict(config)
    state["train_config"]["steps"] = recipe["steps"]  # may change: the schedule follows the new total
    state["train_config"].setdefault("followup_anchors", 0.0)  # saved before the option: uniform anchors
    for key, ours in (("train_config", recipe), ("drafter_config", drafter_config.to_dict())):
        if state[key] != ours:
            changed = sorted(k for k in ours if state[key].get(k) != ours[k])
            raise ValueError(f"{path} was trained with another {key} (differs in {changed}); "
                             "resume with the same settings or use another --out")
    if state.get("data", data) != data:  # checkpoints before the signature: not checked
        raise ValueError(f"{path} was trained on other data ({state['data']}; now {data}): resume with the "
                         "same generation options, or use another --out")
    if state["step"] >= config.steps:
        raise ValueError(f"{path} is at step {state['step']}: --steps {config.steps} leaves nothing to train")
    for student in students:
        student.load_state_dict(state["students"][student.name])
    if followups is not None:
        if state["followups"].shape != followups.table.shape:
            raise ValueError(f"{path} holds follow-ups of {tuple(state['followups'].shape)} (sequences, anchors), "
                             f"not {tuple(followups.table.shape)}: resume on the same data")
        followups.table = state["followups"].cpu()
    return state["step"]


def export(students: list[Student], out: Path) -> None:
    """Writes each drafter in DeepSpec's format with bf16 tensors (the target's modules are not saved)."""
    for student in students:
        save_drafter(copy.deepcopy(student.drafter).to(torch.bfloat16), out / student.name)
