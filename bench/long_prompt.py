"""A long prompt arriving while others decode, with chunked prefill and without, in one process: the
inter-token gaps of the running streams and the long prompt's time to its first token.

The default pair serves `--streams` greedy streams (held-out prompts, one event of tokens per engine
step). Once every stream has produced tokens for a while, a `--long`-token prompt arrives. With
chunked prefill (--max-num-batched-tokens, the engine's default on this device) it enters a chunk
per step between the streams' decode steps; without (a budget that holds the whole prompt) it enters
in one step, during which no stream gets a token. Per configuration: the streams' median gap before
the prompt arrives, their median and largest gap while it enters, and its time to first token.

    python -m bench.long_prompt [--streams 4] [--long 8000] [--chunks 64 256] [--out table.md]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import threading
import time

import torch

from bench.clients import serve_clients
from bench.models import default_pair_decoder
from bench.timing import emit_table
from dspark import SamplingParams, SpeculativeDecoder
from dspark.data import heldout_prompts, render
from dspark.engine import Engine


class Timestamps:
    """An events sink (Engine.submit's `events`) that records when each event arrives."""

    def __init__(self):
        self.times: list[float] = []
        self.done = threading.Event()

    def put(self, item) -> None:
        if isinstance(item, list):
            self.times.append(time.perf_counter())
        else:  # None at the end, or an exception
            self.done.set()


def gaps(times: list[float], begin: float, end: float) -> list[float]:
    """Seconds between consecutive events, of the gaps that end in [begin, end] and the first one
    that ends after it (the stall a prompt entering at once causes ends only after its first token)."""
    ending = [(a, b) for a, b in zip(times, times[1:]) if begin <= b]
    inside = [b - a for a, b in ending if b <= end]
    after = [b - a for a, b in ending if b > end][:1]
    return inside + after


def measure(decoder: SpeculativeDecoder, prompts: list[list[int]], long_prompt: list[int], budget: int,
            streams: int, warm_events: int) -> tuple[float, float, float, float]:
    """-> the streams' median gap before, median and largest gap while the long prompt enters, its TTFT."""
    engine = Engine(decoder, max_num_seqs=streams + 1, max_model_len=len(long_prompt) + 16,
                    max_num_batched_tokens=budget, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=len(long_prompt) - max(map(len, prompts)), ignore_eos=True)
    sinks = [Timestamps() for _ in range(streams)]
    arrived, long_sink = [], Timestamps()

    def scenario() -> None:  # the engine's loop runs on the main thread meanwhile (bench.clients)
        running = [engine.submit(prompts[i], params, events=sink) for i, sink in enumerate(sinks)]
        while min(len(s.times) for s in sinks) < warm_events:
            time.sleep(0.01)
        arrived.append(time.perf_counter())
        engine.submit(long_prompt, SamplingParams(temperature=0.0, max_tokens=1), events=long_sink)
        long_sink.done.wait()
        while min(len([t for t in s.times if t > long_sink.times[0]]) for s in sinks) < 1:  # each stream's next tokens
            time.sleep(0.01)
        for request in running:
            request.cancelled = True

    serve_clients(engine, [scenario])
    (arrived,), first_token = arrived, long_sink.times[0]
    before = [g for s in sinks for g in gaps([t for t in s.times if t <= arrived], 0.0, arrived)]
    during = [g for s in sinks for g in gaps(s.times, arrived, first_token)]
    return statistics.median(before), statistics.median(during or [float("nan")]), max(during or [first_token - arrived]), \
        first_token - arrived


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--long", type=int, default=8000, help="the long prompt's tokens")
    p.add_argument("--chunks", type=int, nargs="+", default=None, help="the chunked runs' --max-num-batched-tokens "
                   "(default: the engine's on this device)")
    p.add_argument("--warm-events", type=int, default=5, help="events each stream has had before the prompt arrives")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    decoder, tokenizer, device, dtype = default_pair_decoder()
    prompts = render(tokenizer, heldout_prompts())[:args.streams]
    text = " ".join(p.text for p in heldout_prompts())
    long_prompt = (tokenizer.encode(text) * (1 + args.long // 1000))[:args.long]
    chunks = args.chunks or [Engine.default_batched_tokens(device)]
    default = Engine.default_batched_tokens(device)
    configs = [(f"chunked{' (default)' * (c == default)}", c) for c in chunks] + [("unchunked", args.long)]
    lines = [f"{datetime.date.today()}, {torch.cuda.get_device_name() if device == 'cuda' else platform.machine() + ' CPU'}, "
             f"torch {torch.__version__}, {str(dtype).split('.')[-1]}; the default pair (K = 7), {args.streams} greedy "
             f"streams, then a {args.long}-token prompt", "",
             "| prefill | tokens per step | streams' gap before, ms | gap while it enters, median ms | largest gap, ms "
             "| its time to first token, s |", "|---|---|---|---|---|---|"]
    for name, budget in configs:
        before, median, largest, ttft = measure(decoder, prompts, long_prompt, budget, args.streams, args.warm_events)
        lines.append(f"| {name} | {budget} | {1e3 * before:.0f} | {1e3 * median:.0f} | {1e3 * largest:.0f} | {ttft:.1f} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
