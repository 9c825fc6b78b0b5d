"""The engine's counters and latency histograms since start, which /metrics and the iteration log read."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class Histogram:
    """Observations in buckets by upper bound (Prometheus' histogram; the last bucket is above every
    bound), with their sum."""
    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, not cumulative; their sum is the count
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.total += value


FIRST_TOKEN_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class EngineStats:
    """Counters and latency histograms since start, read by the metrics endpoint."""
    finished: dict[str, int] = field(default_factory=dict)  # requests by finish reason ("abort": the client
                                                            # left or the engine stopped first)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    drafts: int = 0  # verified draft blocks (one per active row and step)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # seconds: arrival to first token; arrival to admission; arrival to last token and last less
    # first token per later token, of the requests that stopped or reached their length
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(FIRST_TOKEN_BOUNDS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_BOUNDS))
    e2e_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_BOUNDS))
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_BOUNDS))
