"""Timing helpers shared by the benchmarks: median microseconds of a call, by CUDA-graph replays
on GPU (captured after a warm-up on a side stream) or by wall clock on CPU; the mean of eager calls
back to back; the torch profiler's view of some calls; and the table output."""
from __future__ import annotations

import statistics
import time

import torch


def median_us(fn, device: torch.device | str, replays: int = 200, flush_l2: bool = False) -> float:
    """Median µs of fn(). flush_l2: on GPU, overwrite a buffer of twice the L2 cache before each
    replay (outside the timed span), so that no replay finds what the one before it left in L2."""
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
    scratch = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size if flush_l2 else 0,
                          dtype=torch.uint8, device=device)
    for start, end in events:
        scratch.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(start.elapsed_time(end) for start, end in events)


def eager_us(fn, device: torch.device | str, replays: int = 50) -> float:
    """Mean µs of fn() called back to back without a graph: on GPU the host launches every kernel,
    so a step bound by its launches shows it (timed from the first launch to the last kernel's end)."""
    if torch.device(device).type == "cpu":
        return median_us(fn, device, replays)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(replays):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - began) / replays


def emit_table(lines: list[str], out: str | None) -> None:
    """Prints the markdown table and, with --out, writes it there too."""
    table = "\n".join(lines)
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")


def print_profile(calls, device: torch.device, unit: str = "step") -> None:
    """The torch profiler's view of `calls` (functions of no argument, each one `unit`, run
    eagerly): the kernels (or CPU ops) that took the most device time, and device vs host time
    per call."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for call in calls:
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
    n = len(calls)
    wall_ms = 1000 * (time.perf_counter() - began) / n
    events = prof.key_averages()
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    device_ms = sum(e.self_device_time_total for e in kernels) / 1000 / n
    host_ms = sum(e.self_cpu_time_total for e in events) / 1000 / n
    print(f"profile of {n} {unit}s: {wall_ms:.3f} ms wall, {device_ms:.3f} ms of device kernels, "
          f"{host_ms:.3f} ms of host ops per {unit} (profiler overhead included)")
    print(events.table(sort_by=sort_by, row_limit=12, max_name_column_width=60))
