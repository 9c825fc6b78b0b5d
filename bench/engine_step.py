"""The serving engine's decode step with and without CUDA graphs, in one process: ms per step of
dspark.compile's StepRunner (the step a server runs, eager), replayed from a CUDA graph or launched
kernel by kernel, per batch bucket.

The target has SmolLM2-135M-Instruct's shapes with random bfloat16 weights (no model file needed);
the drafter is the shipped one (dspark/assets/drafter). Speculation at K = 7 with every step
accepting `--accepted` drafts (SpeculativeDecoder's forced_num_accepted: the step's work does not
depend on what it accepts, and the tokens per step are fixed), and no speculation (K = 0) as the
baseline; greedy rows and T = 1 rows. Each step as the engine takes it: the step, the host copy of
its outputs, the next inputs written back. Median over `--steps` steps after three warm-up steps
(the first captures the graph).

    python -m bench.engine_step [--batches 1 8 32] [--steps 50] [--out table.md]
    python -m bench.engine_step --smoke        # CPU, a tiny target, no graphs: checks that it runs
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from bench.models import SMOKE, SMOLLM2
from bench.timing import emit_table
from dspark import (DrafterConfig, DSparkDrafter, SamplingParams, SpeculativeDecoder, TargetModel,
                    load_drafter)
from dspark.compile.runner import StepRunner
from dspark.loading import DEFAULT_DRAFTER, measuring_dtype

PROMPT_LEN = 32


def step_ms(runner: StepRunner, batch: int, temperature: float, steps: int) -> float:
    """Median wall ms of a step over rows 0 .. batch-1, each row prefilled with a random prompt."""
    decoder, device = runner.decoder, runner.tokens.device
    runner.set_params([SamplingParams(temperature=temperature, seed=row) for row in range(runner.max_batch)])
    prompts = torch.randint(0, decoder.target.config.vocab_size, (batch, PROMPT_LEN)).tolist()
    first, start = decoder.prefill(prompts, runner.sampling(batch), list(range(batch)))
    runner.tokens[:batch, 0], runner.start[:batch] = first, start
    if decoder.drafter is not None:
        runner.draft(range(batch))
    times = []
    for i in range(steps + 3):
        began = time.perf_counter()
        emitted, num_accepted, next_tokens, next_start = runner.step(batch)
        emitted.cpu(), num_accepted.cpu()
        runner.tokens[:batch], runner.start[:batch] = next_tokens, next_start
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def run(batches: list[int], steps: int, accepted: int, device: torch.device, target: TargetModel,
        drafter) -> list[str]:
    modes = [False, True] if device.type == "cuda" else [False]
    decoders = {"off (K = 0)": SpeculativeDecoder(target, None),
                f"K = 7, {accepted} accepted": SpeculativeDecoder(target, drafter, num_speculative_tokens=7,
                                                                  forced_num_accepted=accepted)}
    max_len = PROMPT_LEN + (steps + 3) * (accepted + 1) + 16
    lines = ["| B | T | speculation | tokens/step | " + " | ".join(
                 "CUDA graph ms/step" if m else "eager ms/step" for m in modes)
             + (" | graph speed-up | graph tokens/s |" if len(modes) == 2 else " |"),
             "|---" * (4 + len(modes) + 2 * (len(modes) == 2)) + "|"]
    for batch in batches:
        for temperature in (0.0, 1.0):
            for name, decoder in decoders.items():
                ms = [step_ms(StepRunner(decoder, batch, max_len, buckets=[batch], cuda_graphs=m), batch,
                              temperature, steps) for m in modes]
                per_step = accepted + 1 if decoder.drafter is not None else 1
                cells = [f"{batch}", f"{temperature:g}", name, f"{per_step}", *(f"{t:.2f}" for t in ms)]
                if len(modes) == 2:
                    cells += [f"{ms[0] / ms[1]:.2f}x", f"{1e3 * batch * per_step / ms[1]:.0f}"]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--accepted", type=int, default=3, help="drafts every step accepts")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny target, 3 steps")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    if args.smoke:
        device, config, batches, steps = torch.device("cpu"), SMOKE, [1, 2], 3
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device; use --smoke for a CPU check")
        device, config, batches, steps = torch.device("cuda"), SMOLLM2, args.batches, args.steps
    dtype = measuring_dtype(device)
    target = TargetModel(config).to(device, dtype).eval()
    if args.smoke:
        drafter = DSparkDrafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=7,
                                                         target_layer_ids=[-1, 0], markov_rank=8, mask_token_id=1),
                                embed_tokens=target.embed_tokens, lm_head=target.lm_head).eval()
    else:
        drafter = load_drafter(DEFAULT_DRAFTER, target)
    lines = run(batches, steps, args.accepted, device, target, drafter)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    models = "a tiny random pair" if args.smoke else "SmolLM2-135M's shapes, random weights; the shipped drafter"
    header = (f"Engine step, {models}, {str(dtype).split('.')[-1]}; {name}, torch "
              f"{torch.__version__}, {datetime.date.today()}; median of {steps} steps.\n")
    emit_table([header, *lines], args.out)


if __name__ == "__main__":
    main()
