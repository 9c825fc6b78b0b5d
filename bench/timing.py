"""Timing helpers shared by the benchmarks: median microseconds of a call, by CUDA-graph replays
on GPU (captured after a warm-up on a side stream) or by wall clock on CPU; and the table output."""
from __future__ import annotations

import statistics
import time

import torch


def median_us(fn, device: torch.device | str, replays: int = 200) -> float:
    if torch.device(device).type == "cpu":
        fn()
        times = []
        for _ in range(max(replays, 1)):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return 1e6 * statistics.median(times)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(replays)]
    for _ in range(10):
        graph.replay()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(start.elapsed_time(end) for start, end in events)


def emit_table(lines: list[str], out: str | None) -> None:
    """Prints the markdown table and, with --out, writes it there too."""
    table = "\n".join(lines)
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
