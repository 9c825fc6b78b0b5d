"""Would drafting at another temperature raise T = 1 acceptance? Teacher-forced, on held-out responses.

A decoder may draw its drafts from any proposal q as long as verification uses that same q, so at
target temperature T the drafter could draw from q_tau = softmax(l / (tau T)) instead of
softmax(l / T) (l: its logits, Markov bias included) and stay lossless. Standard verification accepts
a slot with probability sum_v min(p_v, q_v); this prints that per position and the AL estimate it
gives (as the training log computes them), for a grid of tau, on the held-out prompts' sampled
responses (what T = 1 meets) and greedy ones. tau = 1 is what the decoder does.

    python scripts/draft_temperature.py                       # CPU, float32, the shipped drafter
    python scripts/draft_temperature.py --drafter RUN/drafter --cache heldout-responses.jsonl
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from heldout import draft_logits, heldout_responses, load_pair, target_forward

TAUS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25)


@torch.no_grad()
def slot_acceptance(target, drafter, tokens: list[int], prompt_len: int, taus) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_v min(p, q_tau) of every response anchor's K slots -> [len(taus), anchors, K], and which
    slots have a label [anchors, K]."""
    k = drafter.block_size
    end = len(tokens) - 1  # the last position with a next token
    ids, logits, features = target_forward(target, drafter, tokens)
    accepted, valid = [], []
    for anchors in torch.arange(prompt_len, end).split(32):  # memory: [32, K, V] per tau
        at = anchors[:, None] + torch.arange(k)  # slot j drafts the token after position at[:, j]
        q_logits = draft_logits(drafter, features, ids, anchors)
        p = logits[0, at].softmax(-1)
        accepted.append(torch.stack([torch.minimum(p, (q_logits / tau).softmax(-1)).sum(-1) for tau in taus]))
        valid.append(at < end)
    return torch.cat(accepted, 1).double(), torch.cat(valid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, default=None, help="a DeepSpec-format drafter folder (default: shipped)")
    p.add_argument("--cache", type=Path, default=Path("heldout-responses.jsonl"),
                   help="where the target's held-out responses are cached (scripts/heldout_estimates.py's)")
    args = p.parse_args()
    target, drafter, tokenizer = load_pair(args.drafter)
    sets = heldout_responses(target, tokenizer, args.cache)
    print("| responses | tau | AL estimate | sum min(p, q_tau), positions 1..K |\n|---|---|---|---|")
    for kind, sequences in sets.items():
        accept, survive, count = 0.0, 0.0, 0.0
        for seq in sequences:
            a, valid = slot_acceptance(target, drafter, seq.tokens, seq.prompt_len, TAUS)
            a = a * valid
            accept, survive, count = accept + a.sum(1), survive + a.cumprod(-1).sum(1), count + valid.sum(0)
        for i, tau in enumerate(TAUS):
            print(f"| {kind} ({len(sequences)}) | {tau:.2f} | {1 + (survive[i] / count).sum():.3f} | "
                  f"{' '.join(f'{x:.3f}' for x in accept[i] / count)} |", flush=True)


if __name__ == "__main__":
    main()
