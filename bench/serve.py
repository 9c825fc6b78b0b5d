"""The server under load. Two measurements:

--http: the HTTP server (`python -m dspark.serve`, the default pair, in a process of its own) and
the official `openai` client. A good request's latency alone, then beside `--slow` connections
that send their request heads a byte a second (reconnecting when the server closes them); then
`--clients` concurrent streaming requests, each of which must finish with text; the server's
thread count and resident memory idle and at their highest under each load.

    python -m bench.serve --http [--clients 256] [--slow 300] [--tokens 32] [--max-batch 16] [--out table.md]

Without --http: the serving engine alone, continuous batching with and without speculation, in one process.

Closed loop: `concurrency` clients each submit a held-out prompt, wait for the whole completion,
and submit the next, until max(`--requests`, 2 x concurrency) completions are done; the requests
ask for `--tokens` new tokens on average, each its own number within `--length-spread` of it
(request_lengths: the same for every configuration). Per
configuration: output tokens per second over the wall time, the mean request latency, and the mean
acceptance length (tokens per step per request). Speculation off (K = 0), on at a fixed K (the
default drafter, K = 7, block verification) and on with K chosen per step (dspark.engine.speculation)
run at each concurrency and temperature, taking turns over `--rounds`. Each configuration is one
long-lived engine (dspark.engine, no HTTP; a model pair of its own, max(--concurrency) batch slots)
serving every load in turn, its loop on the main thread as a server's is: the graphs it captures
and per-step K's estimates are kept from the warm-up round on. On CUDA the steps are CUDA graphs of
eager kernels (the server's --no-compile).

    python -m bench.serve [--concurrency 1 4] [--requests 8] [--tokens 64] [--length-spread 0.5] [--rounds 2]
        [--out table.md]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import functools
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time

import torch

from dspark import SamplingParams, SpeculativeDecoder, load_default
from dspark.data import heldout_prompts, render
from dspark.loading import fast_dtype
from dspark.engine import Engine
from dspark.compile.runner import blocks_per_request, default_k_choices
from dspark.kv_cache import KV_BLOCK_SIZE
from bench.clients import serve_clients
from bench.timing import emit_table


LENGTH_SPREAD = 0.5  # requests' new tokens: --tokens x [0.5, 1.5]


def request_lengths(tokens: int, spread: float, count: int) -> list[int]:
    """The new tokens of a load's `count` requests in the order they are sent: uniform over
    tokens x [1 - spread, 1 + spread], from a fixed seed (the same lengths for every configuration).

    Real traffic's lengths differ. With one length for all, requests that gain a token a step (no
    speculation) start and finish together and enter in one batched prefill, in lockstep, which the
    requests of a speculative configuration, gaining 1 to K + 1 tokens a step, soon leave (vLLM's
    serving benchmark varies its random lengths the same way, --random-range-ratio)."""
    rng = random.Random(0)
    low, high = max(1, round(tokens * (1 - spread))), max(1, round(tokens * (1 + spread)))
    return [rng.randint(low, high) for _ in range(count)]


def load(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int,
         lengths: list[int]) -> tuple[float, list[float], int, int]:
    """Runs the closed loop of len(lengths) requests, the i-th sent asking for lengths[i] new tokens
    (the engine's loop on this thread, bench.clients); returns wall seconds, request latencies,
    output tokens, decode steps."""
    done, latencies, counts, lock = [0], [], [0, 0], threading.Lock()

    def client(first: int) -> None:
        i = first
        while True:
            with lock:
                if done[0] >= len(lengths):
                    return
                length = lengths[done[0]]
                done[0] += 1
            began = time.perf_counter()
            request = engine.submit(prompts[i % len(prompts)], dataclasses.replace(params, max_tokens=length))
            while request.events.get() is not None:
                pass
            with lock:
                latencies.append(time.perf_counter() - began)
                counts[0] += len(request.result.tokens)
                counts[1] += request.result.num_steps
            i += concurrency

    began = time.perf_counter()
    serve_clients(engine, [functools.partial(client, c) for c in range(concurrency)])
    return time.perf_counter() - began, latencies, counts[0], counts[1]


MAX_MODEL_LEN = 1024
OFF, FIXED, PER_STEP = "off (K = 0)", "DSpark K = 7, block", "DSpark per-step K, block"
CONFIGURATIONS = (OFF, FIXED, PER_STEP)


def completions(args, concurrency: int) -> int:
    """Completions per configuration and round: --requests, and at least two per client."""
    return max(args.requests, 2 * concurrency)


def serving_engine(name: str, device: str, dtype: torch.dtype, max_batch: int) -> Engine:
    """A long-lived engine of one configuration on a model pair of its own (an engine sets up the
    caches of its models)."""
    target, drafter, tokenizer = load_default(dtype=dtype, device=device)
    decoder = (SpeculativeDecoder(target, None, tokenizer=tokenizer) if name == OFF else
               SpeculativeDecoder(target, drafter, num_speculative_tokens=7, rejection_sample_method="block",
                                  tokenizer=tokenizer))
    num_blocks = 1 + max_batch * blocks_per_request(MAX_MODEL_LEN, decoder.k, KV_BLOCK_SIZE)
    return Engine(decoder, max_batch=max_batch, max_model_len=MAX_MODEL_LEN, num_blocks=num_blocks,
                  k_choices=default_k_choices(7) if name == PER_STEP else None)


def engine_load(args) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = fast_dtype(device)
    engines = {name: serving_engine(name, device, dtype, max(args.concurrency)) for name in CONFIGURATIONS}
    prompts = render(engines[OFF].decoder.tokenizer, heldout_prompts())
    configs = [(c, t, name) for c in args.concurrency for t in (0.0, 1.0) for name in CONFIGURATIONS]
    results = {config: [] for config in configs}
    for round_ in range(args.rounds + 1):  # round 0 warms up (captures the graphs the loads meet)
        for concurrency, temperature, name in configs:
            params = SamplingParams(temperature=temperature, ignore_eos=True)
            count = completions(args, concurrency) if round_ else concurrency
            measured = load(engines[name], prompts, params, concurrency,
                            request_lengths(args.tokens, args.length_spread, count))
            if round_:
                results[(concurrency, temperature, name)].append(measured)
    lines = [f"{datetime.date.today()}, {torch.cuda.get_device_name() if device == 'cuda' else platform.machine() + ' CPU'}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}, {str(dtype).split('.')[-1]}; "
             f"SmolLM2-135M-Instruct, held-out prompts, {args.tokens} new tokens each on average (spread "
             f"{args.length_spread:g}), max({args.requests}, 2 x "
             f"concurrency) requests x {args.rounds} rounds per row"
             f"{', CUDA graphs of eager kernels (--no-compile)' if device == 'cuda' else ''}",
             "", "| concurrency | T | speculation | output tokens/s | mean latency s | tokens/step | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for concurrency in args.concurrency:
        for temperature in (0.0, 1.0):
            rates = {}
            for name in CONFIGURATIONS:
                runs = results[(concurrency, temperature, name)]
                rates[name] = sum(r[2] for r in runs) / sum(r[0] for r in runs)
                latency = statistics.mean(x for r in runs for x in r[1])
                per_step = sum(r[2] - completions(args, concurrency) for r in runs) / max(sum(r[3] for r in runs), 1)
                speedup = f"{rates[name] / rates[OFF]:.2f}x"
                lines.append(f"| {concurrency} | {temperature:g} | {name} | {rates[name]:.1f} | {latency:.2f} "
                             f"| {per_step:.2f} | {speedup} |")
    emit_table(lines, args.out)


# ---------------------------------------------------------------------------- the HTTP server


def process_stats(pid: int) -> tuple[int, float]:
    """(threads, resident MB) of process `pid`."""
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"Threads:\s+(\d+)", status)[1]), int(re.search(r"VmRSS:\s+(\d+)", status)[1]) / 1024


def start_server(max_batch: int, *options: str) -> tuple[subprocess.Popen, str]:
    """`python -m dspark.serve` on a free port with these options -> (process, base URL), once it serves."""
    process = subprocess.Popen([sys.executable, "-m", "dspark.serve", "--port", "0", "--max-batch", str(max_batch),
                                "--disable-access-log", "--disable-log-stats", *options],
                               stderr=subprocess.PIPE, text=True)
    log = []
    for line in process.stderr:
        log.append(line)
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()  # drain its log
            return process, found[1]
    raise SystemExit("the server did not start:\n" + "".join(log[-20:]))


def openai_client(url: str, clients: int):
    """The official openai client of the server at `url`, with connections for `clients` at once."""
    import httpx2
    import openai

    limits = httpx2.Limits(max_connections=clients + 16, max_keepalive_connections=clients + 16)
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=3600,
                              http_client=openai.DefaultAsyncHttpx2Client(limits=limits))


class Peak:
    """The highest thread count and resident memory of a process, sampled every 0.2 s while running."""

    def __init__(self, pid: int):
        self.pid, self.threads, self.rss = pid, 0, 0.0

    async def sample(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            threads, rss = process_stats(self.pid)
            self.threads, self.rss = max(self.threads, threads), max(self.rss, rss)
            await asyncio.sleep(0.2)


async def slow_connection(port: int, stop: asyncio.Event) -> None:
    """Sends a request head a byte a second, on a new connection whenever the server closes one."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    while not stop.is_set():
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for byte in head:
                if stop.is_set():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1.0)
        except ConnectionError:  # the server closed it: its head deadline
            pass
        writer.close()


