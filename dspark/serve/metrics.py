"""The engine's counters for people and for scrapers: Prometheus text exposition with vLLM's metric
names under the `dspark:` prefix (so that scrapers written for vLLM's speculative-decoding and
latency metrics find them; the latencies are histograms), and the iteration log, a line of rates
every few seconds in which the engine worked (vLLM's periodic stats line)."""
from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from typing import Callable

from dspark.serve.engine import Engine, EngineStats, Histogram


def _label_value(text: str) -> str:
    """A label value as the exposition format escapes it (a raw quote or newline breaks the page)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(engine: Engine, model: str) -> str:
    stats, label = engine.stats, f'model_name="{_label_value(model)}"'
    lines = []

    def family(name: str, kind: str, help_text: str, samples) -> None:
        """HELP and TYPE, then a line per sample: (name suffix, labels after the model's, value)."""
        lines.extend([f"# HELP dspark:{name} {help_text}", f"# TYPE dspark:{name} {kind}"])
        lines.extend(f"dspark:{name}{suffix}{{{label}{extra}}} {value}" for suffix, extra, value in samples)

    def metric(name: str, kind: str, help_text: str, value) -> None:
        family(name, kind, help_text, [("", "", value)])

    def histogram(name: str, help_text: str, h: Histogram) -> None:
        """The buckets cumulative; _count equals the +Inf bucket, read once (the engine thread adds on)."""
        cumulative = list(itertools.accumulate(list(h.counts)))
        family(name, "histogram", help_text,
               [("_bucket", f',le="{le}"', n) for le, n in zip([*map(repr, h.bounds), "+Inf"], cumulative)]
               + [("_sum", "", round(h.total, 6)), ("_count", "", cumulative[-1])])

    metric("num_requests_running", "gauge", "Requests in a batch slot.", engine.num_running())
    metric("num_requests_waiting", "gauge", "Requests waiting for a slot.", engine.num_waiting())
    family("request_success_total", "counter",
           "Finished requests, by finish reason (abort: the client left or the engine stopped first).",
           [("", f',finished_reason="{reason}"', n) for reason, n in sorted(stats.finished.items())])
    metric("prompt_tokens_total", "counter", "Prefilled prompt tokens.", stats.prompt_tokens)
    metric("generation_tokens_total", "counter", "Generated tokens.", stats.generation_tokens)
    metric("num_decode_steps_total", "counter", "Decode steps of the whole batch.", stats.steps)
    histogram("time_to_first_token_seconds", "Time from a request's arrival to its first token.",
              stats.time_to_first_token)
    histogram("request_queue_time_seconds", "Time from a request's arrival to its admission into a slot.",
              stats.queue_time)
    histogram("e2e_request_latency_seconds", "Time from a request's arrival to its last token.",
              stats.e2e_latency)
    histogram("request_time_per_output_token_seconds",
              "A finished request's time from its first token to its last, per later token.",
              stats.time_per_output_token)
    metric("spec_decode_num_drafts_total", "counter", "Draft blocks verified.", stats.drafts)
    metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", stats.draft_tokens)
    metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", stats.accepted_tokens)
    family("spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Draft tokens accepted at each position of the block.",
           [("", f',position="{i}"', n) for i, n in enumerate(stats.accepted_per_position)])
    return "\n".join(lines) + "\n"


class IterationLog:
    """Every `interval` seconds in which the engine did something, one line: prompt and generation
    tokens per second, requests running and waiting, and for speculation the mean acceptance length
    (bonus token included) and the acceptance rate per draft position over those seconds."""

    def __init__(self, engine: Engine, interval: float = 10.0, write: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engine, self.interval, self.clock = engine, interval, clock
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.last, self.last_time = self._snapshot(), clock()

    def _snapshot(self) -> EngineStats:
        stats = self.engine.stats
        return dataclasses.replace(stats, accepted_per_position=list(stats.accepted_per_position))

    def line(self) -> str | None:
        """The line for the time since the last one (None if the engine did nothing meanwhile)."""
        now, stats = self.clock(), self._snapshot()
        last, seconds = self.last, max(now - self.last_time, 1e-9)
        self.last, self.last_time = stats, now
        if stats.steps == last.steps and stats.prompt_tokens == last.prompt_tokens:
            return None
        engine = self.engine
        text = (f"dspark: prompt {(stats.prompt_tokens - last.prompt_tokens) / seconds:.1f} tokens/s, generation "
                f"{(stats.generation_tokens - last.generation_tokens) / seconds:.1f} tokens/s, "
                f"{engine.num_running()} running, {engine.num_waiting()} waiting")
        drafts = stats.drafts - last.drafts
        if drafts:
            accepted = [n - m for n, m in zip(stats.accepted_per_position, last.accepted_per_position)]
            text += (f"; mean acceptance length {1 + sum(accepted) / drafts:.2f}, accepted per position "
                     + " ".join(f"{a / drafts:.2f}" for a in accepted))
        return text

    def run(self) -> None:
        """Writes the lines until the engine stops (a thread's target)."""
        while not self.engine.stopped.wait(self.interval):
            text = self.line()
            if text is not None:
                self.write(text)
