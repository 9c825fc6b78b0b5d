"""python -m dspark.train.heldout_estimates: the training log's held-out estimates for drafters
already trained, to compare them without decoding.

Each held-out prompt is answered twice by the target, greedily and at temperature 1, with the
training command's defaults (cached in --cache); for every drafter it prints 1 - TV and argmax
agreement per position on each kind of response, and the AL estimates they give ("reach": 1 +
sum_k E[reach_k (1 - TV_k)], on the sampled responses the expected AL of standard verification at
T = 1, see dspark.train.loss). A drafter can gain on the greedy responses (the text a decode at
T = 0 walks) and not on the sampled ones (what T = 1 meets). Anchors are drawn per batch as in
training, so another --batch-size draws other anchors.

    python -m dspark.train.heldout_estimates --drafter dspark/assets/drafter RUN/drafter   # CPU, float32
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dspark.checkpoint import load_drafter
from dspark.data import heldout_prompts
from dspark.eval import drafter_labels
from dspark.loading import load_default_target
from dspark.train import Student, TrainConfig, evaluate_students, heldout_batches, heldout_sequences, parse_args


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m dspark.train.heldout_estimates", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, nargs="+", required=True, help="DeepSpec-format drafter folders")
    p.add_argument("--cache", type=Path, default=Path("heldout-responses.jsonl"),
                   help="where the target's held-out responses are cached")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward (memory: logits of all anchors)")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    target, tokenizer = load_default_target(dtype=torch.float32, device="cpu")
    trainer = parse_args(["--out", "unused"])  # the training command's response settings
    sets = heldout_sequences(target.eval(), tokenizer, heldout_prompts(), args.cache,
                             max_prompt_tokens=trainer.max_prompt_tokens, max_tokens=trainer.max_tokens,
                             seed=trainer.seed, batch_size=160)
    config = TrainConfig(batch_size=args.batch_size)
    print("| drafter | responses | AL estimate T = 1 | reach AL estimate T = 1 | AL estimate T = 0 "
          "| 1 - TV, positions 1..K | argmax agreement, positions 1..K |\n|---|---|---|---|---|---|---|")
    for label, path in zip(drafter_labels(args.drafter), args.drafter):
        drafter = load_drafter(path, target)
        student = Student(label, drafter, optimizer=None, scheduler=None)  # evaluated, never stepped
        for kind, sequences in sets.items():
            batches = heldout_batches(sequences, config, drafter.block_size)
            s = evaluate_students(target, [student], batches, config)[0].summary()
            print(f"| {label} | {kind} ({len(sequences)}) | {s['al_estimate']:.3f} | {s['al_reach_estimate']:.3f} "
                  f"| {s['al_greedy_estimate']:.3f} "
                  f"| {' '.join(f'{a:.2f}' for a in s['acceptance'])} "
                  f"| {' '.join(f'{a:.2f}' for a in s['greedy_agreement'])} |", flush=True)


if __name__ == "__main__":
    main()
