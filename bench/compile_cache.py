"""What the compile cache saves: the seconds a server's first steps spend compiling the decode step,
without a cache and with one from `python -m dspark.compile.warmup`.

Two fresh processes, one after the other, each with an empty Inductor cache directory (so nothing
compiled before helps): the warm-up itself, cold (it compiles every batch-size bucket in each
sampling variant, for each number of drafts a step may verify, and saves the cache), then the same
steps after loading that cache. Same options for both: the default model pair, --max-num-seqs,
--max-model-len, --speculative-config (without num_speculative_tokens the server chooses K per step
among 0, 1, 3 and 7: four graphs where a fixed K has one).

    python -m bench.compile_cache [--max-num-seqs 2] [--max-model-len 256] [--speculative-config JSON]
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.timing import emit_table
from dspark.compile.cache import load_compile_cache
from dspark.compile.options import add_model_args, build_decoder, compiled_step_options, k_choices
from dspark.compile.warmup import TIMING_LINE, serving_runner, timing_line, warm_up


def child(argv: list[str], cache_dir: str) -> str:
    """Runs `python argv` with an empty Inductor cache directory; returns its output."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def cached_steps(args: argparse.Namespace) -> None:
    """The child that loads the cache, then steps as the warm-up does (printing as it prints)."""
    decoder, _ = build_decoder(args, compile=True)
    load_compile_cache(args.load, decoder.device, compiled_step_options(args, decoder))
    for name, batch, seconds in warm_up(serving_runner(args, decoder), k_choices(args, decoder)):
        print(timing_line(name, batch, seconds), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--load", type=Path, default=None, help=argparse.SUPPRESS)  # the cached child
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.load is not None:
        return cached_steps(args)
    options = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
               "--device", args.device, "--dtype", args.dtype]
    if args.speculative_config:
        options += ["--speculative-config", args.speculative_config]
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "cache.bin"
        runs = {}
        for name, argv in (("cold", ["-m", "dspark.compile.warmup", "--compile-cache", str(cache)]),
                           ("from the cache", ["-m", "bench.compile_cache", "--load", str(cache)])):
            began = time.perf_counter()
            output = child(argv + options, tempfile.mkdtemp(dir=folder))
            steps = {(v, int(b)): float(s) for v, b, s in TIMING_LINE.findall(output)}
            runs[name] = (time.perf_counter() - began, steps)
        size = cache.stat().st_size
    keys = list(runs["cold"][1])
    lines = [f"Compile cache: {datetime.date.today()}, {args.device}, torch {torch.__version__}; the default "
             f"pair, --max-num-seqs {args.max_num_seqs}, --max-model-len {args.max_model_len}; cache {size / 1e6:.1f} MB.",
             "", "| variant | batch | cold s | from the cache s |", "|---|---|---|---|"]
    lines += [f"| {v} | {b} | {runs['cold'][1][(v, b)]:.1f} | {runs['from the cache'][1][(v, b)]:.1f} |"
              for v, b in keys]
    lines.append(f"| all steps | | {sum(runs['cold'][1].values()):.0f} | "
                 f"{sum(runs['from the cache'][1].values()):.0f} |")
    lines.append(f"| whole process | | {runs['cold'][0]:.0f} | {runs['from the cache'][0]:.0f} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
