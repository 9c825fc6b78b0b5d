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


def check_resumable(path: Path, config: TrainConfig, drafter_config: DrafterConfig | None = None,
                    state: dict | None = None) -> dict:
    """The checkpoint's state (read from `path` onto the CPU unless given); ValueError if it was
    trained with another recipe (naming the flags that differ) or drafter, or is at --steps already.
    The command line calls it before generating data and compiling; load_checkpoint again, with
    the drafter's config."""
    state = torch.load(path, map_location="cpu", weights_only=True) if state is None else state
    recipe = dataclasses.asdict(config)
    saved = {**state["train_config"], "steps": recipe["steps"]}  # may change: the schedule follows the new total
    saved.setdefault("followup_anchors", 0.0)  # saved before the option: uniform anchors
    changed = [f"--{k.replace('_', '-')} ({saved.get(k)!r}, now {recipe[k]!r})"  # the fields are the flags
               for k in recipe if saved.get(k) != recipe[k]]
    if changed:
        raise ValueError(f"{path} was trained with other {', '.join(changed)}: resume with the same options "
                         "or use another --out")
    ours = {} if drafter_config is None else drafter_config.to_dict()
    changed = sorted(k for k in ours if state["drafter_config"].get(k) != ours[k])
    if changed:
        raise ValueError(f"{path} was trained with another drafter (differs in {changed}); resume with the "
                         "same options or use another --out")
    if state["step"] >= config.steps:
        raise ValueError(f"{path} is at step {state['step']}: --steps {config.steps} leaves nothing to train")
    return state


def load_checkpoint(path: Path, students: list[Student], config: TrainConfig,
                    drafter_config: DrafterConfig, data: dict[str, int], followups: FollowUps | None = None) -> int:
    """Restores the students (and the follow-ups) from `path` and returns the step to continue from;
    ValueError if it was trained with another recipe or drafter (check_resumable), or on other data."""
    state = torch.load(path, map_location=students[0].drafter.fc.weight.device, weights_only=True)
    check_resumable(path, config, drafter_config, state)
    if state.get("data", data) != data:  # checkpoints before the signature: not checked
        raise ValueError(f"{path} was trained on other data ({state['data']}; now {data}): resume with the "
                         "same generation options, or use another --out")
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
