"""Acceptance of DSpark drafters for the default target on the held-out prompts.

    python -m dspark.eval --drafter runs/smollm2/drafter runs/smollm2/drafter-rank0 --out eval.md

For every drafter, temperature and verification method, the held-out prompts are decoded with
K drafts per step and the decoder's counters are summed over the prompts:
- acceptance at position k = (steps whose draft k was accepted) / steps;
- AL (acceptance length, the bonus token included) = 1 + accepted drafts / steps = 1 + sum_k acceptance_k;
  on a request's last step a stop (EOS, max_tokens) cuts the block, and only the accepted drafts up
  to the stop count: so AL reads below the verifier's own count (vLLM's metric, which keeps drafts
  accepted past a stop) and above tokens per step, by at most K and 1 tokens per request;
- AL per prompt domain (chat, code, math, prose).
`--top-p` samples from the target's top-p nucleus at T > 0 (the drafts stay temperature-only; the
verification is exact against the filtered law), the common benchmark setting T = 1, top-p 0.95.
Prints a markdown table and writes it to --out. `--prompts train` decodes training prompts instead
(those of a run with seed 0, as every shipped run; not the prompts the target wrote, nor those over
the run's --max-prompt-tokens): against the held-out table it shows how much a drafter learned its
training sequences by heart (at T = 0 it meets the very greedy responses it was trained on).
"""
from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.checkpoint import load_drafter
from dspark.data import DOMAINS, Prompt, heldout_prompts, render, training_prompts
from dspark.decoder import VERIFY_METHODS, SpeculativeDecoder
from dspark.drafter import DSparkDrafter
from dspark.engine import generate
from dspark.loading import DTYPES, device_arg, load_default, load_default_target, measuring_dtype
from dspark.output import GenerationResult
from dspark.sampling import SamplingParams
from dspark.target import TargetModel
from dspark.tokenizer import Tokenizer


@dataclass
class Acceptance:
    """Decoder counters summed over requests."""
    accepted: list[int]  # [K] steps whose draft k was accepted
    steps: int
    tokens: int

    def __add__(self, other: Acceptance) -> Acceptance:
        return Acceptance([a + b for a, b in zip(self.accepted, other.accepted)], self.steps + other.steps,
                          self.tokens + other.tokens)

    @property
    def per_position(self) -> list[float]:
        return [a / max(self.steps, 1) for a in self.accepted]

    @property
    def acceptance_length(self) -> float:
        return 1 + sum(self.accepted) / max(self.steps, 1)


@dataclass
class Row:
    drafter: str
    temperature: float
    top_p: float
    method: str
    total: Acceptance
    by_domain: dict[str, Acceptance]


def measure(decoder: SpeculativeDecoder, prompts: list[list[int]], params: list[SamplingParams],
            batch_size: int) -> list[Acceptance]:
    """Decodes the prompts in batches; returns each prompt's counters."""
    results = []
    for begin in range(0, len(prompts), batch_size):
        results += generate(decoder, prompts[begin:begin + batch_size], params[begin:begin + batch_size])
    return acceptances(results)


def acceptances(results: list[GenerationResult]) -> list[Acceptance]:
    """Each decoded request's counters."""
    return [Acceptance(list(r.accepted_per_position), r.num_steps, len(r.tokens)) for r in results]


def evaluate(target: TargetModel, drafters: dict[str, DSparkDrafter], prompts: list[Prompt], tokenizer, *,
             temperatures=(0.0, 1.0), methods=VERIFY_METHODS, num_speculative_tokens: int = 7,
             max_tokens: int = 128, batch_size: int = 80, seed: int = 0, top_p: float = 1.0) -> list[Row]:
    """One row per (drafter, temperature, method). Prompt i is decoded with seed `seed + i`, at top-p
    `top_p` (1: off)."""
    ids = render(tokenizer, prompts)
    rows = []
    runs = list(itertools.product(drafters.items(), temperatures, methods))
    for (name, drafter), temperature, method in tqdm(runs, desc="eval", dynamic_ncols=True):
        params = [SamplingParams(temperature=temperature, top_p=top_p, seed=seed + i, max_tokens=max_tokens,
                                 stop_token_ids=tokenizer.eos_token_ids) for i in range(len(ids))]
        decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=num_speculative_tokens,
                                     rejection_sample_method=method)
        counts = measure(decoder, ids, params, batch_size)
        empty = Acceptance([0] * num_speculative_tokens, 0, 0)
        by_domain = {d: sum((c for c, p in zip(counts, prompts) if p.domain == d), empty) for d in DOMAINS}
        rows.append(Row(name, temperature, top_p, method, sum(counts, empty), by_domain))
    return rows


