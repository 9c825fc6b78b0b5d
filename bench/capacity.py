"""The KV cache's capacity at the server's default --gpu-memory-utilization (0.9): tokens and
requests of --max-model-len it holds at once, for the default pair and for Llama-3-8B's shapes
(random weights, a random 5-layer drafter), beside what the dense per-slot caches it replaced
needed for --max-num-seqs full-length slots.

    python -m bench.capacity [--max-model-len 8192] [--max-num-seqs 256] [--out table.md]
    python -m bench.capacity --smoke         # CPU, --kv-cache-memory 1: checks that it runs
"""
from __future__ import annotations

import argparse
import datetime

import torch

from bench.engine_step import make_drafter
from bench.models import LLAMA3_8B, random_target
from bench.timing import emit_table
from dspark import SpeculativeDecoder, load_default
from dspark.engine import Engine
from dspark.kv_cache import kv_block_bytes
from dspark.loading import fast_dtype


def pair(name: str, device: torch.device, dtype: torch.dtype):
    if name == "default pair":
        target, drafter, _ = load_default(dtype=dtype, device=device)
        return target, drafter
    target = random_target(LLAMA3_8B, device, dtype)
    return target, make_drafter("llama3-8b", target)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = fast_dtype(device)
    names = ["default pair"] if args.smoke else ["default pair", "llama3-8b"]
    lines = [f"{datetime.date.today()}, {'CPU' if args.smoke else torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, {str(dtype).split('.')[-1]}; --gpu-memory-utilization 0.9, --max-model-len "
             f"{args.max_model_len}, --max-num-seqs {args.max_num_seqs}, K = 7", "",
             "| models | KV bytes per token | KV cache, tokens | full-length requests at once | dense slots' need, GB |",
             "|---|---|---|---|---|"]
    for name in names:
        target, drafter = pair(name, device, dtype)
        decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=7)
        engine = Engine(decoder, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        kv_cache_memory=1.0 if args.smoke else None)
        per_token = sum(kv_block_bytes(m.config, 1, dtype) for m in (target, drafter))
        dense = per_token * args.max_num_seqs * (args.max_model_len + 9) / 1e9
        lines.append(f"| {name} | {per_token:,} | {engine.capacity:,} | {engine.full_length_requests} | {dense:,.1f} |")
        del engine, decoder, target, drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
