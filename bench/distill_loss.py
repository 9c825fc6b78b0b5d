"""Speed of the drafter's training loss over the vocabulary, forward and backward, at the training
step's shapes: dspark::distill_loss (one Triton kernel that writes the gradient with the terms)
against its baseline, `autograd_slot_losses`: the same formulas in torch, differentiated by autograd
and compiled by Inductor, in one process.

Random bfloat16 base logits, Markov bias and target logits [rows, V] (rows = 64 sequences x 64 blocks
x 7 slots, the default recipe's), the shipped recipe's weights (0.1 CE, 0.9 TV, 0.3 argmax CE, 1.0
KL); each variant compiled with torch.compile, then timed with CUDA events over --steps forward and
backward passes after 3 warm-up ones (median). "Bytes" is the least a pass must move: the three
inputs read once and the gradient written once per input that takes it. Then the kernel alone at
other tilings (vocabulary columns a program reads at a time x warps), for the op's choice.

    python -m bench.distill_loss [--rows 28672] [--vocab 49152] [--out table.md]
    python -m bench.distill_loss --smoke     # tiny shapes on the CPU: checks that it runs
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.nn.functional as F
import triton

from bench.timing import emit_table
from dspark.ops.distill_loss import CHUNK, NUM_WARPS, launch_distill_loss

loss_op = torch.ops.dspark.distill_loss
WEIGHTS = (0.1, 0.9, 0.3, 1.0)  # ce, tv, argmax, kl


def autograd_slot_losses(logits: torch.Tensor, bias: torch.Tensor | None, confidence: torch.Tensor | None,
                         labels: torch.Tensor, target_logits: torch.Tensor, ce_weight: float, tv_weight: float,
                         confidence_weight: float, argmax_weight: float = 0.0, kl_weight: float = 0.0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dspark.train.slot_losses with the terms over the vocabulary written as torch formulas and
    differentiated by autograd (compiled, Inductor fuses their passes) instead of dspark::distill_loss:
    the baseline of this benchmark and of bench/train_step.py's "autograd loss" variant.
    logits, bias, target_logits: [..., V]; confidence, labels: [...] -> terms, accept, agree, log ratio [...]"""
    logits = logits.float() if bias is None else logits.float() + bias.float()
    log_q = logits.log_softmax(-1)
    log_p = target_logits.float().log_softmax(-1)  # T = 1
    target_probs = log_p.exp()
    ce = -log_q.gather(-1, labels[..., None]).squeeze(-1)
    tv = 0.5 * (log_q.exp() - target_probs).abs().sum(-1)
    accept = (1 - tv.detach()).clamp_min(0.0)  # TV can exceed 1 by a rounding error
    target_argmax = target_probs.argmax(-1, keepdim=True)
    agree = (logits.detach().argmax(-1, keepdim=True) == target_argmax).squeeze(-1).float()
    log_ratio = (log_q - log_p).detach().gather(-1, labels[..., None]).squeeze(-1)
    terms = ce_weight * ce + tv_weight * tv
    if argmax_weight:
        terms = terms + argmax_weight * -log_q.gather(-1, target_argmax).squeeze(-1)
    if kl_weight:
        terms = terms + kl_weight * (target_probs * (log_p - log_q)).sum(-1)
    if confidence is not None:
        terms = terms + confidence_weight * F.binary_cross_entropy_with_logits(
            confidence.float(), accept, reduction="none")
    return terms, accept, agree, log_ratio


def inductor_losses(logits, bias, target_logits, labels):
    """The terms, 1 - TV and agreement of the baseline (autograd_slot_losses)."""
    return autograd_slot_losses(logits, bias, None, labels, target_logits, *WEIGHTS[:2], 0.0, *WEIGHTS[2:])[:3]


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
    for name, fn in (("Inductor: the formulas, autograd", inductor_losses),
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
