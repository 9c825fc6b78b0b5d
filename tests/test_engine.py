"""The serving engine: continuous batching is lossless and batch-invariant: every request, whatever
joins or leaves the batch around it, gets exactly what it would get decoding alone (greedy: the
target's own greedy tokens; sampled: the same tokens for the same seed), also when it is admitted
mid-flight; cancelled, failed and shut-down requests free their slots and wake their waiters."""
from __future__ import annotations

import pytest
import torch

from dspark import SamplingParams, SpeculativeDecoder
from dspark.serve.engine import Engine, EngineStopped
from dspark.serve.openai import speculation
from test_decoder import target_greedy, tiny_pair


def drain(engine: Engine, requests) -> None:
    """Runs the engine in this thread until every request has finished."""
    while not all(r.result.finished or r.cancelled for r in requests):
        engine._admit(block=False)
        if any(engine.slots):
            engine._step()


def decode_alone(target, drafter, prompt, params, k=4):
    return SpeculativeDecoder(target, drafter, num_speculative_tokens=k).generate([prompt], params)[0].tokens


@torch.inference_mode()
def test_continuous_batching_greedy_equals_target_greedy_with_admission_mid_flight(one_thread):
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=3, max_model_len=64)
    prompts = [[1, 2, 3], [5, 9, 11, 2, 7], [4], [8, 8, 1]]
    lengths = [20, 6, 14, 9]
    first = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
             for p, n in zip(prompts[:3], lengths[:3])]
    engine._admit(block=False)
    for _ in range(3):  # the short request leaves; the fourth joins the batch mid-flight
        engine._step()
    late = engine.submit(prompts[3], SamplingParams(temperature=0.0, max_tokens=lengths[3], ignore_eos=True))
    requests = first + [late]
    drain(engine, requests)
    for request, prompt, n in zip(requests, prompts, lengths):
        assert request.result.tokens == target_greedy(target, prompt, n)
        assert request.result.finish_reason == "length" and request.events.queue[-1] is None
    assert engine.stats.finished == {"length": 4} and not any(engine.slots)


@torch.inference_mode()
def test_requests_done_at_their_first_token_leave_at_admission(one_thread):
    """max_tokens = 1: the prefill's token is the whole completion; no slot stays in use."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=2, max_model_len=64)
    requests = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)) for p in ([1, 2], [3])]
    engine._admit(block=False)
    assert not any(engine.slots) and [r.result.tokens for r in requests] == [
        target_greedy(target, [1, 2], 1), target_greedy(target, [3], 1)]
    late = engine.submit([4, 5], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    drain(engine, [late])
    assert late.result.tokens == target_greedy(target, [4, 5], 5)


@torch.inference_mode()
@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_seeded_request_draws_the_same_tokens_in_any_batch(one_thread, method, device):
    """Noise is keyed by (seed, position): a sampled request's tokens do not depend on its slot or
    its neighbours (on CUDA too, where a batch's size may change the kernels its products run).
    Control: another seed gives other tokens."""
    target, drafter = (m.to(device) for m in tiny_pair(vocab=64, logit_std=1.0, block_size=4))
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=4, rejection_sample_method=method)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=-1234, ignore_eos=True)
    alone = decoder.generate([[3, 1, 4]], params)[0].tokens
    engine = Engine(decoder, max_batch=4, max_model_len=64)
    others = [engine.submit([2, 7, 1, 8], SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True))
              for n in (5, 11)]
    engine._admit(block=False)
    engine._step()
    ours = engine.submit([3, 1, 4], params)
    control = engine.submit([3, 1, 4], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99,
                                                      ignore_eos=True))
    drain(engine, others + [ours, control])
    assert ours.result.tokens == alone
    assert control.result.tokens != alone


@torch.inference_mode()
def test_an_admission_drafts_the_new_rows_only(one_thread, monkeypatch):
    """A request joining the batch gets the drafts and proposals that drafting the whole batch would
    give it, and the row in flight is not drafted again: its drafts and proposals stay as its last
    step wrote them. One done at its first token is not drafted."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=4, max_model_len=64)
    runner = engine.runner
    params = [SamplingParams(temperature=t, max_tokens=12, seed=s, ignore_eos=True) for t, s in ((0.9, 1), (0.0, 2))]
    engine.submit([2, 7, 1, 8], params[0])
    engine._admit(block=False)
    engine._step()
    in_flight = runner.tokens[0].clone(), runner.draft_probs[0].clone()
    drafted = []
    draft = engine.decoder.draft
    monkeypatch.setattr(engine.decoder, "draft", lambda *a, rows: drafted.append(rows.tolist()) or draft(*a, rows=rows))
    for p in params:
        engine.submit([3, 1, 4], p)
    done_at_first = engine.submit([5, 9], SamplingParams(temperature=0.0, max_tokens=1))
    engine._admit(block=False)
    assert drafted == [[1, 2]] and done_at_first.result.finished  # it had row 3
    assert torch.equal(runner.tokens[0], in_flight[0]) and torch.equal(runner.draft_probs[0], in_flight[1])
    admitted = runner.tokens[1:3].clone(), runner.draft_probs[1:3].clone()
    runner.draft(range(3))
    assert torch.equal(runner.tokens[1:3], admitted[0]) and torch.equal(runner.draft_probs[1:3], admitted[1])


def test_submit_rejects_what_it_cannot_serve():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=2, max_model_len=32)
    with pytest.raises(ValueError, match="exceeds the maximum model length 32"):
        engine.submit([1] * 20, SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match=r"outside \[0, 64\): \[64\]"):
        engine.submit([1, 64], SamplingParams())
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="the prompt must be a list of token ids"):  # once failed the engine thread
        engine.submit([5, 2.5], SamplingParams())
    for bad in (10**9, 0):  # 0 once meant the model's maximum
        with pytest.raises(ValueError, match="max_model_len"):
            Engine(SpeculativeDecoder(target, drafter), max_model_len=bad)


