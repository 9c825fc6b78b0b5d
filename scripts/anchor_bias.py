"""Why the training log's AL estimate runs above decoded AL: the anchors a decoder visits.

At T = 0 a speculative decoder is deterministic, so a greedy sequence fixes how many drafts n(p) the
drafter gets accepted from every anchor p (teacher forcing gives them all in one forward). The
decoder starts its next step at p + n(p) + 1: it visits the anchors after a rejection and skips the
ones inside accepted runs, which are the easy ones. The training log averages 1 + n(p) over random
anchors; the decoder's AL is its mean over the visited ones. This prints both, and the AL of the
actual decode of the same prompts (the walk's figure equals it where the float32 forwards agree).

    python scripts/anchor_bias.py --num-prompts 12      # CPU, float32, the shipped drafter
    python scripts/anchor_bias.py --num-prompts 12 --drafter RUN/drafter
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dspark.data import heldout_prompts, render
from dspark.decoder import SpeculativeDecoder
from dspark.eval import Acceptance, acceptances
from dspark.sampling import SamplingParams
from heldout import draft_logits, load_pair, target_forward


@torch.no_grad()
def accepted_runs(target, drafter, sequence: list[int], prompt_len: int, k: int) -> torch.Tensor:
    """n(p) for every response anchor p of a greedy sequence: [len - 1 - prompt_len] long."""
    end = len(sequence) - 1  # the last position with a next token; slots past it count as rejected
    tokens, logits, features = target_forward(target, drafter, sequence)
    anchors = torch.arange(prompt_len, end)
    at = anchors[:, None] + torch.arange(k)  # slot j drafts the token after position at[:, j]
    drafts = draft_logits(drafter, features, tokens, anchors)[:, :k].argmax(-1)
    agree = (drafts == logits[0, at].argmax(-1)) & (at < end)
    return agree.long().cumprod(1).sum(1)


def visited(runs: torch.Tensor) -> list[int]:
    """The runs of the anchors a decoder steps on, starting at the first response anchor."""
    steps, p = [], 0
    while p < len(runs):
        steps.append(int(runs[p]))
        p += steps[-1] + 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=12, help="the first N held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=7)
    parser.add_argument("--drafter", type=Path, default=None,
                        help="a DeepSpec-format drafter folder (default: the shipped drafter)")
    args = parser.parse_args()
    for name, value in (("--num-prompts", args.num_prompts), ("--max-tokens", args.max_tokens), ("-k", args.k)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    target, drafter, tokenizer = load_pair(args.drafter)
    prompts = render(tokenizer, heldout_prompts()[:args.num_prompts])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, stop_token_ids=tokenizer.eos_token_ids)
    results = SpeculativeDecoder(target, drafter, num_speculative_tokens=args.k).generate(prompts, params)
    decoded = sum(acceptances(results), start=Acceptance([0] * args.k, 0, 0))
    every, walked = [], []
    for prompt, result in zip(prompts, results):
        runs = accepted_runs(target, drafter, prompt + result.tokens, len(prompt), args.k)
        every += runs.tolist()
        walked += visited(runs)
    print(f"{len(prompts)} prompts, K = {args.k}, T = 0, float32 on the CPU")
    print(f"AL over every response anchor (the training log's estimate): {1 + sum(every) / len(every):.3f} "
          f"({len(every)} anchors)")
    print(f"AL over the anchors a decoder visits: {1 + sum(walked) / len(walked):.3f} ({len(walked)} steps)")
    print(f"AL of the decode itself: {decoded.acceptance_length:.3f} ({decoded.steps} steps)")


if __name__ == "__main__":
    main()
