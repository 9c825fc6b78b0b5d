"""Speed of the drafter's training loss over the vocabulary, forward and backward, at the training
step's shapes: dspark::distill_loss (one Triton kernel that writes the gradient with the terms)
against the training step's loss before the op (commit 7c07aee's slot_losses: the same formulas,
differentiated by autograd and compiled by Inductor), in one process.

Random bfloat16 base logits, Markov bias and target logits [rows, V] (rows = 64 sequences x 64 blocks
x 7 slots, the default recipe's), the shipped recipe's weights (0.1 CE, 0.9 TV, 0.3 argmax CE, 1.0
KL); each variant compiled with torch.compile, then timed with CUDA events over --steps forward and
backward passes after 3 warm-up ones (median). "Bytes" is the least a pass must move: the three
inputs read once and the gradient written once per input that takes it. Then the kernel alone at
other tilings (vocabulary columns a program reads at a time x warps), for the op's choice.

    python bench/distill_loss.py [--rows 28672] [--vocab 49152] [--out table.md]
    python bench/distill_loss.py --smoke     # tiny shapes on the CPU: checks that it runs
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import triton

from baselines import slot_losses_7c07aee
from dspark.ops.distill_loss import CHUNK, NUM_WARPS, launch_distill_loss
from timing import emit_table

loss_op = torch.ops.dspark.distill_loss
WEIGHTS = (0.1, 0.9, 0.3, 1.0)  # ce, tv, argmax, kl


def inductor_losses(logits, bias, target_logits, labels):
    """The terms, 1 - TV and agreement as the training step computed them before the op (7c07aee)."""
    return slot_losses_7c07aee(logits, bias, None, labels, target_logits, *WEIGHTS[:2], 0.0, *WEIGHTS[2:])


def op_losses(logits, bias, target_logits, labels):
    terms, tv, agree, _, _ = loss_op(logits, bias, target_logits, labels, *WEIGHTS)
    return terms, (1 - tv).clamp_min(0.0), agree


def tiling(text: str) -> tuple[int, int]:
    chunk, warps = text.split("x")
    return int(chunk), int(warps)


def timed_ms(fn, steps: int, device: torch.device) -> float:
    """Median ms of fn() (a forward and backward), by CUDA events on the GPU, else wall clock."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64 * 64 * 7)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tilings", type=tiling, nargs="*", default=[(4096, 8), (2048, 8), (2048, 4), (8192, 16)],
                        metavar="CHUNKxWARPS", help="kernel tilings to time alone (GPU)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", help="also write the table as markdown here")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.rows, args.vocab, args.steps = 56, 1000, 2
    g = torch.Generator(device=device).manual_seed(0)
    logits, bias, target_logits = (torch.randn(args.rows, args.vocab, device=device, generator=g).bfloat16()
                                   for _ in range(3))
    labels = torch.randint(0, args.vocab, (args.rows,), device=device, generator=g)
    upstream = torch.rand(args.rows, device=device, generator=g)
    leaves = [t.requires_grad_() for t in (logits, bias)]
    results, rows = {}, []
    for name, fn in (("Inductor: the formulas, autograd (7c07aee)", inductor_losses),
                     ("dspark::distill_loss", op_losses)):
        compiled = torch.compile(fn)

        def step():
            for leaf in leaves:
                leaf.grad = None
            terms, accept, agree = compiled(logits, bias, target_logits, labels)
            (terms * upstream).sum().backward()
            return terms.detach(), accept, agree, logits.grad

        ms = timed_ms(step, args.steps, device)
        results[name] = step()
        moved = (3 + len(leaves)) * args.rows * args.vocab * 2
        rows.append(f"| {name} | {ms:.2f} | {moved / ms / 1e6:.0f} |")
        print(rows[-1], flush=True)
    outputs = [torch.empty(args.rows, device=device) for _ in range(4)] + [torch.empty_like(logits)]
    tilings = []
    for chunk, warps in args.tilings if device.type == "cuda" else ():
        ms = timed_ms(lambda: launch_distill_loss(lambda kernel: kernel, logits.detach(), bias.detach(), target_logits,
                                                  labels, WEIGHTS, *outputs, chunk=chunk, num_warps=warps),
                      args.steps, device)
        tilings.append(f"| {chunk} | {warps} | {ms:.2f} | {4 * args.rows * args.vocab * 2 / ms / 1e6:.0f} |")
        print(tilings[-1], flush=True)
    (terms, accept, agree, grad), (op_terms, op_accept, op_agree, op_grad) = results.values()
    check = (f"Largest differences, op against Inductor: terms {(op_terms - terms).abs().max():.2e}, 1 - TV "
             f"{(op_accept - accept).abs().max():.2e}, gradient {(op_grad.float() - grad.float()).abs().max():.2e}; "
             f"agreement differs on {(op_agree != agree).sum().item()} of {args.rows} rows.")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = (f"The loss over the vocabulary, forward and backward: {args.rows} rows x {args.vocab}, bfloat16, "
              f"{args.steps} passes after 3 warm-up.\n\n{where}, torch {torch.__version__}, triton "
              f"{triton.__version__}, {datetime.date.today()}.\n")
    tiling_table = ["", f"The kernel alone (the forward) by tiling (the op's: {CHUNK} x {NUM_WARPS}):", "",
                    "| chunk | warps | ms | GB/s of its least bytes |", "|---|---|---|---|", *tilings]
    tiling_table = tiling_table if tilings else []
    emit_table([header, "| loss | ms / pass | GB/s of the least bytes a pass moves |", "|---|---|---|", *rows,
                "", check, *tiling_table], args.out)


if __name__ == "__main__":
    main()