def markdown_table(rows: list[Row]) -> str:
    k = len(rows[0].total.accepted)
    header = ["drafter", "T", "verify", "AL", *(f"AL {d}" for d in DOMAINS), *(f"acc@{i + 1}" for i in range(k)),
              "steps", "tokens"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        sampling = f"{r.temperature:g}" + (f", top-p {r.top_p:g}" if r.top_p < 1 and r.temperature > 0 else "")
        cells = [r.drafter, sampling, r.method, f"{r.total.acceptance_length:.3f}",
                 *(f"{r.by_domain[d].acceptance_length:.2f}" if r.by_domain[d].steps else "-" for d in DOMAINS),
                 *(f"{a:.3f}" for a in r.total.per_position), str(r.total.steps), str(r.total.tokens)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def drafter_labels(paths: list[Path]) -> list[str]:
    """The table's name of each drafter folder: its own name, or the path as given where two folders
    share a name (run/drafter and assets/drafter)."""
    if len(set(paths)) < len(paths):
        raise ValueError(f"a drafter folder is given twice: {[str(p) for p in paths]}")
    names = [path.name for path in paths]
    return [name if names.count(name) == 1 else str(path) for name, path in zip(names, paths)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", nargs="+", type=Path, default=None,
                   help="DeepSpec-format drafter folders (default: the drafter shipped with the default model)")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--methods", nargs="+", choices=VERIFY_METHODS, default=list(VERIFY_METHODS))
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=7)
    p.add_argument("--prompts", choices=("heldout", "train"), default="heldout",
                   help="the held-out prompts, or training prompts (to compare: how much of the acceptance "
                        "on seen prompts carries over to unseen ones)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="the first N prompts (held-out: they alternate between domains; default all 80; "
                        "train: in the training set's shuffled order, default 80)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=80, help="prompts decoded together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0, help="the target's nucleus at T > 0 (default 1: off)")
    p.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights and activations (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    for name, value, least in (("--batch-size", args.batch_size, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--num-prompts", args.num_prompts, 1), ("-k", args.num_speculative_tokens, 0),
                               ("--seed", args.seed, 0)):
        if value is not None and value < least:
            p.error(f"{name} must be >= {least}, got {value}")
    bad = [t for t in args.temperatures if not (math.isfinite(t) and t >= 0)]
    if bad:
        p.error(f"--temperatures must be finite and >= 0, got {bad}")
    try:  # the sampler's own rule for top-p
        SamplingParams(top_p=args.top_p)
    except ValueError as error:
        p.error(f"--top-p: {error}")
    return args


def load_drafters(paths: list[Path] | None, dtype: torch.dtype, device: str | torch.device = "cpu",
                  default_label: str = "default") -> tuple[TargetModel, dict[str, DSparkDrafter], Tokenizer]:
    """(target, {label: drafter}, tokenizer): the default target with the drafter folders given, or
    with the shipped drafter (as `default_label`) when there are none."""
    if not paths:
        target, drafter, tokenizer = load_default(dtype=dtype, device=device)
        return target, {default_label: drafter}, tokenizer
    labels = drafter_labels(paths)  # before the load: a folder given twice fails at once
    target, tokenizer = load_default_target(dtype=dtype, device=device)
    return target, {label: load_drafter(path, target) for label, path in zip(labels, paths)}, tokenizer


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.prompts == "heldout":
        prompts = heldout_prompts()[:args.num_prompts]
    else:
        prompts = training_prompts(80 if args.num_prompts is None else args.num_prompts)
    if args.num_prompts is not None and len(prompts) < args.num_prompts:
        raise SystemExit(f"python -m dspark.eval: --num-prompts {args.num_prompts}: the {args.prompts} set has "
                         f"{len(prompts)} prompts")
    dtype = DTYPES[args.dtype] if args.dtype else measuring_dtype(args.device)
    target, drafters, tokenizer = load_drafters(args.drafter, dtype, args.device)
    rows = evaluate(target, drafters, prompts, tokenizer, temperatures=args.temperatures, methods=args.methods,
                    num_speculative_tokens=args.num_speculative_tokens, max_tokens=args.max_tokens,
                    batch_size=args.batch_size, seed=args.seed, top_p=args.top_p)
    table = markdown_table(rows)
    print(table)
    if args.out is not None:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