async def http_load(args) -> list[str]:
    process, url = start_server(args.max_batch)
    port = int(url.rsplit(":", 1)[1])
    client = openai_client(url, args.clients)
    prompts = [p.text for p in heldout_prompts()]

    async def good_request() -> float:
        began = time.perf_counter()
        await client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                        max_tokens=args.tokens, temperature=0, extra_body={"ignore_eos": True})
        return time.perf_counter() - began

    async def stream(i: int) -> tuple[bool, float, int]:
        """(finished with text, seconds to the first text, tokens) of one streamed chat."""
        began, first, text, finish, tokens = time.perf_counter(), None, "", None, 0
        chunks = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            max_tokens=args.tokens, temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True})
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - began
                text += chunk.choices[0].delta.content
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return bool(text) and finish is not None, first or float("nan"), tokens

    try:
        await good_request()  # warm-up
        idle = process_stats(process.pid)
        alone = statistics.median([await good_request() for _ in range(5)])
        stop, peak = asyncio.Event(), Peak(process.pid)
        background = [asyncio.create_task(slow_connection(port, stop)) for _ in range(args.slow)]
        background.append(asyncio.create_task(peak.sample(stop)))
        await asyncio.sleep(3)  # all of them connected and trickling
        beside_slow = statistics.median([await good_request() for _ in range(5)])
        stop.set()
        await asyncio.gather(*background)
        slow_peak = peak
        stop, peak = asyncio.Event(), Peak(process.pid)
        sampler = asyncio.create_task(peak.sample(stop))
        began = time.perf_counter()
        results = await asyncio.gather(*[stream(i) for i in range(args.clients)])
        wall = time.perf_counter() - began
        stop.set()
        await sampler
    finally:
        process.terminate()
        code = process.wait(60)
    first = sorted(r[1] for r in results)
    tokens = sum(r[2] for r in results)
    return [f"{datetime.date.today()}, {platform.machine()} CPU ({os.cpu_count()} cores), torch {torch.__version__}; "
            f"python -m dspark.serve --max-batch {args.max_batch} (the default pair), the official openai client; "
            f"{args.tokens} new tokens a request; the server exited {code} on SIGTERM",
            "", "| load | result | server threads | server RSS MB |", "|---|---|---|---|",
            f"| idle | - | {idle[0]} | {idle[1]:.0f} |",
            f"| a good request alone | {alone:.2f} s (median of 5) | - | - |",
            f"| beside {args.slow} slow connections (a byte a second) | {beside_slow:.2f} s, "
            f"{beside_slow / alone:.2f}x alone | {slow_peak.threads} | {slow_peak.rss:.0f} |",
            f"| {args.clients} concurrent streams | {sum(r[0] for r in results)} of {args.clients} finished with "
            f"text in {wall:.0f} s; {tokens / wall:.1f} tokens/s; first text p50 {first[len(first) // 2]:.1f} s, "
            f"max {first[-1]:.1f} s | {peak.threads} | {peak.rss:.0f} |"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--http", action="store_true", help="the HTTP server's load test (else the engine alone)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--requests", type=int, default=8,
                   help="completions per configuration and round (at least two per client)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per request (default: 64, --http 32)")
    p.add_argument("--length-spread", type=float, default=LENGTH_SPREAD,
                   help="requests' new tokens within this fraction of --tokens (0: all alike)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=256, help="--http: concurrent streaming clients")
    p.add_argument("--slow", type=int, default=300, help="--http: slow connections")
    p.add_argument("--max-batch", type=int, default=16, help="--http: the server's batch slots")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.http:
        args.tokens = args.tokens or 32
        emit_table(asyncio.run(http_load(args)), args.out)
    else:
        args.tokens = args.tokens or 64
        engine_load(args)


if __name__ == "__main__":
    main()
