"""Time: the learning-rate schedule (warmup_cosine) and the time budget that stops a run (TimeBudget)."""
from __future__ import annotations

import collections
import itertools
import math
import statistics
import time


def warmup_cosine(steps: int, warmup: float):
    """The learning-rate factor of a step: a linear warmup over a share `warmup` of `steps`, then a
    cosine decay that reaches 0 at `steps`."""
    warmup_steps = max(1, round(warmup * steps))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, steps - warmup_steps)))

    return factor


class TimeBudget:
    """A `stop` callback: says stop once the next step (or generation batch) would end after
    `deadline` (time.monotonic(); None: never), judging a step's length by the time between the
    last two calls. The first step is not a guide (it compiles), so it never stops the second.
    `steps_left()` says how many steps of the median length over the last `window` steps still fit:
    the median, because a step that compiles again (a new batch length can, early in a run) takes
    tens of seconds; a fit by the mean scheduled 2,483 steps where about 8,800 fitted."""

    def __init__(self, deadline: float | None, window: int = 200):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.deadline = deadline
        self.times: collections.deque[float] = collections.deque(maxlen=window + 1)  # the last calls

    def __call__(self, step: int) -> bool:
        now = time.monotonic()
        step_seconds = 0.0 if len(self.times) < 2 else now - self.times[-1]
        self.times.append(now)
        return self.deadline is not None and now + step_seconds > self.deadline

    def steps_left(self) -> int:
        if self.deadline is None or len(self.times) < 2:
            raise RuntimeError("steps_left needs a deadline and two calls")
        step_seconds = statistics.median(b - a for a, b in itertools.pairwise(self.times))
        return max(0, int((self.deadline - self.times[-1]) / step_seconds))
