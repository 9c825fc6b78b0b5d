"""/metrics and the iteration log: vLLM's names under dspark:, histograms whose buckets count each
request served, label values escaped by prometheus_client, and the periodic line of rates."""
from __future__ import annotations

import queue
import threading

import pytest
import torch
from prometheus_client import generate_latest

from dspark import SamplingParams, SpeculativeDecoder
from dspark.engine import Engine, Histogram
from dspark.serve.metrics import IterationLog, metrics_registry
from test_decoder import tiny_pair


def exposition(engine: Engine, model: str) -> str:
    return generate_latest(metrics_registry(engine, model)).decode()


@pytest.fixture
def running():
    """Runs an engine's thread; shuts the engine down after the test."""
    started = []

    def run(engine: Engine) -> Engine:
        thread = threading.Thread(target=engine.run, daemon=True)
        thread.start()
        started.append((engine, thread))
        return engine

    yield run
    for engine, thread in started:
        engine.shutdown()
        thread.join(60)


def wait(request, first_only: bool = False) -> None:
    """Until the request's first batch of tokens (first_only) or its end."""
    while (event := request.events.get(timeout=120)) is not None:
        assert not isinstance(event, Exception), event
        if first_only:
            return


def test_metrics_escape_the_model_name():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    text = exposition(engine, 'my "model"\\x\nz')
    assert all(line.startswith(("# ", "dspark:", "process_")) for line in text.splitlines())  # a raw newline split one
    assert 'model_name="my \\"model\\"\\\\x\\nz"' in text
    assert 'dspark:time_to_first_token_seconds_count{model_name="my' in text


def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it():
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 3.0):
        histogram.observe(value)
    assert (histogram.counts, histogram.total) == ([2, 1, 1], 6.0)


def test_the_latency_histograms_count_each_request_served(running):
    """Every admitted request has a queue time and a first token; those that stop or reach their
    length (not an abort) an end-to-end latency, and a time per output token if they have a second."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = running(Engine(SpeculativeDecoder(target, drafter), max_batch=3, max_model_len=64))
    requests = [engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                for n in (1, 6, 40)]
    wait(requests[2], first_only=True)
    requests[2].cancelled = True  # its client leaves after its first tokens
    for request in requests:
        wait(request)
    assert engine.stats.finished == {"length": 2, "abort": 1}
    lines = exposition(engine, "m").splitlines()
    for name, count in [("time_to_first_token", 3), ("request_queue_time", 3), ("e2e_request_latency", 2),
                        ("request_time_per_output_token", 1)]:
        prefix = f"dspark:{name}_seconds"
        assert f"# TYPE {prefix} histogram" in lines
        buckets = [float(line.split()[-1]) for line in lines if line.startswith(prefix + "_bucket{")]
        assert buckets == sorted(buckets) and buckets[-1] == count  # cumulative; le="+Inf" holds all
        assert any(line.startswith(prefix + '_bucket{le="+Inf",model_name="m"}') for line in lines)
        assert [float(line.split()[-1]) for line in lines if line.startswith(prefix + "_count{")] == [count]
    sums = {line.split("_seconds_sum")[0]: float(line.split()[-1]) for line in lines if "_seconds_sum{" in line}
    assert sums["dspark:e2e_request_latency"] >= sums["dspark:time_to_first_token"] > 0


def test_the_counters_carry_vllms_names_and_the_per_position_acceptance(running):
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = running(Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=2,
                            max_model_len=64))
    wait(engine.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in exposition(engine, "m").splitlines()
               if line.startswith("dspark:")}
    stats = engine.stats
    assert samples['dspark:generation_tokens_total{model_name="m"}'] == 20
    assert samples['dspark:prompt_tokens_total{model_name="m"}'] == stats.prompt_tokens
    assert samples['dspark:spec_decode_num_drafts_total{model_name="m"}'] == stats.drafts > 0
    assert samples['dspark:spec_decode_num_draft_tokens_total{model_name="m"}'] == 4 * stats.drafts
    assert [samples[f'dspark:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}}']
            for i in range(4)] == stats.accepted_per_position
    assert samples['dspark:request_success_total{finished_reason="length",model_name="m"}'] == 1
    assert samples['dspark:num_requests_running{model_name="m"}'] == 0


@torch.inference_mode()
def test_the_kv_cache_metrics_show_usage_prefix_hits_and_preemptions():
    """A pool of 12 blocks of 4 for requests of up to 36 + 5 positions: the second request finds the
    first's 16-token prompt cached, and the third (another prompt) runs the pool out mid-decode."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=3, max_model_len=36,
                    block_size=4, num_blocks=13)

    def sample(text: str, name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"dspark:{name}{{"))

    params = SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True)
    first = engine.submit(list(range(1, 18)), params)
    engine.step()
    text = exposition(engine, "m")
    assert sample(text, "kv_cache_usage_perc") == pytest.approx(6 / 12)  # 17 + 5 positions: 6 blocks
    assert sample(text, "prefix_cache_queries_total") == 17 and sample(text, "prefix_cache_hits_total") == 0
    while not first.result.finished:
        engine.step()
    others = [engine.submit(list(range(1, 17)) + [30], params), engine.submit([9] * 17, params)]
    while not all(r.result.finished for r in others):
        engine.step()
    text = exposition(engine, "m")
    assert sample(text, "prefix_cache_hits_total") >= 16 and sample(text, "num_preemptions_total") >= 1  # and resumed
    assert sample(text, "kv_cache_usage_perc") == 0.0


@torch.inference_mode()
@pytest.mark.parametrize("k", [0, 4])
def test_the_iteration_log_gives_the_rates_and_acceptance_of_the_seconds_since_its_last_line(running, k):
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter if k else None), max_batch=2, max_model_len=64)
    clock = [100.0]
    log = IterationLog(engine, clock=lambda: clock[0])
    running(engine)
    requests = [engine.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
                for _ in range(2)]
    for request in requests:
        wait(request)
    clock[0] += 2.0
    stats = engine.stats
    expected = ("dspark: prompt 3.0 tokens/s, generation 20.0 tokens/s, 0 running, 0 waiting, KV cache usage 0.0%, "
                "prefix cache hit rate 0.0%")  # three-token prompts fill no block
    if k:
        assert sum(stats.accepted_per_position) == stats.accepted_tokens > 0
        expected += (f"; mean acceptance length {1 + stats.accepted_tokens / stats.drafts:.2f}, accepted per "
                     "position " + " ".join(f"{n / stats.drafts:.2f}" for n in stats.accepted_per_position))
    assert log.line() == expected
    clock[0] += 10.0
    assert log.line() is None  # an idle engine writes nothing


def test_the_iteration_log_writes_until_told_to_stop():
    lines, stop = queue.Queue(), threading.Event()
    target, _ = tiny_pair(vocab=64)
    log = IterationLog(Engine(SpeculativeDecoder(target, None), max_batch=1, max_model_len=32), interval=0.01,
                       write=lines.put)
    log.line = lambda: "a line"
    thread = threading.Thread(target=log.run, args=(stop,))
    thread.start()
    assert lines.get(timeout=60) == "a line"
    stop.set()
    thread.join(60)
    assert not thread.is_alive()
