"""How much of the target's next-token mass would a reduced draft vocabulary miss?

A drafter that proposes only from N tokens (EAGLE-3's and speculators' draft vocabularies; its
Markov head's two [V, r] tables would shrink to [N, r], so the same file could hold a higher rank)
stays lossless, but at every position standard verification then accepts at most the target's mass
on those N tokens. This ranks the vocabulary by the mass the target puts on each token over its own
responses to training prompts (the sum of its next-token laws at the response positions), then
prints, on the held-out prompts' greedy and sampled responses, the mean target mass outside the top
N per position (the bound on the acceptance lost there) and how often the target's argmax lies
outside them (what a T = 0 decode would miss).

    python scripts/draft_vocabulary.py                       # CPU, float32, 256 training prompts
    python scripts/draft_vocabulary.py --dtype bfloat16 --cache-dir /tmp/vocab
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dspark.data import Sequence, render, self_distill, training_prompts
from dspark.loading import DTYPES, load_default_target
from dspark.train import parse_args as training_args

from heldout import heldout_responses

SIZES = (2048, 4096, 8192, 12288, 16384, 24576, 32768)


@torch.no_grad()
def response_laws(target, sequence: Sequence) -> torch.Tensor:
    """The target's next-token laws at the response's positions [response tokens, V], float32."""
    ids = torch.tensor(sequence.tokens)[None]
    logits, _ = target(ids, torch.arange(ids.shape[1])[None], hidden_layer_ids=())
    return logits[0, sequence.prompt_len - 1:-1].float().softmax(-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=256, help="training prompts whose responses rank the tokens")
    p.add_argument("--cache-dir", type=Path, default=Path("draft-vocabulary"), help="the responses, generated once")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="the target's dtype")
    args = p.parse_args()
    target, tokenizer = load_default_target(dtype=DTYPES[args.dtype], device="cpu")
    target.eval()
    trainer = training_args(["--out", "unused"])  # the training command's response settings
    prompts = [q for q in render(tokenizer, training_prompts(args.num_prompts, seed=trainer.seed))
               if len(q) <= trainer.max_prompt_tokens]
    sequences, _ = self_distill(target, prompts, args.cache_dir / "training-responses.jsonl",
                                max_tokens=trainer.max_tokens, seed=trainer.seed,
                                stop_token_ids=tokenizer.eos_token_ids, responses_per_prompt=2, batch_size=64)
    mass = sum(response_laws(target, s).sum(0) for s in sequences)
    ranked = mass.argsort(descending=True)
    print(f"{len(sequences)} training responses, {sum(len(s.tokens) - s.prompt_len for s in sequences)} tokens")
    print("| held-out responses | N | target mass outside the top N | target argmax outside |")
    print("|---|---|---|---|")
    for kind, held in heldout_responses(target, tokenizer, args.cache_dir / "heldout-responses.jsonl").items():
        laws = torch.cat([response_laws(target, s) for s in held])  # [positions, V]
        for size in SIZES:
            outside = torch.ones(laws.shape[1], dtype=torch.bool)
            outside[ranked[:size]] = False
            missed = laws[:, outside].sum(1).mean()
            argmax_out = outside[laws.argmax(1)].float().mean()
            print(f"| {kind} ({laws.shape[0]} positions) | {size} | {missed:.4f} | {argmax_out:.4f} |", flush=True)


if __name__ == "__main__":
    main()
