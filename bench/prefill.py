"""The prefill with and without cuDNN's attention, in one process: seconds per
`SpeculativeDecoder.prefill_prompts` of a batch of prompts of many lengths (what self-distillation and
`python -m dspark.eval` prefill), and of single prompts of new lengths (what a server admits).

`prefill_prompts` groups the prompts by length, one target forward per group, so every length and
group size is an attention shape of its own. dspark's prefill keeps cuDNN's attention out
(`dspark.decoder.PREFILL_ATTENTION`); the baseline lets torch choose among all its backends. Each
round draws new prompts (new shapes, as every new batch does) and is timed with a device
synchronisation at both ends; the variants take turns. A target of SmolLM2-135M's shapes with
random bfloat16 weights (speed does not depend on the weights).

    python -m bench.prefill [--batch 2048] [--lengths 60 100] [--rounds 3] [--out table.md]
    python -m bench.prefill --profile       # and the kernels each variant's batch prefill runs
    python -m bench.prefill --smoke         # CPU, a tiny target: checks that it runs
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from torch.nn.attention import SDPBackend

from bench.models import SMOKE, SMOLLM2
from bench.timing import emit_table, print_profile
import dspark.decoder
from dspark import SamplingParams, SpeculativeDecoder, TargetModel
from dspark.kv_cache import KV_BLOCK_SIZE, contiguous_block_table
from dspark.loading import measuring_dtype
from dspark.sampling import SamplingTensors

VARIANTS = {"torch's choice (cuDNN allowed)": [*dspark.decoder.PREFILL_ATTENTION, SDPBackend.CUDNN_ATTENTION],
            "without cuDNN (dspark)": dspark.decoder.PREFILL_ATTENTION}


def draw_prompts(count: int, lengths: tuple[int, int], vocab: int, generator: torch.Generator) -> list[list[int]]:
    """`count` prompts of random tokens, lengths uniform in [lengths[0], lengths[1]], shortest first."""
    sizes = sorted(torch.randint(lengths[0], lengths[1] + 1, (count,), generator=generator).tolist())
    return [torch.randint(vocab, (n,), generator=generator).tolist() for n in sizes]


def prefill_seconds(decoder: SpeculativeDecoder, prompts: list[list[int]]) -> float:
    """Wall seconds of one prefill of `prompts`, each into blocks of its own."""
    device = decoder.device
    sampling = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(len(prompts))],
                                           device)
    _, block_table = contiguous_block_table([len(p) for p in prompts])
    block_table = block_table.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    decoder.prefill_prompts(prompts, block_table, sampling)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2048, help="prompts per batch prefill (self-distillation's batch)")
    p.add_argument("--lengths", type=int, nargs=2, default=[60, 100], help="prompt lengths, shortest and longest")
    p.add_argument("--single", type=int, default=20, help="single-prompt prefills per round, each a new length")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        device, config = torch.device("cpu"), SMOKE
        args.batch, args.lengths, args.single, args.rounds = 16, [4, 12], 3, 1
    else:
        device, config = torch.device("cuda"), SMOLLM2
    torch.manual_seed(0)
    target = TargetModel(config).to(device, measuring_dtype(device)).eval()
    num_blocks, _ = contiguous_block_table([args.lengths[1] + args.single + 1] * args.batch)
    target.setup_caches(num_blocks, KV_BLOCK_SIZE)
    decoder = SpeculativeDecoder(target, None)
    generator = torch.Generator().manual_seed(0)
    prefill_seconds(decoder, draw_prompts(8, args.lengths, config.vocab_size, generator))  # one-time costs
    batch_s = {name: [] for name in VARIANTS}
    single_s = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, backends in VARIANTS.items():
            dspark.decoder.PREFILL_ATTENTION = backends
            batch_s[name].append(prefill_seconds(decoder, draw_prompts(args.batch, args.lengths, config.vocab_size,
                                                                       generator)))
            first = int(torch.randint(args.lengths[0], args.lengths[1] + 1, (), generator=generator))
            single_s[name] += [prefill_seconds(decoder, draw_prompts(1, (n, n), config.vocab_size, generator))
                               for n in range(first, first + args.single)]
    if args.profile:
        for name, backends in VARIANTS.items():
            dspark.decoder.PREFILL_ATTENTION = backends
            prompts = draw_prompts(args.batch, args.lengths, config.vocab_size, generator)
            print(f"\n{name}:")
            print_profile([lambda: prefill_seconds(decoder, prompts)], device, unit="batch prefill")

    tokens = args.batch * sum(args.lengths) / 2
    lines = [f"prefill, {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
             f"torch {torch.__version__}, {datetime.date.today()}: {args.rounds} rounds, a batch of {args.batch} "
             f"prompts of {args.lengths[0]}-{args.lengths[1]} tokens and {args.single} single prompts per round",
             "",
             "| attention | batch prefill, s (median) | prompt tokens / s | single prompt, ms (median) | single, slowest ms |",
             "|---|---|---|---|---|"]
    for name in VARIANTS:
        seconds = statistics.median(batch_s[name])
        lines.append(f"| {name} | {seconds:.3f} | {tokens / seconds:,.0f} | "
                     f"{1e3 * statistics.median(single_s[name]):.1f} | {1e3 * max(single_s[name]):.1f} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
