"""The engine's counters for people and for scrapers: a prometheus_client collector that reads the
engine's stats when /metrics is scraped, with vLLM's metric names under the `dspark:` prefix (so
that scrapers written for vLLM's speculative-decoding and latency metrics find them), and the
iteration log, a line of rates every few seconds in which the engine worked (vLLM's periodic stats
line). A new metric is a few lines of EngineCollector.collect."""
from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from dspark.engine import Engine, EngineStats, Histogram
from dspark.engine.scheduler import SchedulerCounters


class EngineCollector(Collector):
    """The metrics of `engine`, labelled with the served model's name."""

    def __init__(self, engine: Engine, model: str):
        self.engine, self.model = engine, model

    def _family(self, kind, name: str, help_text: str, samples, labels=()):
        """A family from (label values after the model's, value) pairs."""
        family = kind(f"dspark:{name}", help_text, labels=["model_name", *labels])
        for values, value in samples:
            family.add_metric([self.model, *values], value)
        return family

    def _histogram(self, name: str, help_text: str, h: Histogram) -> HistogramMetricFamily:
        """Buckets made cumulative; the +Inf bucket is the count, read once (the engine thread adds on)."""
        family = HistogramMetricFamily(f"dspark:{name}", help_text, labels=["model_name"])
        cumulative = list(itertools.accumulate(list(h.counts)))
        family.add_metric([self.model], list(zip([*map(repr, h.bounds), "+Inf"], cumulative)), h.total)
        return family

    def collect(self):
        engine, stats, counters = self.engine, self.engine.stats, self.engine.scheduler.counters
        yield self._family(GaugeMetricFamily, "num_requests_running",
                           "Requests holding KV blocks (their prompts entering, or decoding).",
                           [((), engine.num_running())])
        yield self._family(GaugeMetricFamily, "num_requests_waiting",
                           "Requests waiting for KV blocks or a seat (preempted ones included).",
                           [((), engine.num_waiting())])
        yield self._family(GaugeMetricFamily, "kv_cache_usage_perc",
                           "The share of the KV cache's blocks requests hold (1 = all of them).",
                           [((), engine.pool.usage)])
        for name, help_text, value in [
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", counters.prefix_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", counters.prefix_hits),
                ("num_preemptions", "Requests preempted (their blocks released, recomputed later).",
                 counters.preemptions)]:
            yield self._family(CounterMetricFamily, name, help_text, [((), value)])
        yield self._family(CounterMetricFamily, "request_success", "Finished requests, by finish reason (abort: the "
                           "client left or the engine stopped first).",
                           [((reason,), n) for reason, n in sorted(stats.finished.items())], ["finished_reason"])
        for name, help_text, value in [
                ("prompt_tokens", "Prefilled prompt tokens.", stats.prompt_tokens),
                ("generation_tokens", "Generated tokens.", stats.generation_tokens),
                ("num_decode_steps", "Decode steps of the whole batch.", stats.steps),
                ("spec_decode_num_drafts", "Draft blocks verified.", stats.drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.", stats.draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.accepted_tokens)]:
            yield self._family(CounterMetricFamily, name, help_text, [((), value)])
        yield self._family(CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                           "Draft tokens accepted at each position of the block.",
                           [((str(i),), n) for i, n in enumerate(list(stats.accepted_per_position))], ["position"])
        yield self._histogram("time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                              stats.time_to_first_token)
        yield self._histogram("request_queue_time_seconds",
                              "Time from a request's arrival to its admission into a slot.", stats.queue_time)
        yield self._histogram("e2e_request_latency_seconds", "Time from a request's arrival to its last token.",
                              stats.e2e_latency)
        yield self._histogram("request_time_per_output_token_seconds",
                              "A finished request's time from its first token to its last, per later token.",
                              stats.time_per_output_token)


def metrics_registry(engine: Engine, model: str) -> CollectorRegistry:
    """A registry of the engine's metrics and the process's (its own: an app per engine, as tests make)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model))
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_open_fds, ...
    return registry


class IterationLog:
    """Every `interval` seconds in which the engine did something, one line: prompt and generation
    tokens per second, requests running and waiting, the KV cache's usage and the prefix cache's hit
    rate, and for speculation the mean acceptance length (bonus token included) and the acceptance
    rate per draft position over those seconds."""

    def __init__(self, engine: Engine, interval: float = 10.0, write: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engine, self.interval, self.clock = engine, interval, clock
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.last, self.last_time = self._snapshot(), clock()

    def _snapshot(self) -> tuple[EngineStats, SchedulerCounters]:
        stats, counters = self.engine.stats, self.engine.scheduler.counters
        return (dataclasses.replace(stats, accepted_per_position=list(stats.accepted_per_position)),
                dataclasses.replace(counters))

    def line(self) -> str | None:
        """The line for the time since the last one (None if the engine did nothing meanwhile)."""
        now, (stats, counters) = self.clock(), self._snapshot()
        (last, last_counters), seconds = self.last, max(now - self.last_time, 1e-9)
        self.last, self.last_time = (stats, counters), now
        if stats.steps == last.steps and stats.prompt_tokens == last.prompt_tokens:
            return None
        engine = self.engine
        text = (f"dspark: prompt {(stats.prompt_tokens - last.prompt_tokens) / seconds:.1f} tokens/s, generation "
                f"{(stats.generation_tokens - last.generation_tokens) / seconds:.1f} tokens/s, "
                f"{engine.num_running()} running, {engine.num_waiting()} waiting, KV cache usage "
                f"{100 * engine.pool.usage:.1f}%")
        queries = counters.prefix_queries - last_counters.prefix_queries
        if queries:
            text += f", prefix cache hit rate {100 * (counters.prefix_hits - last_counters.prefix_hits) / queries:.1f}%"
        drafts = stats.drafts - last.drafts
        if drafts:
            accepted = [n - m for n, m in zip(stats.accepted_per_position, last.accepted_per_position)]
            text += (f"; mean acceptance length {1 + sum(accepted) / drafts:.2f}, accepted per position "
                     + " ".join(f"{a / drafts:.2f}" for a in accepted))
        return text

    def run(self, stop: threading.Event) -> None:
        """Writes the lines until `stop` is set (a thread's target)."""
        while not stop.wait(self.interval):
            text = self.line()
            if text is not None:
                self.write(text)
