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

    def family(name: str, kind: str, help_text: str, samples) -> None:
        """HELP and TYPE, then a line per sample: (name suffix, labels after the model's, value)."""
        lines.extend([f"# HELP dspark:{name} {help_text}", f"# TYPE dspark:{name} {kind}"])
        lines.extend(f"dspark:{name}{suffix}{{{label}{extra}}} {value}" for suffix, extra, value in samples)

    def metric(name: str, kind: str, help_text: str, value) -> None:
        family(name, kind, help_text, [("", "", value)])

    metric("num_requests_running", "gauge", "Requests in a batch slot.", running)
    metric("num_requests_waiting", "gauge", "Requests waiting for a slot.", engine.num_waiting())
    family("request_success_total", "counter",
           "Finished requests, by finish reason (abort: the client left or the engine stopped first).",
           [("", f',finished_reason="{reason}"', n) for reason, n in sorted(stats.finished.items())])
    metric("prompt_tokens_total", "counter", "Prefilled prompt tokens.", stats.prompt_tokens)
    metric("generation_tokens_total", "counter", "Generated tokens.", stats.generation_tokens)
    metric("num_decode_steps_total", "counter", "Decode steps of the whole batch.", stats.steps)
    family("time_to_first_token_seconds", "summary", "Time from a request's arrival to its first token.",
           [("_sum", "", round(stats.time_to_first_token_s, 6)), ("_count", "", stats.first_tokens)])
    metric("spec_decode_num_drafts_total", "counter", "Draft blocks verified.", stats.drafts)
    metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", stats.draft_tokens)
    metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", stats.accepted_tokens)
    family("spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Draft tokens accepted at each position of the block.",
           [("", f',position="{i}"', n) for i, n in enumerate(stats.accepted_per_position)])
    return "\n".join(lines) + "\n"
