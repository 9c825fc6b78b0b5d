"""The serving engine under load: continuous batching with and without speculation, in one process.

Closed loop: `concurrency` clients each submit a held-out prompt, wait for the whole completion,
and submit the next, until `--requests` completions are done; the engine (dspark.serve.engine,
no HTTP) runs in its own thread with `concurrency` batch slots. Per configuration: output tokens
per second over the wall time, the mean request latency, and the mean acceptance length (tokens
per step per request). Speculation off (K = 0) and on (the default drafter, K = 7, block
verification) run at each concurrency and temperature, taking turns over `--rounds`.

    python bench/serve.py [--concurrency 1 4] [--requests 8] [--tokens 64] [--rounds 2] [--out table.md]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import threading
import time

import torch

from dspark import SamplingParams, SpeculativeDecoder, load_default
from dspark.data import heldout_prompts, render
from dspark.loading import fast_dtype
from dspark.serve.engine import Engine
from timing import emit_table


def load(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int,
         requests: int) -> tuple[float, list[float], int, int]:
    """Runs the closed loop; returns wall seconds, request latencies, output tokens, decode steps."""
    done, latencies, counts, lock = [0], [], [0, 0], threading.Lock()

    def client(first: int) -> None:
        i = first
        while True:
            with lock:
                if done[0] >= requests:
                    return
                done[0] += 1
            began = time.perf_counter()
            request = engine.submit(prompts[i % len(prompts)], params)
            while request.events.get() is not None:
                pass
            with lock:
                latencies.append(time.perf_counter() - began)
                counts[0] += len(request.result.tokens)
                counts[1] += request.result.num_steps
            i += concurrency

    began = time.perf_counter()
    clients = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    return time.perf_counter() - began, latencies, counts[0], counts[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--requests", type=int, default=8, help="completions per configuration and round")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = fast_dtype(device)
    target, drafter, tokenizer = load_default(dtype=dtype, device=device)
    prompts = render(tokenizer, heldout_prompts())
    decoders = {"off (K = 0)": SpeculativeDecoder(target, None),
                "DSpark K = 7, block": SpeculativeDecoder(target, drafter, num_speculative_tokens=7,
                                                          rejection_sample_method="block")}
    configs = [(c, t, name) for c in args.concurrency for t in (0.0, 1.0) for name in decoders]
    results = {config: [] for config in configs}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for concurrency, temperature, name in configs:
            engine = Engine(decoders[name], max_batch=concurrency, max_model_len=1024)
            thread = threading.Thread(target=engine.run, daemon=True)
            thread.start()
            params = SamplingParams(temperature=temperature, max_tokens=args.tokens, ignore_eos=True)
            measured = load(engine, prompts, params, concurrency, args.requests if round_ else concurrency)
            engine.shutdown()
            thread.join()
            if round_:
                results[(concurrency, temperature, name)].append(measured)
    lines = [f"{datetime.date.today()}, {torch.cuda.get_device_name() if device == 'cuda' else platform.machine() + ' CPU'}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}, {str(dtype).split('.')[-1]}; "
             f"SmolLM2-135M-Instruct, held-out prompts, {args.tokens} new tokens each, {args.requests} "
             f"requests x {args.rounds} rounds per row",
             "", "| concurrency | T | speculation | output tokens/s | mean latency s | tokens/step | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for concurrency in args.concurrency:
        for temperature in (0.0, 1.0):
            rates = {}
            for name in decoders:
                runs = results[(concurrency, temperature, name)]
                rates[name] = sum(r[2] for r in runs) / sum(r[0] for r in runs)
                latency = statistics.mean(x for r in runs for x in r[1])
                per_step = sum(r[2] - args.requests for r in runs) / max(sum(r[3] for r in runs), 1)
                speedup = f"{rates[name] / rates['off (K = 0)']:.2f}x"
                lines.append(f"| {concurrency} | {temperature:g} | {name} | {rates[name]:.1f} | {latency:.2f} "
                             f"| {per_step:.2f} | {speedup} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
