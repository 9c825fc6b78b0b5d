"""The default pair through the HTTP server under closed-loop load: output tokens per second at each
concurrency and temperature with speculation off, at a fixed K = 7, and with K chosen per step (the
server's default), block verification.

One `python -m dspark.serve` process per configuration (its --speculative-config), serving every
load in turn after a warm-up load at each concurrency. `concurrency` clients (the official openai
client, streaming chat completions of the held-out prompts, ignore_eos, `--tokens` new tokens each
on average, spread as bench.serve's request_lengths spreads them) each send the next request when
their last one is done, until max(--requests, 2 x concurrency) are done. Per row: output tokens per
second over the wall time (the usage the server reports), the mean latency and the mean time to the
first text.

    python -m bench.serve_http [--concurrency 1 8 32 64] [--requests 8] [--tokens 256] [--length-spread 0.5] \\
        [--speculation off fixed per-step] [--server-args="--no-compile"] [--out table.md]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import shlex
import statistics
import time

import torch

from bench.serve import (LENGTH_SPREAD, OFF, FIXED, PER_STEP, completions, openai_client, request_lengths,
                         start_server)
from bench.timing import emit_table
from dspark.data import heldout_prompts

SPECULATIVE_CONFIGS = {OFF: {"num_speculative_tokens": 0},
                       FIXED: {"num_speculative_tokens": 7, "rejection_sample_method": "block"},
                       PER_STEP: {"rejection_sample_method": "block"}}
SPECULATION = {"off": OFF, "fixed": FIXED, "per-step": PER_STEP}  # --speculation's names
MODEL = "SmolLM2-135M-Instruct"


async def closed_loop(client, prompts: list[str], concurrency: int, temperature: float,
                      lengths: list[int]) -> tuple[float, list[float], list[float], int]:
    """`concurrency` clients streaming len(lengths) completions in all, the i-th sent asking for
    lengths[i] new tokens -> (wall s, latencies, times to the first text, output tokens)."""
    issued, latencies, firsts, produced = [0], [], [], [0]
    count = len(lengths)

    async def one(i: int) -> None:
        began, first = time.perf_counter(), None
        chunks = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompts[i % len(prompts)]}], max_tokens=lengths[i],
            temperature=temperature, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - began
            if chunk.usage:
                produced[0] += chunk.usage.completion_tokens
        latencies.append(time.perf_counter() - began)
        firsts.append(first if first is not None else float("nan"))

    async def client_loop() -> None:
        while issued[0] < count:
            issued[0] += 1
            await one(issued[0] - 1)

    began = time.perf_counter()
    await asyncio.gather(*[client_loop() for _ in range(concurrency)])
    return time.perf_counter() - began, latencies, firsts, produced[0]


async def measure(args) -> list[str]:
    prompts = [p.text for p in heldout_prompts()]
    cells = [(c, t) for c in args.concurrency for t in (0.0, 1.0)]
    results = {}
    names = [SPECULATION[choice] for choice in args.speculation]
    for name in names:
        config = SPECULATIVE_CONFIGS[name]
        process, url = start_server(max(args.concurrency), "--speculative-config", json.dumps(config),
                                    *shlex.split(args.server_args))
        client = openai_client(url, max(args.concurrency))
        try:
            for concurrency, temperature in cells:  # warm-up: graphs, compilation, per-step K's first estimates
                await closed_loop(client, prompts, concurrency, temperature,
                                  request_lengths(args.tokens, args.length_spread, concurrency))
            for concurrency, temperature in cells:
                lengths = request_lengths(args.tokens, args.length_spread, completions(args, concurrency))
                results[concurrency, temperature, name] = result = await closed_loop(
                    client, prompts, concurrency, temperature, lengths)
                print(f"{name}, concurrency {concurrency}, T = {temperature:g}: "
                      f"{result[3] / result[0]:.1f} tokens/s", flush=True)  # a run cut short keeps its cells
        finally:
            process.terminate()
            process.wait(60)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine() + " CPU"
    lines = [f"{datetime.date.today()}, {device}, torch {torch.__version__}; python -m dspark.serve "
             f"{args.server_args} (the default pair), the official openai client streaming chat completions "
             f"of held-out prompts, {args.tokens} new tokens each on average (spread {args.length_spread:g}), "
             f"max({args.requests}, 2 x concurrency) "
             f"requests per row", "",
             "| concurrency | T | speculation | output tokens/s | mean latency s | mean first text s | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for concurrency, temperature in cells:
        rates = {}
        for name in names:
            wall, latencies, firsts, produced = results[concurrency, temperature, name]
            rates[name] = produced / wall
            speed_up = f"{rates[name] / rates[OFF]:.2f}x" if OFF in rates else "-"
            lines.append(f"| {concurrency} | {temperature:g} | {name} | {rates[name]:.1f} | "
                         f"{statistics.mean(latencies):.2f} | {statistics.mean(firsts):.2f} | {speed_up} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--requests", type=int, default=8, help="completions per row (at least two per client)")
    p.add_argument("--tokens", type=int, default=256, help="new tokens per request, on average")
    p.add_argument("--length-spread", type=float, default=LENGTH_SPREAD,
                   help="requests' new tokens within this fraction of --tokens (0: all alike)")
    p.add_argument("--server-args", default="", help="more options for the servers, one string")
    p.add_argument("--speculation", nargs="+", default=list(SPECULATION), choices=list(SPECULATION),
                   help="the servers to run, one after another")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    emit_table(asyncio.run(measure(args)), args.out)


if __name__ == "__main__":
    main()
