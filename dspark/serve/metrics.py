"""Prometheus text exposition of the engine's counters, with vLLM's metric names under the
`dspark:` prefix (so that scrapers written for vLLM's speculative-decoding metrics find them)."""
from __future__ import annotations

from dspark.serve.engine import Engine


def _label_value(text: str) -> str:
    """A label value as the exposition format escapes it (a raw quote or newline breaks the page)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(engine: Engine, model: str) -> str:
    stats, label = engine.stats, f'model_name="{_label_value(model)}"'
    running = sum(request is not None and not request.cancelled for request in engine.slots)  # as waiting
    lines = []

    def metric(name: str, kind: str, help_text: str, value, labels: str = label) -> None:
        lines.extend([f"# HELP dspark:{name} {help_text}", f"# TYPE dspark:{name} {kind}",
                      f"dspark:{name}{{{labels}}} {value}"])

    metric("num_requests_running", "gauge", "Requests in a batch slot.", running)
    metric("num_requests_waiting", "gauge", "Requests waiting for a slot.", engine.num_waiting())
    lines += ["# HELP dspark:request_success_total Finished requests, by finish reason (abort: the client left).",
              "# TYPE dspark:request_success_total counter"]
    lines += [f'dspark:request_success_total{{{label},finished_reason="{reason}"}} {n}'
              for reason, n in sorted(stats.finished.items())]
    metric("prompt_tokens_total", "counter", "Prefilled prompt tokens.", stats.prompt_tokens)
    metric("generation_tokens_total", "counter", "Generated tokens.", stats.generation_tokens)
    metric("num_decode_steps_total", "counter", "Decode steps of the whole batch.", stats.steps)
    ttft = "time_to_first_token_seconds"
    lines += [f"# HELP dspark:{ttft} Time from a request's arrival to its first token.",
              f"# TYPE dspark:{ttft} summary",
              f"dspark:{ttft}_sum{{{label}}} {round(stats.time_to_first_token_s, 6)}",
              f"dspark:{ttft}_count{{{label}}} {stats.first_tokens}"]
    metric("spec_decode_num_drafts_total", "counter", "Draft blocks verified.", stats.drafts)
    metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", stats.draft_tokens)
    metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", stats.accepted_tokens)
    name = "spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP dspark:{name} Draft tokens accepted at each position of the block.",
              f"# TYPE dspark:{name} counter"]
    lines += [f'dspark:{name}{{{label},position="{i}"}} {n}' for i, n in enumerate(stats.accepted_per_position)]
    return "\n".join(lines) + "\n"
