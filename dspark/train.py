"""Trains a DSpark drafter for the default target (SmolLM2-135M-Instruct) with DeepSpec's recipe.

    python -m dspark.train --out runs/smollm2 --device cuda --no-rank0-twin --steps 8000 \
        --argmax-weight 0.3 --time-budget-s 880              # the shipped drafter's run
    python -m dspark.train --out runs/smollm2 --device cuda --time-budget-s 540 --resume
    python -m dspark.train --out runs/smollm2 --device cuda --no-rank0-twin --steps 14000 --fit-steps \
        --argmax-weight 0.3 --time-budget-s 1190             # data and schedule within 20 minutes
    python -m dspark.train --out /tmp/smoke --smoke          # a few CPU steps on tiny data

The shipped drafter's run drew its random batches from one stream of epochs; BatchOrder's default
draws random batches epoch by epoch (the same recipe, not the same batches).

The target is frozen; the drafter shares its embedding and LM head (frozen too). Each step:
- the target runs a plain causal forward over a batch of self-distilled sequences (dspark.data;
  BatchOrder) and returns its logits and the outputs of `target_layer_ids` (the drafter's context
  features);
- up to `num_anchors` random response positions per sequence become blocks [x_p, mask x (K-1)],
  all drafted in one forward under DeepSpec's block mask; slot k is labelled x_{p+k+1};
- the Markov head adds its bias with teacher forcing (the true previous token);
- loss = 0.1 CE + 0.9 TV + 1.0 BCE(confidence, 1 - TV), each position weighted by exp(-k/4).
  TV is the total-variation distance 1/2 |p_draft - p_target|_1 at T=1 (DeepSpec's 0.9 weighs the
  L1 distance, 2 TV), and 1 - TV is the chance that token-level verification accepts the slot's
  draft given that the slots before it were accepted. --argmax-weight w adds w CE against the
  target's argmax, for greedy (T = 0) decoding, where a draft is accepted when its argmax is the
  target's.

Progress shows the loss, the expected acceptance 1 - TV per position and the expected acceptance
length AL = 1 + sum_k prod_{i<=k} (1 - TV_i) under teacher forcing, and the same at T = 0 from the
argmax agreements ("greedy AL"); `log.jsonl` keeps them.
Every --heldout-every steps the same estimates on the held-out prompts (`assets/prompts/heldout.jsonl`,
answered by the target like the training prompts, never trained on) show how well the drafter
generalizes beyond the sequences it has seen.

Resumable: `OUT/checkpoint.pt` (every --save-every steps and when --time-budget-s runs out) holds
the trainable weights, the optimizer and scheduler states and the step. The batch order and the
anchors are functions of (seed, step), so a resumed run continues exactly as an uninterrupted one.
Only --steps may change on resume (to fit the schedule to the time left): the cosine decay then
follows the new total from the current step on.
On every exit the current weights are also written in DeepSpec's format, in bfloat16, to
OUT/drafter (and OUT/drafter-rank0 for the rank-0 twin, trained on the same batches without a
Markov head, to measure what the head adds).

Default drafter (35.8 MB in bf16): 3 layers of the target's shapes (d 576, 9 heads, 3 KV heads,
SwiGLU 1536), block size 7, target layers [1, 14, 27] of 30, Markov rank 64 (2 x 49152 x 64 = 6.3M
of its 17.9M parameters), a confidence head over [h ; W1[prev]], mask token <empty_output> (16).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import math
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from dspark.checkpoint import save_drafter
from dspark.config import DrafterConfig, TargetConfig
from dspark.data import Sequence, heldout_prompts, render, self_distill, training_prompts
from dspark.drafter import DSparkDrafter
from dspark.loading import load_default_target
from dspark.target import TargetModel

CHECKPOINT = "checkpoint.pt"
LENGTH_MULTIPLE = 64  # batches are padded to a multiple of this many tokens
MASK_TOKEN = "<empty_output>"  # a SmolLM2 special token that chat never uses


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
    decay_gamma: float = 4.0  # position k weighs exp(-k / decay_gamma)
    seed: int = 0
    rank0_twin: bool = True


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's choice of target layers: the middle one for a 1-layer drafter, else one per drafter
    layer spread evenly over [1, n-3] (never the last layer, whose output is post-norm in HF)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def default_drafter_config(target: TargetConfig, mask_token_id: int, num_layers: int = 3, block_size: int = 7,
                           markov_rank: int = 64) -> DrafterConfig:
    return DrafterConfig.for_target(
        target, num_hidden_layers=num_layers, block_size=block_size, markov_rank=markov_rank,
        target_layer_ids=build_target_layer_ids(target.num_hidden_layers, num_layers),
        mask_token_id=mask_token_id, enable_confidence_head=True)


# ---------------------------------------------------------------------------- batches


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] right-padded sequences
    anchors: torch.Tensor  # [B, N] block anchor positions (0 for padding blocks)
    valid: torch.Tensor  # [B, N, K] bool: slot k of block n has a label in the response

    def to(self, device: torch.device) -> Batch:
        return Batch(self.tokens.to(device), self.anchors.to(device), self.valid.to(device))


class BatchOrder:
    """Which sequences each step trains on. Every epoch is a seeded permutation of the sequences,
    cut into runs of `config.bucket_batches` batches; each run is sorted by length and cut into
    batches, and the epoch's batches are shuffled. So every sequence is seen once an epoch (but for
    the last len % batch_size of the permutation). With bucket_batches = 1 (the default) a batch
    holds random sequences, padded to its longest: 2.2 times its real tokens on the self-distilled
    data's lengths (short chat prompts beside stdlib code of up to 512 tokens); with 16, 1.26 times,
    and the target's forward shrinks with it. But buckets of similar lengths are batches of similar
    prompts (the long ones are code), and the sixth training run (docs/performance.md), the one with
    buckets, reached lower estimates at a given step than earlier runs' random batches, by more than
    its 1.15x steps a second could make up (not an A/B: its schedule differed). A function of
    (lengths, config, step), so a resumed run sees the same batches."""

    def __init__(self, lengths: list[int], config: TrainConfig):
        if len(lengths) < config.batch_size:
            raise ValueError(f"{len(lengths)} sequences cannot fill a batch of {config.batch_size}")
        if config.bucket_batches < 1:
            raise ValueError(f"bucket_batches must be >= 1, got {config.bucket_batches}")
        self.lengths, self.batch_size, self.seed = lengths, config.batch_size, config.seed
        self.bucket_batches = config.bucket_batches
        self.batches_per_epoch = len(lengths) // config.batch_size
        self.cached: tuple[int, list[list[int]]] | None = None  # (epoch, its batches)

    def epoch(self, epoch: int) -> list[list[int]]:
        """The batches of `epoch`, in their order (sequence indices)."""
        if self.cached is None or self.cached[0] != epoch:
            self.cached = epoch, self._batches(epoch)
        return self.cached[1]

    def _batches(self, epoch: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        order = order[:self.batches_per_epoch * self.batch_size]
        run = self.bucket_batches * self.batch_size
        order = [i for begin in range(0, len(order), run)
                 for i in sorted(order[begin:begin + run], key=self.lengths.__getitem__)]
        batches = [order[b * self.batch_size:(b + 1) * self.batch_size] for b in range(self.batches_per_epoch)]
        return [batches[b] for b in torch.randperm(len(batches), generator=generator).tolist()]

    def __call__(self, step: int) -> list[int]:
        return self.epoch(step // self.batches_per_epoch)[step % self.batches_per_epoch]


def make_batch(chosen: list[Sequence], step: int, config: TrainConfig, block_size: int) -> Batch:
    """Step `step`'s sequences (see BatchOrder), padded to a multiple of LENGTH_MULTIPLE, with up to
    `num_anchors` random anchors each among the response positions that have a next token (always
    `num_anchors` blocks, the missing ones padding). So a batch's shape varies only in its length,
    and only in whole multiples: a compiled step (COMPILE_MODES) then compiles once, where other
    lengths' alignments would each compile again. The anchors are a function of (seed, step)."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    # anchors p with a label at p + 1, sorted
    picked = [(torch.randperm(len(s.tokens) - 1 - s.prompt_len, generator=generator)[:config.num_anchors]
               + s.prompt_len).sort().values for s in chosen]
    longest = max(len(s.tokens) for s in chosen)
    length, num_blocks = -(-longest // LENGTH_MULTIPLE) * LENGTH_MULTIPLE, config.num_anchors
    tokens = torch.zeros(len(chosen), length, dtype=torch.long)
    anchors = torch.zeros(len(chosen), num_blocks, dtype=torch.long)
    valid = torch.zeros(len(chosen), num_blocks, block_size, dtype=torch.bool)
    for row, (seq, p) in enumerate(zip(chosen, picked)):
        tokens[row, :len(seq.tokens)] = torch.tensor(seq.tokens)
        anchors[row, :len(p)] = p
        valid[row, :len(p)] = p[:, None] + torch.arange(1, block_size + 1) < len(seq.tokens)
    return Batch(tokens, anchors, valid)


# ---------------------------------------------------------------------------- loss


@dataclass
class Stats:
    """Sums over steps, per position over the valid slots: for the progress display and the log."""
    loss: float = 0.0
    accept: torch.Tensor | float = 0.0  # [K] sum of 1 - TV (T = 1 acceptance)
    survive: torch.Tensor | float = 0.0  # [K] sum of prod_{i<=k} (1 - TV_i)
    agree: torch.Tensor | float = 0.0  # [K] slots whose argmax is the target's (T = 0 acceptance)
    agree_survive: torch.Tensor | float = 0.0  # [K] slots agreeing at every position up to k
    count: torch.Tensor | float = 0.0  # [K] valid slots
    steps: int = 0

    def __add__(self, other: Stats) -> Stats:
        return Stats(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def summary(self) -> dict:
        count = self.count.clamp_min(1)
        return {"loss": self.loss / self.steps, "acceptance": (self.accept / count).tolist(),
                "al_estimate": 1 + (self.survive / count).sum().item(),
                "greedy_agreement": (self.agree / count).tolist(),
                "al_greedy_estimate": 1 + (self.agree_survive / count).sum().item()}


def block_views(batch: Batch, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot of every block: the label x_{p+k+1}, the token before it x_{p+k} (teacher forcing)
    and the position p+k, where the target's logits give the slot's distribution -> each [B, N, K]."""
    length = batch.tokens.shape[1]
    at = (batch.anchors[..., None] + torch.arange(block_size, device=batch.anchors.device)).clamp_max(length - 1)
    flat = at.flatten(1)  # [B, N*K]
    prev = batch.tokens.gather(1, flat).view_as(at)
    labels = batch.tokens.gather(1, (flat + 1).clamp_max(length - 1)).view_as(at)
    return labels, prev, at


def slot_losses(logits: torch.Tensor, bias: torch.Tensor | None, confidence: torch.Tensor | None,
                labels: torch.Tensor, target_logits: torch.Tensor, ce_weight: float, tv_weight: float,
                confidence_weight: float, argmax_weight: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSpec's loss of every slot, unweighted: ce_weight CE + tv_weight TV + confidence_weight
    BCE(confidence, 1 - TV), plus argmax_weight CE against the target's argmax; the acceptance
    estimate 1 - TV (T = 1) and the argmax agreement (T = 0). One function of tensors, so that
    torch.compile fuses its passes over the vocabulary (train_step compiles it on the GPU).

    logits, bias: [B, N, K, V] (the drafter's base logits and the Markov bias, or None);
    confidence: [B, N, K] logits or None; labels: [B, N, K]; target_logits: [B, N, K, V] (the target's
    logits at each slot's position)
    -> terms, accept, agree [B, N, K] float32
    """
    logits = logits.float() if bias is None else logits.float() + bias.float()
    log_q = logits.log_softmax(-1)
    target_probs = target_logits.float().softmax(-1)  # T = 1
    ce = -log_q.gather(-1, labels[..., None]).squeeze(-1)
    tv = 0.5 * (log_q.exp() - target_probs).abs().sum(-1)
    accept = (1 - tv.detach()).clamp_min(0.0)  # TV can exceed 1 by a rounding error
    target_argmax = target_probs.argmax(-1, keepdim=True)
    agree = (logits.detach().argmax(-1, keepdim=True) == target_argmax).squeeze(-1).float()
    terms = ce_weight * ce + tv_weight * tv
    if argmax_weight:
        terms = terms + argmax_weight * -log_q.gather(-1, target_argmax).squeeze(-1)
    if confidence is not None:
        terms = terms + confidence_weight * F.binary_cross_entropy_with_logits(
            confidence.float(), accept, reduction="none")
    return terms, accept, agree


def dspark_loss(drafter: DSparkDrafter, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                valid: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor, target_logits: torch.Tensor,
                config: TrainConfig, losses: Callable = slot_losses
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSpec's loss for one drafter: CE + TV + confidence BCE over the valid slots, position k
    weighted by exp(-k / decay_gamma). `losses` is slot_losses or a compiled copy of it. A function of
    tensors without host syncs, so the whole of it compiles too (see COMPILE_MODES).

    features: [B, S, m * hidden]; tokens: [B, S]; anchors: [B, N]; valid, labels, prev: [B, N, K];
    target_logits: [B, N, K, V] at the slots -> loss (scalar), acceptance estimate 1 - TV and argmax
    agreement [B, N, K]
    """
    base, hidden = drafter.forward_train(features, tokens, anchors)  # [B, N, K, V], [B, N, K, d]
    head = drafter.markov_head
    bias = None if head is None else head(prev.flatten(0, 1), hidden.flatten(0, 1)).view_as(base)
    confidence = None
    if drafter.confidence_head is not None:
        prev_embedding = head.markov_w1(prev) if head is not None and drafter.confidence_head.markov_rank else None
        confidence = drafter.confidence(hidden, prev_embedding)
    terms, accept, agree = losses(base, bias, confidence, labels, target_logits, config.ce_weight,
                                  config.tv_weight, config.confidence_weight, config.argmax_weight)
    decay = torch.exp(-torch.arange(drafter.block_size, device=valid.device) / config.decay_gamma)
    weights = decay * valid
    return (weights * terms).sum() / weights.sum().clamp_min(1e-6), accept, agree


def step_stats(loss: torch.Tensor, accept: torch.Tensor, agree: torch.Tensor, valid: torch.Tensor) -> Stats:
    """One step's Stats from its loss, acceptance estimates and argmax agreements [B, N, K] over the
    valid slots [B, N, K]."""
    per_slot = [accept, accept.cumprod(-1), agree, agree.cumprod(-1), valid.float()]
    sums = torch.stack([t * valid for t in per_slot]).sum((1, 2))  # [5, K]
    host = torch.cat([loss.detach().float()[None], sums.flatten()]).cpu()  # one device-to-host copy
    return Stats(host[0].item(), *host[1:].view_as(sums), steps=1)


def target_slots(target: TargetModel, tokens: torch.Tensor, at: torch.Tensor,
                 config: DrafterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's plain causal forward over the batch: its logits at the slots' positions and the
    drafter's context features (the outputs of `config.target_layer_ids`; read from the config, not
    passed as ints, so that a compiled copy keeps them constants rather than symbolic).
    tokens: [B, S]; at: [B, N, K] -> [B, N, K, V] float32, [B, S, m * hidden]"""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits, features = target(tokens, positions, hidden_layer_ids=config.target_layer_ids,
                              logits_at=at.flatten(1))
    return logits.view(*at.shape, -1), features


# ---------------------------------------------------------------------------- training


@dataclass
class Student:
    """One drafter being trained, with its optimizer and schedule."""
    name: str  # also its export folder
    drafter: DSparkDrafter
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR

    def state_dict(self) -> dict:
        trainable = {n for n, p in self.drafter.named_parameters() if p.requires_grad}
        return {"weights": {n: t for n, t in self.drafter.state_dict().items() if n in trainable},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.drafter.load_state_dict(state["weights"], strict=False)
        trainable = {n for n, p in self.drafter.named_parameters() if p.requires_grad}
        if unexpected or trainable & set(missing):  # frozen (shared, maybe tied) weights are not saved
            raise ValueError(f"checkpoint does not fit drafter {self.name!r}: missing "
                             f"{sorted(trainable & set(missing))}, unexpected {sorted(unexpected)}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def warmup_cosine(steps: int, warmup: float):
    warmup_steps = max(1, round(warmup * steps))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, steps - warmup_steps)))

    return factor


def make_student(name: str, target: TargetModel, config: DrafterConfig, train: TrainConfig) -> Student:
    drafter = DSparkDrafter(config, embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    drafter.to(target.embed_tokens.weight.device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=0.0)
    return Student(name, drafter, optimizer, LambdaLR(optimizer, warmup_cosine(train.steps, train.warmup)))


def make_students(target: TargetModel, config: DrafterConfig, train: TrainConfig) -> list[Student]:
    """The drafter, and its rank-0 twin when the recipe asks for one."""
    students = [make_student("drafter", target, config, train)]
    if train.rank0_twin:
        students.append(make_student("drafter-rank0", target, dataclasses.replace(config, markov_rank=0), train))
    return students


def autocast(device: torch.device):
    """bf16 autocast on GPU (fp32 master weights); CPU runs in fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# What torch.compile covers in a training step: nothing, the per-slot loss over the vocabulary, or
# the whole step's forward (the default on the GPU): the target's and each drafter's, loss included.
COMPILE_MODES = ("none", "loss", "all")


@functools.cache
def compiled(fn: Callable, dynamic: bool | None = True) -> Callable:
    """fn compiled once per process: with dynamic shapes from the start (batch, sequence length,
    block count), or with dynamic=None static until a shape changes, then recompiled dynamic."""
    return torch.compile(fn, dynamic=dynamic)


def compile_mode(target: TargetModel, compile: str | None) -> str:
    """`compile`, checked, or the default on the target's device: "all" on the GPU, "none" on the CPU."""
    compile = compile or ("all" if target.embed_tokens.weight.device.type == "cuda" else "none")
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    return compile


def student_losses(target: TargetModel, students: list[Student], batch: Batch, config: TrainConfig,
                   compile: str | None = None) -> Iterator[tuple[Student, torch.Tensor, Stats]]:
    """(student, loss, stats) for every student on `batch`, one student at a time, so that a caller
    can backpropagate one loss before the next student's forward. The target runs once.
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
            loss, accept, agree = drafter_loss(student.drafter, features, batch.tokens, batch.anchors,
                                               batch.valid, labels, prev, target_logits, config, losses)
        yield student, loss, step_stats(loss, accept, agree, batch.valid)


def train_step(target: TargetModel, students: list[Student], batch: Batch, config: TrainConfig,
               compile: str | None = None) -> list[Stats]:
    """One optimizer step of every student on `batch` (`compile`: see student_losses)."""
    collected = []
    for student, loss, stats in student_losses(target, students, batch, config, compile):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.optimizer.param_groups[0]["params"], config.grad_clip)
        student.optimizer.step()
        student.optimizer.zero_grad(set_to_none=True)
        student.scheduler.step()
        collected.append(stats)
    return collected


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
        for _, loss, _ in student_losses(target, students, batch, config, compile):
            loss.backward()


def heldout_batches(sequences: list[Sequence], config: TrainConfig, block_size: int) -> list[Batch]:
    """Fixed batches (sequences and anchors) of held-out sequences, to follow generalization."""
    config = dataclasses.replace(config, batch_size=min(config.batch_size, len(sequences)))
    order = BatchOrder([len(s.tokens) for s in sequences], config)
    return [make_batch([sequences[i] for i in order(step)], step, config, block_size)
            for step in range(order.batches_per_epoch)]


@torch.no_grad()
def evaluate_students(target: TargetModel, students: list[Student], batches: list[Batch],
                      config: TrainConfig) -> list[Stats]:
    """Every student's teacher-forced loss and acceptance estimates on `batches`, without updating.
    Eager: the training step's compiled functions would compile again for a forward without autograd,
    to run on a few batches."""
    device = target.embed_tokens.weight.device
    totals = [Stats() for _ in students]
    for batch in batches:
        stats = [s for _, _, s in student_losses(target, students, batch.to(device), config, "none")]
        totals = [t + s for t, s in zip(totals, stats)]
    return totals


def save_checkpoint(path: Path, step: int, students: list[Student], config: TrainConfig,
                    drafter_config: DrafterConfig) -> None:
    """Written to a temporary file first, so a run killed while saving keeps its last checkpoint."""
    state = {"step": step, "train_config": dataclasses.asdict(config), "drafter_config": drafter_config.to_dict(),
             "students": {s.name: s.state_dict() for s in students}}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, students: list[Student], config: TrainConfig,
                    drafter_config: DrafterConfig) -> int:
    """Restores the students from `path` and returns the step to continue from."""
    state = torch.load(path, map_location=students[0].drafter.fc.weight.device, weights_only=True)
    recipe = dataclasses.asdict(config)
    state["train_config"]["steps"] = recipe["steps"]  # may change: the schedule follows the new total
    for key, ours in (("train_config", recipe), ("drafter_config", drafter_config.to_dict())):
        if state[key] != ours:
            changed = sorted(k for k in ours if state[key].get(k) != ours[k])
            raise ValueError(f"{path} was trained with another {key} (differs in {changed}); "
                             "resume with the same settings or use another --out")
    for student in students:
        student.load_state_dict(state["students"][student.name])
    return state["step"]


def export(students: list[Student], out: Path) -> None:
    """Writes each drafter in DeepSpec's format with bf16 tensors (the target's modules are not saved)."""
    for student in students:
        save_drafter(copy.deepcopy(student.drafter).to(torch.bfloat16), out / student.name)


def progress_line(summaries: dict[str, dict]) -> str:
    parts = []
    for name, s in summaries.items():
        accept = " ".join(f"{a:.2f}" for a in s["acceptance"])
        parts.append(f"{name}: loss {s['loss']:.3f} accept [{accept}] AL~{s['al_estimate']:.2f} "
                     f"greedy AL~{s['al_greedy_estimate']:.2f}")
    return " | ".join(parts)


class TimeBudget:
    """A `stop` callback: says stop once the next step (or generation batch) would end after
    `deadline` (time.monotonic(); None: never), judging a step's length by the time between the
    last two calls. The first step is not a guide (it compiles), so it never stops the second.
    `steps_left()` says how many steps of the median length over the last `window` steps still fit:
    the median, because a step that compiles again (a new batch length can, early in a run) takes
    tens of seconds; a fit by the mean scheduled 2,483 steps where about 8,800 fitted."""

    def __init__(self, deadline: float | None, window: int = 200):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.deadline = deadline
        self.times: collections.deque[float] = collections.deque(maxlen=window + 1)  # the last calls

    def __call__(self, step: int) -> bool:
        now = time.monotonic()
        step_seconds = 0.0 if len(self.times) < 2 else now - self.times[-1]
        self.times.append(now)
        return self.deadline is not None and now + step_seconds > self.deadline

    def steps_left(self) -> int:
        if self.deadline is None or len(self.times) < 2:
            raise RuntimeError("steps_left needs a deadline and two calls")
        step_seconds = statistics.median(b - a for a, b in itertools.pairwise(self.times))
        return max(0, int((self.deadline - self.times[-1]) / step_seconds))


# Fitting the schedule to a time budget (train's fit_schedule): after this many steps of a call
# (the first few compile; TimeBudget takes the median of the last 200), with this share of the time left.
FIT_AFTER_STEPS = 220
FIT_MARGIN = 0.97  # for the held-out checks and the last save, which the step times leave out


def fit_schedule_to(budget: TimeBudget, step: int, students: list[Student], config: TrainConfig) -> TrainConfig:
    """The recipe with `steps` set so that the schedule ends when the budget does; the students'
    learning-rate schedules follow the new total from `step` on (as on a resume with other --steps)."""
    steps = step + int(FIT_MARGIN * budget.steps_left())
    for student in students:
        student.scheduler.lr_lambdas[0] = warmup_cosine(steps, config.warmup)
    return dataclasses.replace(config, steps=steps)


def train(target: TargetModel, drafter_config: DrafterConfig, sequences: list[Sequence], out: Path,
          config: TrainConfig, resume: bool = False, stop: Callable[[int], bool] | None = None,
          save_every: int = 500, log_every: int = 10, heldout: list[Sequence] | None = None,
          heldout_every: int = 500, compile: str | None = None, fit_schedule: bool = False) -> list[Student]:
    """Trains the drafter (and its rank-0 twin) on `sequences` up to `config.steps`, or until
    `stop(step)`, asked before each step, says to stop. Checkpoints to out/checkpoint.pt every
    `save_every` steps and at the end, logs means over `log_every` steps to out/log.jsonl, and the
    estimates on the `heldout` sequences every `heldout_every` steps and at the last step; exports
    to out/<name>; returns the students. `compile`: see student_losses. `fit_schedule`: `stop` is a
    TimeBudget, and FIT_AFTER_STEPS steps into this call the total becomes the steps that fit in it
    (fit_schedule_to), so the learning rate's decay ends with the budget."""
    if fit_schedule and not (isinstance(stop, TimeBudget) and stop.deadline is not None):
        raise ValueError("fit_schedule needs a TimeBudget with a deadline as `stop`")
    out.mkdir(parents=True, exist_ok=True)
    target.requires_grad_(False)
    target.drop_caches()  # the self-distillation decoder left its KV caches
    students = make_students(target, drafter_config, config)
    checkpoint = out / CHECKPOINT
    if checkpoint.exists() and not resume:
        raise FileExistsError(f"{checkpoint} exists: pass --resume to continue it, or use another --out")
    step = load_checkpoint(checkpoint, students, config, drafter_config) if resume and checkpoint.exists() else 0
    fit_at = step + FIT_AFTER_STEPS if fit_schedule else None

    device = target.embed_tokens.weight.device
    checks = heldout_batches(heldout, config, drafter_config.block_size) if heldout else []
    order = BatchOrder([len(s.tokens) for s in sequences], config)
    window = [Stats() for _ in students]
    bar = tqdm(total=config.steps, initial=step, desc="train", dynamic_ncols=True, mininterval=2.0)
    with (out / "log.jsonl").open("a") as log:
        while step < config.steps:
            if stop is not None and stop(step):
                bar.write(f"stopped at step {step}: continue with --resume")
                break
            chosen = [sequences[i] for i in order(step)]
            batch = make_batch(chosen, step, config, drafter_config.block_size).to(device)
            window = [w + s for w, s in zip(window, train_step(target, students, batch, config, compile))]
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
                log.write(json.dumps({"step": step, "lr": students[0].scheduler.get_last_lr()[0],
                                      **summaries}) + "\n")
                log.flush()
                window = [Stats() for _ in students]
            if checks and (step % heldout_every == 0 or step == config.steps):
                summaries = {s.name: h.summary() for s, h in zip(students, evaluate_students(
                    target, students, checks, config))}
                bar.write(f"held-out, step {step}: {progress_line(summaries)}")
                log.write(json.dumps({"step": step, "heldout": summaries}) + "\n")
                log.flush()
            if step % save_every == 0:
                save_checkpoint(checkpoint, step, students, config, drafter_config)
    bar.close()
    if step % save_every:  # not saved at this step yet
        save_checkpoint(checkpoint, step, students, config, drafter_config)
    export(students, out)
    return students


# ---------------------------------------------------------------------------- command line


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="run folder: data cache, checkpoint, log, drafters")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop (checkpointed) before this many seconds have passed since start; leave a "
                        "minute of the calling limit for loading and the final save")
    p.add_argument("--fit-steps", action="store_true",
                   help=f"fit the schedule to --time-budget-s: {FIT_AFTER_STEPS} steps in, the total becomes the "
                        "steps that fit before the deadline (--steps is the total until then); log.jsonl "
                        "records it, and a resume without --fit-steps must pass it as --steps")
    p.add_argument("--smoke", action="store_true", help="a few steps on tiny data, to check the pipeline")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, help=f"default {f.default}")
    p.add_argument("--save-every", type=int, default=500, help="checkpoint interval in steps")
    p.add_argument("--log-every", type=int, default=10, help="log interval in steps")
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=None, help="training prompts to answer (default: all)")
    p.add_argument("--responses-per-prompt", type=int, default=6,
                   help="target responses per prompt: the first greedy, the others at temperature 1")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    p.add_argument("--max-tokens", type=int, default=192, help="response length limit")
    p.add_argument("--gen-batch-size", type=int, default=2048, help="prompts per generation batch")
    p.add_argument("--heldout-prompts", type=int, default=None,
                   help="held-out prompts (answered twice, never trained on) whose teacher-forced estimates "
                        "are logged (default: all; 0: none)")
    p.add_argument("--heldout-every", type=int, default=500, help="held-out estimate interval in steps")
    p.add_argument("--compile", choices=COMPILE_MODES, default=None,
                   help="what torch.compile covers in a step (default: all of it on the GPU, nothing on the CPU)")
    args = p.parse_args(argv)
    if args.fit_steps and args.time_budget_s is None:
        p.error("--fit-steps needs --time-budget-s")
    if args.smoke:
        args.device = "cpu"
        args.steps, args.batch_size, args.num_anchors, args.save_every, args.log_every = 4, 2, 8, 2, 1
        args.num_prompts, args.max_tokens, args.gen_batch_size = 4, 12, 4
        args.heldout_prompts, args.heldout_every = 2, 2
    return args


