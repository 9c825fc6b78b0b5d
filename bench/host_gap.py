"""The host's share of a decode step at B = 1, from a profiler trace: how long the device waits between
two steps' work when the engine reads each step before it queues the next (overlap off), and with
overlapped scheduling (the engine's default on CUDA), in one process.

One request of random prompt tokens decodes `--tokens` tokens through Engine.step, its steps
replayed from CUDA graphs; after its prompt is in, the torch profiler records the device's kernels
and copies. Sorted by start, the device is idle between one activity's end and the next one's start;
of those gaps, the (steps - 1) largest are taken as the gaps between steps (an upper bound of them:
inside a graph replay the kernels follow each other within microseconds). Reported per decode step:
wall time, device busy time, and the median gap between steps.

The target has random weights of SmolLM2-135M's shapes; the drafter is the shipped one, at a fixed K.

    python -m bench.host_gap [--speculation 0 7] [--tokens 128] [--out table.md]
    python -m bench.host_gap --smoke      # CPU, a tiny target: checks that it runs (no device trace)
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from bench.engine_step import make_drafter
from bench.models import SMOKE, SMOLLM2, random_target
from bench.timing import emit_table
from dspark import SamplingParams, SpeculativeDecoder
from dspark.compile.runner import blocks_per_request
from dspark.engine import Engine
from dspark.kv_cache import KV_BLOCK_SIZE
from dspark.loading import measuring_dtype

PROMPT = 16


def device_intervals(prof: torch.profiler.profile) -> list[tuple[float, float]]:
    """(start, end) µs of every device activity in the trace, by start."""
    return sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)


def idle_gaps(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """(busy µs, the idle gaps in µs) of a device timeline of possibly overlapping intervals."""
    busy, gaps, end = 0.0, [], None
    for start, stop in intervals:
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, gaps


def profiled_request(engine: Engine, tokens: int, vocab: int) -> tuple[float, int, list[tuple[float, float]]]:
    """Decodes one request, profiling from its first decode step on -> (wall s, decode steps, intervals)."""
    prompt = torch.randint(0, vocab, (PROMPT,)).tolist()
    request = engine.submit(prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True))
    while not request.result.tokens:  # the prompt and the first token
        engine.step()
    steps = request.result.num_steps
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = engine.decoder.device.type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        began = time.perf_counter()
        while not request.result.finished:
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - began
    return wall, request.result.num_steps - steps, device_intervals(prof) if cuda else []


@torch.inference_mode()
def run(speculation: list[int], tokens: int, device: torch.device, smoke: bool) -> list[str]:
    torch.manual_seed(0)
    target = random_target(SMOKE if smoke else SMOLLM2, device, measuring_dtype(device))
    drafter = make_drafter("smoke" if smoke else "smollm2", target)
    lines = ["| speculation | host | ms per step (wall) | device busy ms per step | median gap between steps, µs |",
             "|---|---|---|---|---|"]
    for k in speculation:
        decoder = SpeculativeDecoder(target, drafter if k else None, num_speculative_tokens=k or None)
        for name, overlap in (("each step read before the next is queued", False), ("overlapped (dspark)", True)):
            length = PROMPT + 2 * tokens + 64
            engine = Engine(decoder, max_num_seqs=1, max_model_len=length, overlap=overlap,
                            num_blocks=1 + blocks_per_request(length, decoder.k, KV_BLOCK_SIZE))
            profiled_request(engine, tokens, target.config.vocab_size)  # captures the graphs
            wall, steps, intervals = profiled_request(engine, tokens, target.config.vocab_size)
            busy, gaps = idle_gaps(intervals)
            between = sorted(gaps)[-(steps - 1):] if intervals and steps > 1 else [float("nan")]
            lines.append(f"| K = {k} | {name} | {1e3 * wall / steps:.3f} | {busy / 1e3 / steps:.3f} | "
                         f"{statistics.median(between):.1f} |")
            engine.shutdown()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speculation", type=int, nargs="+", default=[0, 7], help="K of the decoders compared")
    p.add_argument("--tokens", type=int, default=128, help="new tokens of the profiled request")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        device, args.tokens = torch.device("cpu"), 16
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device; use --smoke for a CPU check")
    else:
        device = torch.device("cuda")
    lines = run(args.speculation, args.tokens, device, args.smoke)
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = (f"Host gap between decode steps at B = 1, SmolLM2-135M shapes (random weights), {args.tokens} "
              f"new tokens; {card}, torch {torch.__version__}, {datetime.date.today()}.\n")
    emit_table([header, *lines], args.out)


if __name__ == "__main__":
    main()
