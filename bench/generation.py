"""Offline generation with and without overlapped scheduling, in one process: seconds per
`dspark.engine.generate` call over a batch of prompts to a fixed length (what self-distillation does
on the GPU, and `python -m dspark.eval`).

With overlap (the engine's default on CUDA) the host queues step n + 1 before it reads step n's
tokens and does its bookkeeping; the baseline (overlap=False) reads each step before queuing the
next, so the device waits for the host every step. Half the rows greedy, half at T = 1, no drafter
(self-distillation's decoder); a target of SmolLM2-135M's shapes with random bfloat16 weights (speed
does not depend on the weights; no row meets a stop token, so every call runs the same steps).
The variants take turns, each call timed with a device synchronisation at both ends.

    python -m bench.generation [--batch 2048] [--max-tokens 192] [--rounds 2] [--out table.md]
    python -m bench.generation --profile    # and the kernels of one eager call with overlap
    python -m bench.generation --smoke      # CPU, a tiny target, eager only: checks that it runs
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from bench.models import SMOKE, SMOLLM2
from bench.prefill import draw_prompts
from bench.timing import emit_table, print_profile
from dspark import SamplingParams, SpeculativeDecoder, TargetModel
from dspark.engine import generate
from dspark.loading import measuring_dtype


def generate_seconds(decoder: SpeculativeDecoder, prompts: list[list[int]], max_tokens: int,
                     cuda_graphs: bool, overlap: bool) -> float:
    """Wall seconds of one generate call over `prompts`, every row running to `max_tokens`."""
    params = [SamplingParams(temperature=float(i % 2), seed=i, max_tokens=max_tokens, ignore_eos=True)
              for i in range(len(prompts))]
    if decoder.device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    results = generate(decoder, prompts, params, cuda_graphs=cuda_graphs, overlap=overlap)
    if decoder.device.type == "cuda":
        torch.cuda.synchronize()
    assert all(len(r.tokens) == max_tokens for r in results)
    return time.perf_counter() - began


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2048, help="prompts per call (self-distillation's batch)")
    p.add_argument("--lengths", type=int, nargs=2, default=[60, 100], help="prompt lengths, shortest and longest")
    p.add_argument("--max-tokens", type=int, default=192, help="new tokens per row (self-distillation's limit)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="also profile one eager generate call of dspark's decoder (a CUDA graph replays the same kernels)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        device, config = torch.device("cpu"), SMOKE
        args.batch, args.lengths, args.max_tokens, args.rounds = 16, [4, 12], 8, 1
    else:
        device, config = torch.device("cuda"), SMOLLM2
    modes = {"CUDA graph": True, "eager": False} if device.type == "cuda" else {"eager": False}
    torch.manual_seed(0)
    target = TargetModel(config).to(device, measuring_dtype(device)).eval()
    decoder = SpeculativeDecoder(target, None)
    variants = {"each step read at once": False, "overlapped (dspark)": True}
    generator = torch.Generator().manual_seed(0)
    for overlap in variants.values():  # one-time costs
        for graph in modes.values():
            generate_seconds(decoder, draw_prompts(8, args.lengths, config.vocab_size, generator), 4, graph, overlap)
    seconds = {(mode, name): [] for mode in modes for name in variants}
    for _ in range(args.rounds):
        for mode, graph in modes.items():
            prompts = draw_prompts(args.batch, args.lengths, config.vocab_size, generator)
            for name, overlap in variants.items():
                seconds[mode, name].append(generate_seconds(decoder, prompts, args.max_tokens, graph, overlap))

    if args.profile:
        prompts = draw_prompts(args.batch, args.lengths, config.vocab_size, generator)
        print_profile([lambda: generate_seconds(decoder, prompts, args.max_tokens, False, True)], device,
                      unit="generate call")

    tokens = args.batch * args.max_tokens
    lines = [f"generation, {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
             f"torch {torch.__version__}, {datetime.date.today()}: {args.rounds} rounds, a batch of {args.batch} "
             f"prompts of {args.lengths[0]}-{args.lengths[1]} tokens, {args.max_tokens} new tokens each, no drafter",
             "",
             "| steps | host | s per batch (median) | new tokens / s | ms per decode step, prefill included |",
             "|---|---|---|---|---|"]
    for (mode, name), times in seconds.items():
        median = statistics.median(times)
        lines.append(f"| {mode} | {name} | {median:.2f} | {tokens / median:,.0f} | "
                     f"{1e3 * median / (args.max_tokens - 1):.1f} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
