"""Speed of dspark::verify (the Triton kernels) against its plain-torch implementation run on the same
GPU, for standard and block verification.

Random bfloat16 target logits [B, K+1, V], proposals near the target (so that drafts get accepted),
drafts drawn from them, T = 1. Each implementation is captured in a CUDA graph; the time is the median
of the replays, measured with CUDA events.

    python -m bench.verify [--batch 1 8 64] [--k 7] [--vocab 200064] [--out verify.md]
    python -m bench.verify --smoke   # tiny shapes, any device: checks that the script runs
"""
from __future__ import annotations

import argparse

import torch
import triton

from bench.timing import emit_table, median_us
from dspark.ops.verify import verify_torch

verify = torch.ops.dspark.verify


def inputs(B: int, K: int, V: int, device: str):
    g = torch.Generator(device=device).manual_seed(B)
    logits = torch.randn(B, K + 1, V, device=device, generator=g) * 3
    draft_probs = torch.softmax(logits[:, :K] + torch.randn(B, K, V, device=device, generator=g), -1)
    drafts = torch.multinomial(draft_probs.view(-1, V), 1, generator=g).view(B, K)
    seeds = torch.randint(0, 2**62, (B,), device=device, generator=g)
    offsets = torch.randint(0, 2**40, (B,), device=device, generator=g)
    return (logits.bfloat16(), drafts, draft_probs, torch.arange(B, device=device),
            torch.ones(B, device=device), seeds, offsets)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--vocab", type=int, default=200064)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--smoke", action="store_true", help="B = 1, 2, K = 3, V = 1000, a few replays")
    p.add_argument("--out", default=None, help="write the table as markdown here")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.k, args.vocab, args.replays = [1, 2], 3, 1000, 3
    device = "cuda" if torch.cuda.is_available() else "cpu"

    rows = []
    for B in args.batch:
        data = inputs(B, args.k, args.vocab, device)
        for rule in ("standard", "block"):
            block = rule == "block"
            emitted, n = verify(*data, block)
            expected, _ = verify_torch(*data, block)
            op_us = median_us(lambda: verify(*data, block), device, args.replays)
            torch_us = median_us(lambda: verify_torch(*data, block), device, args.replays)
            agree = (emitted == expected).all(dim=1).float().mean().item()
            rows.append((rule, B, op_us, torch_us, n.float().mean().item(), agree))

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (the op runs its torch path)"
    lines = [f"dspark::verify, K = {args.k}, V = {args.vocab}, bfloat16 target logits, T = 1; {where}; "
             f"torch {torch.__version__}, triton {triton.__version__}; median of {args.replays} "
             f"{'CUDA-graph replays' if device == 'cuda' else 'calls'}",
             "", "| rule | B | dspark (µs) | plain torch (µs) | speed-up | mean accepted | rows equal |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {rule} | {B} | {op:.1f} | {ref:.1f} | {ref / op:.1f}x | {acc:.2f} | {agree:.0%} |"
              for rule, B, op, ref, acc, agree in rows]
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
