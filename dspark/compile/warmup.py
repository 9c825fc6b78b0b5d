"""python -m dspark.compile.warmup: compiles the server's decode step ahead of time, into a compile
cache that `python -m dspark.serve --compile-cache FILE` loads when it starts.

    python -m dspark.compile.warmup --compile-cache dspark-cache.bin      # the default server's step
    python -m dspark.serve --compile-cache dspark-cache.bin
    python -m dspark.compile.warmup --compile-cache c.bin --max-num-seqs 16 \\
        --speculative-config '{"num_speculative_tokens": 5, "rejection_sample_method": "block"}'

It builds the decoder and the static batch from the same options as the server (dspark.compile.options),
then steps every batch-size bucket in each sampling variant a server meets (every row greedy;
sampled; sampled with a top-p filter) at each number of drafts a step may verify, which compiles
every graph the server's steps need, and saves
what Inductor compiled. Give it the options the server will get: the compiled code is specialized to
the models, K, the batch buckets, --max-model-len and the KV cache's shape (its blocks: on CUDA they
follow the free memory, so give both --num-gpu-blocks-override for a cache that fits). A cache is for
the torch, triton and device it was made with.
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch

from dspark.compile.cache import save_compile_cache
from dspark.compile.options import add_model_args, build_decoder, compiled_step_options, k_choices
from dspark.compile.runner import StepRunner, blocks_per_request
from dspark.kv_cache import kv_cache_blocks
from dspark.sampling import SamplingParams

VARIANTS = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=1.0),
            "top-p": SamplingParams(temperature=1.0, top_p=0.9)}


def timing_line(variant: str, batch: int, seconds: float) -> str:
    """How the warm-up reports one (variant, bucket); TIMING_LINE reads it back."""
    return f"{variant:>8} batch {batch:>3}: {seconds:7.1f} s"


TIMING_LINE = re.compile(r"^\s*(\S+) batch\s+(\d+):\s+([\d.]+) s", re.M)


def serving_runner(args: argparse.Namespace, decoder) -> StepRunner:
    """The static batch a server of these options runs (the Engine's: its slots, its KV cache's blocks)."""
    num_blocks = args.num_gpu_blocks_override or kv_cache_blocks(
        decoder.target, decoder.drafter, args.block_size, args.gpu_memory_utilization, args.kv_cache_memory)
    return StepRunner(decoder, args.max_num_seqs, blocks_per_request(args.max_model_len, decoder.k, args.block_size),
                      num_blocks, args.block_size)


@torch.inference_mode()
def warm_up(runner: StepRunner, ks: list[int] | None = None) -> list[tuple[str, int, float]]:
    """Steps every (variant, bucket) once for each number of drafts a step may verify (`ks`,
    default the decoder's K) -> (variant, bucket, seconds) of each, compilation included."""
    timings = []
    for name, params in VARIANTS.items():
        runner.set_params([params] * runner.max_batch)
        for batch in runner.buckets:
            began = time.perf_counter()
            if runner.decoder.drafter is not None:
                runner.draft(range(batch))
            for k in ks or [runner.decoder.k]:
                runner.step(batch, k)
            if runner.tokens.device.type == "cuda":
                torch.cuda.synchronize()
            timings.append((name, batch, time.perf_counter() - began))
    return timings


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m dspark.compile.warmup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-cache", type=Path, required=True, help="the file to write")
    add_model_args(p)
    args = p.parse_args(argv)
    try:
        decoder, _ = build_decoder(args, compile=True)
    except (OSError, ValueError) as error:
        raise SystemExit(f"python -m dspark.compile.warmup: {error}") from None
    runner = serving_runner(args, decoder)
    began = time.perf_counter()
    for name, batch, seconds in warm_up(runner, k_choices(args, decoder)):
        print(timing_line(name, batch, seconds), flush=True)
    size = save_compile_cache(args.compile_cache, decoder.device, compiled_step_options(args, decoder))
    print(f"compiled in {time.perf_counter() - began:.0f} s; {args.compile_cache}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
