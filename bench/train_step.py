"""Training speed: optimizer steps per second of `dspark.train.train_step` on the default recipe's
shapes, eager, with the per-slot loss (CE, TV, confidence BCE over the vocabulary) compiled, and
with the whole step's forward compiled (the target's and each drafter's, loss included).

A target of SmolLM2-135M's shapes with random bfloat16 weights (speed does not depend on the
weights), the default drafter and its rank-0 twin, batches of random sequences of lengths like the
self-distilled data's (prompts of 100 to 400 tokens, responses of 96 to 192, drawn per sequence, so
that batches differ in length). The variants run in one process on the same batches; each is warmed
up (compiling there), then timed over --steps steps with a device synchronisation at both ends. The
table counts the graphs each variant compiled: a count that grows with the steps would mean a
compilation per batch length.

    python bench/train_step.py                  # GPU
    python bench/train_step.py --profile 3      # and where each variant's step time goes
    python bench/train_step.py --smoke          # CPU, tiny shapes: checks that it runs
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import time

import torch
import triton
from torch._dynamo.utils import counters

from dspark.config import TargetConfig
from dspark.data import Sequence
from dspark.target import TargetModel
from dspark.train import TrainConfig, default_drafter_config, make_batch, make_student, train_step
from timing import emit_table, print_profile

SMOLLM2_135M = TargetConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                            max_position_embeddings=8192, tie_word_embeddings=True)
TINY = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8)
# (name, what torch.compile covers: dspark.train.COMPILE_MODES)
VARIANTS = (("eager", "none"), ("compiled loss", "loss"), ("compiled step", "all"))


def random_sequences(count: int, vocab: int, prompt_len: int, response_len: int) -> list[Sequence]:
    """Sequences of a prompt of prompt_len / 4 .. prompt_len tokens and a response of
    response_len / 2 .. response_len tokens."""
    g = torch.Generator().manual_seed(0)
    sequences = []
    for _ in range(count):
        prompt = int(torch.randint(prompt_len // 4, prompt_len + 1, (), generator=g))
        response = int(torch.randint(response_len // 2, response_len + 1, (), generator=g))
        sequences.append(Sequence(torch.randint(0, vocab, (prompt + response,), generator=g).tolist(), prompt))
    return sequences


def step_runner(target, sequences, recipe, compile, device):
    """run(step): one training step of a fresh drafter and its rank-0 twin on batch `step`."""
    students = [make_student("drafter", target, default_drafter_config(target.config, 16), recipe),
                make_student("drafter-rank0", target, default_drafter_config(target.config, 16, markov_rank=0),
                             recipe)]
    block_size = students[0].drafter.block_size

    def run(step):
        train_step(target, students, make_batch(sequences, step, recipe, block_size).to(device), recipe, compile)

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
    args = parser.parse_args()
    recipe, batch_sizes = TrainConfig(), args.batch_sizes
    if args.smoke:
        device, config, shapes, steps, warmup = torch.device("cpu"), TINY, (24, 40), 2, 1
        recipe.num_anchors, batch_sizes = 8, [2]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device; use --smoke for a CPU check")
        device, config, shapes, steps, warmup = torch.device("cuda"), SMOLLM2_135M, (400, 192), args.steps, 5
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = TargetModel(config).to(device, dtype).eval().requires_grad_(False)
    rows, runs = [], {}
    for batch_size in batch_sizes:
        recipe = dataclasses.replace(recipe, batch_size=batch_size)
        sequences = random_sequences(4 * batch_size, config.vocab_size, *shapes)
        for name, compile in VARIANTS:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            runs[name] = step_runner(target, sequences, recipe, compile, device)
            graphs = counters["stats"]["unique_graphs"]
            rate = steps_per_second(runs[name], steps, warmup, device)
            graphs = counters["stats"]["unique_graphs"] - graphs
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            rows.append(f"| {batch_size} | {name} | {1000 / rate:.1f} | {rate:.2f} | {rate * batch_size:.0f} "
                        f"| {peak:.1f} | {graphs} |")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = (f"train_step: B sequences x {recipe.num_anchors} blocks per step "
              f"(prompts of {shapes[0] // 4}-{shapes[0]}, responses of {shapes[1] // 2}-{shapes[1]} tokens), "
              f"drafter + rank-0 twin, {steps} steps "
              f"after {warmup} warm-up.\n\n{name}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{datetime.date.today()}.\n")
    emit_table([header, "| B | compiled | ms / step | steps / s | sequences / s | peak GiB | graphs compiled |",
                "|---|---|---|---|---|---|---|", *rows], args.out)
    for name, run in runs.items() if args.profile else ():
        print(f"\n{name}, batch size {batch_sizes[-1]}:")
        print_profile([functools.partial(run, step) for step in range(warmup + steps, warmup + steps + args.profile)],
                      device)


if __name__ == "__main__":
    main()
