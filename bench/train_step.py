"""Training speed: optimizer steps per second of `dspark.train.train_step` on the default recipe's
shapes, eager, with the per-slot loss (CE, TV, confidence BCE over the vocabulary) compiled, with
the whole step's forward compiled (the target's and each drafter's, loss included), and the last
with length-bucketed batches (`dspark.train.BatchOrder`, --bucket-batches 16) instead of batches
of random sequences; the compiled step with the host waiting for each step's statistics before it
makes the next batch (and copying it from pageable memory), and that with the loss over the
vocabulary as torch formulas that autograd differentiates and Inductor fuses instead of
dspark::distill_loss (`autograd_slot_losses`, bench/distill_loss.py); and that with a target whose
training forward attends through a dense causal mask and gives float32 logits at the slots
(`MaskedTarget`) instead of SDPA's is_causal and the model's dtype.

A target of SmolLM2-135M's shapes with random bfloat16 weights (speed does not depend on the
weights), the default drafter and its rank-0 twin (--no-rank0-twin: the drafter alone), sequences
of random tokens: by default prompts of 100 to 400 tokens and responses of 96 to 192, drawn per
sequence; with --lengths-from, the prompt and response lengths of a training run's self-distilled
data (OUT/sequences.jsonl). The variants run in one process, each warmed up (compiling there), then
timed over --steps steps with a device synchronisation at both ends; all but the bucketed one see
the same batches. The table counts the graphs each variant compiled: a count that grows with the
steps would mean a compilation per batch length.

    python -m bench.train_step                  # GPU
    python -m bench.train_step --profile 3      # and where each variant's step time goes
    python -m bench.train_step --variants "compiled step" "compiled step, length buckets" \
        --no-rank0-twin --lengths-from ~/run/sequences.jsonl   # the shipped run's recipe and data
    python -m bench.train_step --smoke          # CPU, tiny shapes: checks that it runs
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import time
from typing import Callable, NamedTuple

import torch
import triton
from torch._dynamo.utils import counters

from bench.distill_loss import autograd_slot_losses
from bench.models import SMOLLM2
from bench.timing import emit_table, print_profile
import dspark.train.step
from dspark.config import TargetConfig
from dspark.data import Sequence
from dspark.loading import measuring_dtype
from dspark.layers import DecoderLayer
from dspark.target import TargetLayer, TargetModel, attend, grouped_mask
from dspark.train import (Batch, BatchOrder, TrainConfig, default_drafter_config, make_batch, make_students,
                          slot_losses, train_step)

TINY = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8)


def masked_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention through a dense mask (which the attention expands in every layer)."""
    visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None]
    return attend(q, k, v, grouped_mask(visible, q.shape[1] // k.shape[1]))


class MaskedLayer(TargetLayer):
    def forward(self, x, cos, sin, positions, access):
        return DecoderLayer.forward(self, x, cos, sin, masked_attend)


class MaskedTarget(TargetModel):
    """The baseline target: its training forward attends through a dense causal mask and gives
    float32 logits at the slots."""

    def __init__(self, config: TargetConfig):
        super().__init__(config)
        self.layers = torch.nn.ModuleList(MaskedLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, *args, **kwargs):
        return super().forward(*args, **{**kwargs, "logits_dtype": torch.float32})


class Variant(NamedTuple):
    compile: str  # what torch.compile covers: dspark.train.COMPILE_MODES
    bucket_batches: int = 1  # TrainConfig.bucket_batches
    target: type = TargetModel
    losses: Callable | None = None  # the per-slot loss: dspark.train.slot_losses unless given
    waits: bool = False  # the host waits for every step's statistics (step_runner)


VARIANTS = {"eager": Variant("none"), "compiled loss": Variant("loss"), "compiled step": Variant("all"),
            "compiled step, length buckets": Variant("all", 16),
            "compiled step, waiting for each step": Variant("all", waits=True),
            "compiled step, waiting, autograd loss": Variant("all", losses=autograd_slot_losses, waits=True),
            "compiled step, waiting, autograd loss, masked target": Variant("all", 1, MaskedTarget,
                                                                            autograd_slot_losses, True)}


def use(variant: Variant) -> None:
    """Sets the loss the training step calls for this variant (a module global of dspark.train.step)."""
    dspark.train.step.slot_losses = variant.losses or slot_losses


def drawn_lengths(count: int, prompt_len: int, response_len: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompt_len / 4 .. prompt_len and response_len / 2 .. response_len."""
    g = torch.Generator().manual_seed(0)
    return [(int(torch.randint(prompt_len // 4, prompt_len + 1, (), generator=g)),
             int(torch.randint(response_len // 2, response_len + 1, (), generator=g))) for _ in range(count)]


def data_lengths(path: str) -> list[tuple[int, int]]:
    """(prompt, response) lengths of the sequences in a self-distillation cache (its first line is a header)."""
    with open(path) as lines:
        rows = [json.loads(line) for line in list(lines)[1:]]
    return [(row["prompt_len"], len(row["tokens"]) - row["prompt_len"]) for row in rows]


def random_sequences(lengths: list[tuple[int, int]], vocab: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(0)
    return [Sequence(torch.randint(0, vocab, (prompt + response,), generator=g).tolist(), prompt)
            for prompt, response in lengths]


def step_runner(target, sequences, recipe, compile, device, rank0_twin: bool, waits: bool):
    """run(step): one training step of a fresh drafter (and its rank-0 twin) on batch `step`, as the
    training loop takes it (the batch made on the host, then the step); `waits`: the host reads the
    step's statistics before it makes the next batch, which it copies from pageable memory."""
    students = make_students(target, default_drafter_config(target.config, 16),
                             dataclasses.replace(recipe, rank0_twin=rank0_twin))
    block_size = students[0].drafter.block_size
    order = BatchOrder([len(s.tokens) for s in sequences], recipe)

    def run(step):
        batch = make_batch([sequences[i] for i in order(step)], step, recipe, block_size)
        if waits:  # from pageable memory, as Batch.to copied it then
            batch = Batch(*(t.to(device) for t in (batch.tokens, batch.anchors, batch.valid)))
        else:
            batch = batch.to(device)
        stats, _ = train_step(target, students, batch, recipe, compile)
        if waits:
            stats[0].summary()

    return run


def steps_per_second(run, steps, warmup, device) -> float:
    for step in range(warmup):
        run(step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for step in range(warmup, warmup + steps):
        run(step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - began)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[TrainConfig.batch_size],
                        help="sequences per step (default: the recipe's)")
    parser.add_argument("--out", help="also write the table as markdown here")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then profile this many steps of each variant (at the last batch size)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rank0-twin", action=argparse.BooleanOptionalAction, default=True,
                        help="train the rank-0 twin beside the drafter, as the recipe does by default")
    parser.add_argument("--lengths-from", metavar="SEQUENCES_JSONL",
                        help="prompt and response lengths of a run's self-distilled data (OUT/sequences.jsonl)")
    args = parser.parse_args()
    recipe, batch_sizes = TrainConfig(), args.batch_sizes
    if args.smoke:
        device, config, shapes, steps, warmup = torch.device("cpu"), TINY, (24, 40), 2, 1
        recipe.num_anchors, batch_sizes = 8, [2]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device; use --smoke for a CPU check")
        device, config, shapes, steps, warmup = torch.device("cuda"), SMOLLM2, (400, 192), args.steps, 5
    torch.manual_seed(0)
    dtype = measuring_dtype(device)
    targets = {cls: cls(config).to(device, dtype).eval().requires_grad_(False) for cls in (TargetModel, MaskedTarget)}
    targets[MaskedTarget].load_state_dict(targets[TargetModel].state_dict())
    rows, runs = [], {}
    for batch_size in batch_sizes:
        recipe = dataclasses.replace(recipe, batch_size=batch_size)
        # enough sequences for every variant's warm-up and timed steps, and for a full length bucket
        count = max(batch_size * (warmup + steps), batch_size * recipe.bucket_batches)
        lengths = data_lengths(args.lengths_from) if args.lengths_from else drawn_lengths(count, *shapes)
        sequences = random_sequences(lengths, config.vocab_size)
        for name in args.variants:
            variant = VARIANTS[name]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            runs[name] = step_runner(targets[variant.target], sequences,
                                     dataclasses.replace(recipe, bucket_batches=variant.bucket_batches),
                                     variant.compile, device, args.rank0_twin, variant.waits)
            graphs = counters["stats"]["unique_graphs"]
            use(variant)
            rate = steps_per_second(runs[name], steps, warmup, device)
            graphs = counters["stats"]["unique_graphs"] - graphs
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            rows.append(f"| {batch_size} | {name} | {1000 / rate:.1f} | {rate:.2f} | {rate * batch_size:.0f} "
                        f"| {peak:.1f} | {graphs} |")
            print(rows[-1], flush=True)  # as it comes: a call cut off by a time limit keeps its rows
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    data = (f"the prompt and response lengths of {args.lengths_from}" if args.lengths_from else
            f"prompts of {shapes[0] // 4}-{shapes[0]}, responses of {shapes[1] // 2}-{shapes[1]} tokens")
    header = (f"train_step: B sequences x {recipe.num_anchors} blocks per step ({data}), "
              f"{'drafter + rank-0 twin' if args.rank0_twin else 'drafter alone'}, {steps} steps "
              f"after {warmup} warm-up.\n\n{name}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{datetime.date.today()}.\n")
    emit_table([header, "| B | compiled | ms / step | steps / s | sequences / s | peak GiB | graphs compiled |",
                "|---|---|---|---|---|---|---|", *rows], args.out)
    for name, run in runs.items() if args.profile else ():
        print(f"\n{name}, batch size {batch_sizes[-1]}:")
        use(VARIANTS[name])
        print_profile([functools.partial(run, step) for step in range(warmup + steps, warmup + steps + args.profile)],
                      device)


if __name__ == "__main__":
    main()