def load_target(args: argparse.Namespace) -> tuple[TargetModel, object]:
    """The default target (bf16 on CUDA, fp32 on the CPU) and its tokenizer."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, tokenizer = load_default_target(dtype=dtype, device=device)
    return target.eval(), tokenizer


def generate_data(args: argparse.Namespace, deadline: float | None,
                  models: tuple[TargetModel, object] | None = None) -> tuple[list[Sequence], list[Sequence]] | None:
    """The training and held-out sequences: the target's responses to their prompts, generated into
    (or read from) the caches in args.out; None when the deadline comes first. `models`: the target
    and tokenizer (default: loaded)."""
    target, tokenizer = models or load_target(args)
    prompts = [p for p in render(tokenizer, training_prompts(args.num_prompts, seed=args.seed))
               if len(p) <= args.max_prompt_tokens]
    total = len(prompts) * args.responses_per_prompt
    with tqdm(total=total, desc="self-distill", dynamic_ncols=True, mininterval=2.0) as bar:
        sequences, done = self_distill(target, prompts, args.out / "sequences.jsonl", max_tokens=args.max_tokens,
                                       seed=args.seed, stop_token_ids=tokenizer.eos_token_ids,
                                       responses_per_prompt=args.responses_per_prompt,
                                       batch_size=args.gen_batch_size, stop=TimeBudget(deadline),
                                       progress=bar.update)
    if not done:
        print(f"time budget reached after {len(sequences)} of {total} responses; "
              "run again (with --resume) to continue")
        return None
    heldout = [p for p in render(tokenizer, heldout_prompts()[:args.heldout_prompts])
               if len(p) <= args.max_prompt_tokens]
    if heldout:
        heldout, _ = self_distill(target, heldout, args.out / "heldout.jsonl", max_tokens=args.max_tokens,
                                  seed=args.seed, stop_token_ids=tokenizer.eos_token_ids, responses_per_prompt=2,
                                  batch_size=args.gen_batch_size)
    return sequences, heldout


def main(argv=None) -> None:
    started = time.monotonic()
    args = parse_args(argv)
    deadline = None if args.time_budget_s is None else started + args.time_budget_s
    # The data is generated in a process of its own while this one compiles the training step.
    generation = multiprocessing.get_context("spawn").Process(target=generate_data, args=(args, deadline),
                                                              name="self-distill")
    generation.start()
    target, tokenizer = load_target(args)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    mask_token_id = tokenizer.token_to_id(MASK_TOKEN)
    if mask_token_id is None:
        raise ValueError(f"the target's tokenizer has no {MASK_TOKEN!r} token to use as the mask token")
    drafter_config = default_drafter_config(target.config, mask_token_id, args.num_layers, args.block_size,
                                            args.markov_rank)
    compile_ahead(target, drafter_config, config, args.max_prompt_tokens + args.max_tokens, args.compile)
    print(f"training step compiled at {time.monotonic() - started:.0f} s")
    generation.join()
    if generation.exitcode != 0:
        raise SystemExit(f"the data generation process failed (exit code {generation.exitcode})")
    data = generate_data(args, deadline, (target, tokenizer))  # as cached by the generation process
    if data is None:
        return
    sequences, heldout = data
    responses = sum(len(s.tokens) - s.prompt_len for s in sequences)
    print(f"{len(sequences)} sequences, {responses} response tokens, and {len(heldout)} held-out sequences "
          f"at {time.monotonic() - started:.0f} s")
    train(target, drafter_config, sequences, args.out, config, resume=args.resume, stop=TimeBudget(deadline),
          save_every=args.save_every, log_every=args.log_every, heldout=heldout, heldout_every=args.heldout_every,
          compile=args.compile, fit_schedule=args.fit_steps)
    size = (args.out / "drafter" / "model.safetensors").stat().st_size
    print(f"done in {time.monotonic() - started:.0f} s; {args.out / 'drafter'} holds {size / 1e6:.1f} MB of weights")


if __name__ == "__main__":
    main()
