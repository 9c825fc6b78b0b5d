"""The training loop (train): steps, logs, held-out checks, checkpoints and the schedule fitted to a
time budget."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from dspark.config import DrafterConfig
from dspark.data import Sequence
from dspark.target import TargetModel
from dspark.train.batches import BatchOrder, FollowUps, heldout_batches, make_batch
from dspark.train.loss import Stats
from dspark.train.recipe import TrainConfig
from dspark.train.resume import (CHECKPOINT, data_signature, export, load_checkpoint, refuse_overwrite,
                                 save_checkpoint)
from dspark.train.schedule import TimeBudget, warmup_cosine
from dspark.train.step import evaluate_students, train_step
from dspark.train.students import Student, make_students


def progress_line(summaries: dict[str, dict]) -> str:
    parts = []
    for name, s in summaries.items():
        accept = " ".join(f"{a:.2f}" for a in s["acceptance"])
        parts.append(f"{name}: loss {s['loss']:.3f} accept [{accept}] AL~{s['al_estimate']:.2f} "
                     f"greedy AL~{s['al_greedy_estimate']:.2f}")
    return " | ".join(parts)


# Fitting the schedule to a time budget (train's fit_schedule): after this many steps of a call
# (the first few compile; TimeBudget takes the median of the last 200), with this share of the time left.
FIT_AFTER_STEPS = 220
FIT_MARGIN = 0.97  # for the held-out checks and the last save, which the step times leave out


def fit_schedule_to(budget: TimeBudget, step: int, students: list[Student], config: TrainConfig) -> TrainConfig:
    """The recipe with `steps` set so that the schedule ends when the budget does; the students'
    learning-rate schedules follow the new total from `step` on (as on a resume with other --steps)."""
    steps = step + int(FIT_MARGIN * budget.steps_left())
    for student in students:
        student.follow(warmup_cosine(steps, config.warmup))
    return dataclasses.replace(config, steps=steps)


def train(target: TargetModel, drafter_config: DrafterConfig, sequences: list[Sequence], out: Path,
          config: TrainConfig, resume: bool = False, stop: Callable[[int], bool] | None = None,
          save_every: int = 500, log_every: int = 10, heldout: dict[str, list[Sequence]] | None = None,
          heldout_every: int = 500, compile: str | None = None, fit_schedule: bool = False) -> list[Student]:
    """Trains the drafter (and its rank-0 twin) on `sequences` up to `config.steps`, or until
    `stop(step)`, asked before each step, says to stop. Checkpoints to out/checkpoint.pt every
    `save_every` steps and at the end, and exports the drafters to out/<name> then too; logs means
    over `log_every` steps to out/log.jsonl, and the estimates on each named set of `heldout`
    sequences every `heldout_every` steps and at the last step; returns the students. `compile`:
    see student_losses. `fit_schedule`: `stop` is a TimeBudget, and FIT_AFTER_STEPS steps into this
    call the total becomes the steps that fit in it (fit_schedule_to), so the learning rate's decay
    ends with the budget."""
    if fit_schedule and not (isinstance(stop, TimeBudget) and stop.deadline is not None):
        raise ValueError("fit_schedule needs a TimeBudget with a deadline as `stop`")
    out.mkdir(parents=True, exist_ok=True)
    target.requires_grad_(False)
    students = make_students(target, drafter_config, config)
    followups = FollowUps(len(sequences), config.num_anchors) if config.followup_anchors else None
    checkpoint = out / CHECKPOINT
    refuse_overwrite(checkpoint, resume)
    data = data_signature(sequences)
    step = (load_checkpoint(checkpoint, students, config, drafter_config, data, followups)
            if resume and checkpoint.exists() else 0)
    first = step
    fit_at = step + FIT_AFTER_STEPS if fit_schedule else None

    device = target.embed_tokens.weight.device
    checks = {name: heldout_batches(subset, config, drafter_config.block_size)
              for name, subset in (heldout or {}).items() if subset}
    order = BatchOrder([len(s.tokens) for s in sequences], config)
    window = [Stats() for _ in students]
    bar = tqdm(total=config.steps, initial=step, desc="train", dynamic_ncols=True, mininterval=2.0)
    with (out / "log.jsonl").open("a") as log:
        while step < config.steps:
            if stop is not None and stop(step):
                bar.write(f"stopped at step {step}: continue with --resume")
                break
            indices = order(step)
            batch = make_batch([sequences[i] for i in indices], step, config, drafter_config.block_size,
                               None if followups is None else followups[indices])
            lr = students[0].optimizer.param_groups[0]["lr"]  # this step's rate; the step moves it on
            stats, agree = train_step(target, students, batch.to(device), config, compile,
                                      keep_agreement=followups is not None)
            window = [w + s for w, s in zip(window, stats)]
            if followups is not None:
                followups.update(indices, batch, agree)
            step += 1
            bar.update(1)
            if step == fit_at:
                config = fit_schedule_to(stop, step, students, config)
                bar.total = config.steps
                bar.write(f"schedule fitted to the time budget: {config.steps} steps")
                log.write(json.dumps({"step": step, "fitted_steps": config.steps}) + "\n")
            if step % log_every == 0 or step == config.steps:
                summaries = {s.name: w.summary() for s, w in zip(students, window)}
                bar.set_postfix_str(progress_line(summaries), refresh=False)
                log.write(json.dumps({"step": step, "lr": lr, **summaries}) + "\n")
                log.flush()
                window = [Stats() for _ in students]
            if checks and (step % heldout_every == 0 or step == config.steps):
                summaries = {name: {s.name: h.summary() for s, h in zip(students, evaluate_students(
                    target, students, batches, config))} for name, batches in checks.items()}
                for name, summary in summaries.items():
                    bar.write(f"held-out {name}, step {step}: {progress_line(summary)}")
                log.write(json.dumps({"step": step, "heldout": summaries}) + "\n")
                log.flush()
            if step % save_every == 0:
                save_checkpoint(checkpoint, step, students, config, drafter_config, data, followups)
                export(students, out)  # a run lost between saves keeps a drafter to evaluate
    bar.close()
    if step % save_every or step == first:  # this step not saved (and exported) by this call yet
        save_checkpoint(checkpoint, step, students, config, drafter_config, data, followups)
        export(students, out)
    return students
