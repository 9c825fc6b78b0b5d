"""Greedy decoding speed of the default model on this CPU: dspark's plain decoder (K = 0) and,
when transformers is installed, transformers' generate on the same GGUF, in the same run.

    python bench/decode_cpu.py [--tokens 80] [--repeats 3] [--out table.md]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from dspark import SamplingParams, SpeculativeDecoder, load_default
from dspark.loading import default_gguf_path

PROMPT = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def bench_dspark(prompt: list[int], tokens: int, repeats: int) -> float:
    target, _, _ = load_default()
    decoder = SpeculativeDecoder(target, None)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return tokens / time_it(lambda: decoder.generate([prompt], params), repeats)


def bench_transformers(prompt: list[int], tokens: int, repeats: int) -> float | None:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32)
    ids = torch.tensor([prompt])

    def run():
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return tokens / time_it(run, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=80)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    _, _, tokenizer = load_default()
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    rows = [("dspark (K=0, float32)", bench_dspark(prompt, args.tokens, args.repeats)),
            ("transformers generate (float32)", bench_transformers(prompt, args.tokens, args.repeats))]
    lines = [f"Greedy decode, SmolLM2-135M-Instruct GGUF, {args.tokens} new tokens, batch 1, "
             f"median of {args.repeats}; {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores, torch {torch.__version__}",
             "", "| implementation | tokens/s |", "|---|---|"]
    lines += [f"| {name} | {'not installed' if tps is None else f'{tps:.1f}'} |" for name, tps in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