@torch.inference_mode()
def test_a_cancelled_request_leaves_its_slot():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    request = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine._admit(block=False)
    engine._step()
    request.cancelled = True
    engine._step()
    assert engine.slots == [None] and request.result.finish_reason == "abort"
    assert request.events.queue[-1] is None
    assert engine.stats.finished == {"abort": 1}  # /metrics tells it from a success
    gone = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))
    assert engine.num_waiting() == 1
    gone.cancelled = True  # its client left while it waited
    assert engine.num_waiting() == 0  # the gauge of /metrics does not count it
    engine._admit(block=False)
    assert engine.slots == [None] and gone.result.finish_reason == "abort" and gone.result.tokens == []
    assert engine.stats.finished == {"abort": 2} and engine.stats.prompt_tokens == 2  # not prefilled


def test_a_request_whose_client_left_while_it_waited_is_dropped_before_the_next_step():
    """Not when a slot frees for it: its handler (a thread, and the client's socket) was held that long."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    running = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    gone = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))
    gone.cancelled = True
    step, seen = engine._step, []

    def first_step_then_stop():
        seen.append((gone.result.finish_reason, gone.events.queue[-1] if gone.events.qsize() else "no event",
                     running.result.finished))
        engine.shutdown()
        step()

    engine._step = first_step_then_stop
    engine.run()
    assert seen == [("abort", None, False)]


def test_a_failing_step_fails_every_request_and_stops_the_engine():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    running = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    waiting = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))

    def broken(*args):
        raise RuntimeError("device lost")

    engine.decoder.step = broken
    with pytest.raises(RuntimeError, match="device lost"):
        engine.run()
    for request in (running, waiting):
        assert isinstance(request.events.queue[-1], RuntimeError)
    assert engine.stopped.is_set() and engine.slots == [None]


@torch.inference_mode()
def test_a_failing_prefill_fails_only_the_requests_it_admitted():
    """A prefill's failure (say, out of memory on a long prompt) once stopped the engine and every
    request in flight with it."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=2, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    running = engine.submit([1, 2], params)
    engine._admit(block=False)
    engine._step()
    failing = engine.submit([3, 4], params)
    prefill = engine.decoder.prefill
    engine.decoder.prefill = lambda *args: (_ for _ in ()).throw(RuntimeError("out of memory"))
    engine._admit(block=False)
    engine.decoder.prefill = prefill
    assert isinstance(failing.events.get_nowait(), RuntimeError) and engine.slots[1] is None
    drain(engine, [running])
    assert running.result.tokens == target_greedy(target, [1, 2], 12)
    assert not engine.stopped.is_set() and engine.stats.finished == {"abort": 1, "length": 1}


@torch.inference_mode()
def test_a_generate_on_the_engines_models_stops_it_instead_of_corrupting_requests():
    """generate sets up caches of its own on the same target: the engine's requests in flight lost
    their context and went on silently with wrong tokens."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine._admit(block=False)
    engine._step()
    SpeculativeDecoder(target, drafter).generate([[5]], SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="caches are no longer this StepRunner's"):
        engine._step()


def test_after_shutdown_nothing_waits_forever():
    """A request submitted once the engine stops is refused; those in flight or waiting at shutdown
    receive EngineStopped rather than waiting on events that never come, and count as aborted."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    running = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    waiting = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))
    engine._admit(block=False)
    engine.shutdown()
    engine.run()
    for request in (running, waiting):
        assert isinstance(request.events.queue[-1], EngineStopped)
    assert engine.stats.finished == {"abort": 2}
    with pytest.raises(EngineStopped):
        engine.submit([4], SamplingParams(max_tokens=2))


def test_without_speculation_the_response_reports_none():
    target, _ = tiny_pair(vocab=64)
    engine = Engine(SpeculativeDecoder(target, None), max_batch=1, max_model_len=32)
    request = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    with torch.inference_mode():
        drain(engine, [request])
    assert request.result.tokens == target_greedy(target, [1, 2], 5)
    assert speculation([request.result]) is None and engine.stats.drafts == 0
