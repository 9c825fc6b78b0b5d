"""Decoding speed of the default pair on this CPU, batch 1, in one process:

- transformers' generate on the same GGUF (greedy), when transformers is installed;
- dspark without speculation (K = 0), greedy and at T = 1;
- dspark with the shipped DSpark drafter (K = 7), greedy and at T = 1, standard and block.

Tokens/s is new tokens over wall time (prefill included), median over the prompts' runs;
tokens/step is the mean acceptance length (bonus token included).

    python bench/decode_cpu.py [--tokens 96] [--prompts 4] [--out table.md]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from dspark import SamplingParams, SpeculativeDecoder, load_default
from dspark.data import heldout_prompts, render
from dspark.loading import default_gguf_path
from timing import emit_table

def run_dspark(decoder: SpeculativeDecoder, prompts, params: SamplingParams):
    """Returns (median tokens/s, mean tokens per step)."""
    decoder.generate([prompts[0]], params)  # warm-up
    rates, tokens, steps = [], 0, 0
    for prompt in prompts:
        began = time.perf_counter()
        result = decoder.generate([prompt], params)[0]
        rates.append(len(result.tokens) / (time.perf_counter() - began))
        tokens, steps = tokens + len(result.tokens) - 1, steps + result.num_steps
    return statistics.median(rates), tokens / max(steps, 1)


def run_transformers(prompts, n_tokens: int):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    rates = []
    for prompt in [prompts[0]] + prompts:  # the first run warms up
        began = time.perf_counter()
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                             do_sample=False)
        rates.append((out.shape[1] - len(prompt)) / (time.perf_counter() - began))
    return statistics.median(rates[1:]), 1.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target, drafter, tokenizer = load_default()
    prompts = render(tokenizer, heldout_prompts()[:args.prompts])
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0)
    plain = SpeculativeDecoder(target, None)
    rows = [("transformers generate, greedy", run_transformers(prompts, args.tokens)),
            ("dspark K=0, greedy", run_dspark(plain, prompts, greedy)),
            ("dspark K=0, T=1", run_dspark(plain, prompts, sampled))]
    for method in ("standard", "block"):
        spec = SpeculativeDecoder(target, drafter, num_speculative_tokens=7, rejection_sample_method=method)
        rows.append((f"dspark DSpark K=7 {method}, greedy", run_dspark(spec, prompts, greedy)))
        rows.append((f"dspark DSpark K=7 {method}, T=1", run_dspark(spec, prompts, sampled)))
    lines = [f"{datetime.date.today()}, {platform.machine()} CPU, {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}; SmolLM2-135M-Instruct Q4_1 GGUF dequantized to float32; batch 1, "
             f"{args.tokens} new tokens per held-out prompt, {args.prompts} prompts",
             "", "| decoder | tokens/s (median) | tokens/step |", "|---|---|---|"]
    for name, measured in rows:
        if measured is None:
            lines.append(f"| {name} | not installed | |")
        else:
            lines.append(f"| {name} | {measured[0]:.1f} | {measured[1]:.2f} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
