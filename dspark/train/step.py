"""One training step of every student on a batch (train_step), eager or compiled (COMPILE_MODES), the
compilation ahead of the data (compile_ahead) and the held-out estimates (evaluate_students)."""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch._inductor.config

from dspark.config import DrafterConfig
from dspark.data import Sequence
from dspark.target import TargetModel
from dspark.train.batches import LENGTH_MULTIPLE, Batch, make_batch
from dspark.train.loss import Stats, block_views, dspark_loss, slot_losses, step_stats, target_slots
from dspark.train.recipe import TrainConfig
from dspark.train.students import Student, make_students


def autocast(device: torch.device):
    """bf16 autocast on GPU (fp32 master weights); CPU runs in fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# What torch.compile covers in a training step: nothing, the per-slot loss over the vocabulary, or
# the whole step's forward (the default on the GPU): the target's and each drafter's, loss included.
COMPILE_MODES = ("none", "loss", "all")
# Inductor's mix-order reduction (on the GPU) guards on the batch's size, so without its non-strict
# mode (which skips those size checks) the drafter's step compiles again inside compile_ahead at
# other batch lengths (TORCH_LOGS=recompiles shows it).
INDUCTOR_OPTIONS = ({"triton.mix_order_reduction_non_strict_mode": True}
                    if hasattr(torch._inductor.config.triton, "mix_order_reduction_non_strict_mode") else None)


@functools.cache
def compiled(fn: Callable, dynamic: bool | None = True) -> Callable:
    """fn compiled once per process: with dynamic shapes from the start (batch, sequence length,
    block count), or with dynamic=None static until a shape changes, then recompiled dynamic."""
    return torch.compile(fn, dynamic=dynamic, options=INDUCTOR_OPTIONS)


def compile_mode(target: TargetModel, compile: str | None) -> str:
    """`compile`, checked, or the default on the target's device: "all" on the GPU, "none" on the CPU."""
    compile = compile or ("all" if target.embed_tokens.weight.device.type == "cuda" else "none")
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    return compile


def student_losses(target: TargetModel, students: list[Student], batch: Batch, config: TrainConfig,
                   compile: str | None = None) -> Iterator[tuple[Student, torch.Tensor, Stats, torch.Tensor]]:
    """(student, loss, stats, argmax agreement [B, N, K]) for every student on `batch`, one student
    at a time, so that a caller can backpropagate one loss before the next student's forward. The
    target runs once.
    `compile`: one of COMPILE_MODES (default: "all" on the GPU, "none" on the CPU)."""
    device = target.embed_tokens.weight.device
    compile = compile_mode(target, compile)
    whole = compile == "all"
    # dynamic=None for the target: dynamic=True would make the config's layer ids symbolic ints
    target_forward = compiled(target_slots, dynamic=None) if whole else target_slots
    drafter_loss = compiled(dspark_loss) if whole else dspark_loss
    losses = compiled(slot_losses) if compile == "loss" else slot_losses
    drafter_config = students[0].drafter.config
    if whole:  # the length varies between batches: compile for any (make_batch pads it to a multiple)
        torch._dynamo.mark_dynamic(batch.tokens, 1)
    with torch.no_grad(), autocast(device):
        labels, prev, at = block_views(batch, drafter_config.block_size)
        target_logits, features = target_forward(target, batch.tokens, at, drafter_config)
    for student in students:
        with autocast(device):
            loss, accept, agree, reached = drafter_loss(student.drafter, features, batch.tokens, batch.anchors,
                                                        batch.valid, labels, prev, target_logits, config, losses)
        yield student, loss, step_stats(loss, accept, agree, reached, batch.valid), agree


def train_step(target: TargetModel, students: list[Student], batch: Batch, config: TrainConfig,
               compile: str | None = None, keep_agreement: bool = False) -> tuple[list[Stats], torch.Tensor | None]:
    """One optimizer step of every student on `batch` (`compile`: see student_losses): their Stats,
    and with `keep_agreement` the first student's argmax agreement [B, N, K] on the CPU (else None)."""
    collected, first_agreement = [], None
    for student, loss, stats, agree in student_losses(target, students, batch, config, compile):
        if keep_agreement and first_agreement is None:  # waits for the forward (the only wait in a step)
            first_agreement = agree.cpu()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.optimizer.param_groups[0]["params"], config.grad_clip)
        student.optimizer.step()
        student.optimizer.zero_grad(set_to_none=True)
        student.scheduler.step()
        collected.append(stats)
    return collected, first_agreement


def compile_ahead(target: TargetModel, drafter_config: DrafterConfig, config: TrainConfig, longest: int,
                  compile: str | None = None) -> None:
    """Compiles the training step before its data exists (`python -m dspark.train` runs it while
    the data is generated): the forward and backward of fresh students on batches of random tokens,
    one of every padded length from 2 * LENGTH_MULTIPLE to `longest` (a sequence's most tokens),
    whose gradients are dropped. The step's compiled functions take the students as arguments and
    the batch length as dynamic, but the code Inductor picks for a length can hold only up to a
    bound on it (a guard), past which the step compiles again; after all the lengths, train's
    students and batches reuse what this compiled. Nothing to do for compile "none"."""
    if compile_mode(target, compile) == "none":
        return
    target.requires_grad_(False)
    device = target.embed_tokens.weight.device
    students = make_students(target, drafter_config, config)
    generator = torch.Generator().manual_seed(config.seed)
    for length in range(2 * LENGTH_MULTIPLE, longest + LENGTH_MULTIPLE, LENGTH_MULTIPLE):
        fake = [Sequence(torch.randint(target.config.vocab_size, (length,), generator=generator).tolist(),
                         length // 2) for _ in range(config.batch_size)]  # as much response as prompt
        batch = make_batch(fake, 0, config, drafter_config.block_size).to(device)
        for _, loss, _, _ in student_losses(target, students, batch, config, compile):
            loss.backward()


@torch.no_grad()
def evaluate_students(target: TargetModel, students: list[Student], batches: list[Batch],
                      config: TrainConfig) -> list[Stats]:
    """Every student's teacher-forced loss and acceptance estimates on `batches`, without updating.
    Eager: the training step's compiled functions would compile again for a forward without autograd,
    to run on a few batches."""
    device = target.embed_tokens.weight.device
    totals = [Stats() for _ in students]
    for batch in batches:
        stats = [s for _, _, s, _ in student_losses(target, students, batch.to(device), config, "none")]
        totals = [t + s for t, s in zip(totals, stats)]
    return totals
