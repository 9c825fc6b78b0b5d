"""Decoding speed of the default pair on this CPU, batch 1, in one process:

- transformers' generate on the same GGUF (greedy), when transformers is installed;
- dspark without speculation (K = 0), greedy and at T = 1;
- dspark with the shipped DSpark drafter (K = 7), greedy and at T = 1, standard and block (with
  --drafter, with each drafter folder given instead, labelled by its name);
- with --compile, also K = 0 and K = 7 block with the decode step through torch.compile (its
  compilation falls in the warm-up run).

Tokens/s is new tokens over wall time (prefill included), median (and quartiles) over every run of
the decoder; tokens/step is the mean acceptance length (bonus token included). The decoders take
turns, `--rounds` passes over all of them, so a slow phase of the machine does not land on one row.

    python -m bench.decode_cpu [--tokens 96] [--prompts 4] [--rounds 3] [--dtype float32 bfloat16] [--compile]
        [--drafter DIR [DIR ...]] [--out table.md]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.timing import emit_table
from dspark import SamplingParams, SpeculativeDecoder
from dspark.data import heldout_prompts, render
from dspark.engine import generate
from dspark.eval import load_drafters
from dspark.loading import default_gguf_path

@dataclass
class Measured:
    rates: list[float] = field(default_factory=list)  # tokens/s of each run
    tokens: int = 0  # after the first token of each run (which the prefill gives)
    steps: int = 0


def dspark_runner(decoder: SpeculativeDecoder, params: SamplingParams):
    """A function that decodes one prompt and returns (new tokens, decode steps)."""
    def run(prompt):
        result = generate(decoder, [prompt], params)[0]
        return len(result.tokens), result.num_steps
    return run


def transformers_runner(n_tokens: int, dtype: torch.dtype):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)

    def run(prompt):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                             do_sample=False)
        return out.shape[1] - len(prompt), out.shape[1] - len(prompt) - 1
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="passes over all decoders, interleaved")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], nargs="+", default=["float32"],
                   help="weights and activations of the decoders (the GGUF is dequantized to it); "
                        "several: every decoder in each, in the same rounds")
    p.add_argument("--compile", action="store_true",
                   help="also K = 0 and K = 7 block with the step through torch.compile (compiled in the warm-up)")
    p.add_argument("--drafter", nargs="+", type=Path, default=None,
                   help="DeepSpec-format drafter folders to time (default: the shipped drafter, as DSpark)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.prompts * args.rounds < 2:
        p.error(f"--prompts x --rounds must be at least 2 (the quartiles need two runs), "
                f"got {args.prompts} x {args.rounds}")
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0)
    runners = {}
    for name in args.dtype:
        dtype = getattr(torch, name)
        target, drafters, tokenizer = load_drafters(args.drafter, dtype, default_label="DSpark")
        plain = SpeculativeDecoder(target, None)
        runners[f"{name}: transformers generate, greedy"] = transformers_runner(args.tokens, dtype)
        runners[f"{name}: dspark K=0, greedy"] = dspark_runner(plain, greedy)
        runners[f"{name}: dspark K=0, T=1"] = dspark_runner(plain, sampled)
        for label, drafter in drafters.items():
            for method in ("standard", "block"):
                spec = SpeculativeDecoder(target, drafter, num_speculative_tokens=7, rejection_sample_method=method)
                runners[f"{name}: dspark {label} K=7 {method}, greedy"] = dspark_runner(spec, greedy)
                runners[f"{name}: dspark {label} K=7 {method}, T=1"] = dspark_runner(spec, sampled)
        if args.compile:
            compiled = {"K=0": SpeculativeDecoder(target, None, compile=True)}
            for label, drafter in drafters.items():
                compiled[f"{label} K=7 block"] = SpeculativeDecoder(target, drafter, num_speculative_tokens=7,
                                                                    rejection_sample_method="block", compile=True)
            for label, decoder in compiled.items():
                for temperature, params in (("greedy", greedy), ("T=1", sampled)):
                    runners[f"{name}: dspark {label} compiled, {temperature}"] = dspark_runner(decoder, params)
    prompts = render(tokenizer, heldout_prompts()[:args.prompts])
    measured = {name: Measured() for name, run in runners.items() if run is not None}
    for name in measured:
        runners[name](prompts[0])  # warm-up
    for _ in range(args.rounds):  # round-robin, so that slow phases of the machine hit every decoder
        for name, m in measured.items():
            for prompt in prompts:
                began = time.perf_counter()
                tokens, steps = runners[name](prompt)
                m.rates.append(tokens / (time.perf_counter() - began))
                m.tokens, m.steps = m.tokens + tokens - 1, m.steps + steps
    lines = [f"{datetime.date.today()}, {platform.machine()} CPU, {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}; SmolLM2-135M-Instruct Q4_1 GGUF dequantized to {' / '.join(args.dtype)}; batch 1, "
             f"{args.tokens} new tokens per held-out prompt, {args.prompts} prompts x {args.rounds} rounds",
             "", "| decoder | tokens/s (median) | tokens/s (quartiles) | tokens/step |", "|---|---|---|---|"]
    for name in runners:
        if name not in measured:
            lines.append(f"| {name} | not installed | | |")
            continue
        m = measured[name]
        q1, _, q3 = statistics.quantiles(m.rates, n=4)
        lines.append(f"| {name} | {statistics.median(m.rates):.1f} | {q1:.1f} - {q3:.1f} "
                     f"| {m.tokens / max(m.steps, 1):.2f} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
