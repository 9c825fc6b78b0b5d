"""The serving engine: continuous batching over paged KV caches is lossless and batch-invariant: every
request, whatever joins or leaves the batch around it, gets exactly what it would get decoding alone
(greedy: the target's own greedy tokens; sampled: the same tokens for the same seed), also when it is
admitted mid-flight, when its prompt enters in chunks, when it is preempted and resumed or finds its
prefix cached; the pool's limits queue requests instead of failing them; cancelled, failed and
shut-down requests free their blocks and slots and wake their waiters."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from dspark import SamplingParams, SpeculativeDecoder
from dspark.engine import Engine, EngineStopped, generate
from dspark.engine.request import Status
from dspark.compile.runner import blocks_per_request, default_k_choices
from dspark.engine.speculation import StepK
from dspark.serve.openai import speculation
from test_decoder import target_greedy, tiny_pair


def drain(engine: Engine, requests) -> int:
    """Steps the engine in this thread until every request has finished -> the steps taken."""
    steps = 0
    while not all(r.result.finished or r.cancelled for r in requests):
        engine.step()
        steps += 1
    return steps


def make_engine(decoder, max_batch=4, max_model_len=64, **options) -> Engine:
    """An engine whose KV cache holds max_batch requests of max_model_len (blocks of 16), not the
    default memory's worth: the tiny models' blocks are small."""
    per_request = blocks_per_request(max_model_len, decoder.k, 16)
    return Engine(decoder, max_batch=max_batch, max_model_len=max_model_len,
                  num_blocks=options.pop("num_blocks", 1 + max_batch * per_request), **options)


def decode_alone(target, drafter, prompt, params, k=4):
    return generate(SpeculativeDecoder(target, drafter, num_speculative_tokens=k), [prompt], params)[0].tokens


@torch.inference_mode()
def test_continuous_batching_greedy_equals_target_greedy_with_admission_mid_flight(one_thread):
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=3, max_model_len=64)
    prompts = [[1, 2, 3], [5, 9, 11, 2, 7], [4], [8, 8, 1]]
    lengths = [20, 6, 14, 9]
    first = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
             for p, n in zip(prompts[:3], lengths[:3])]
    for _ in range(4):  # the prompts, then three steps: the short request leaves; the fourth joins mid-flight
        engine.step()
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
    engine = make_engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=2, max_model_len=64)
    requests = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)) for p in ([1, 2], [3])]
    engine.step()
    assert not any(engine.slots) and engine.pool.num_free == engine.pool.num_blocks - 1 and [r.result.tokens for r in requests] == [
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
    alone = generate(decoder, [[3, 1, 4]], params)[0].tokens
    engine = make_engine(decoder, max_batch=4, max_model_len=64)
    others = [engine.submit([2, 7, 1, 8], SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True))
              for n in (5, 11)]
    engine.step()
    engine.step()
    ours = engine.submit([3, 1, 4], params)
    control = engine.submit([3, 1, 4], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99,
                                                      ignore_eos=True))
    drain(engine, others + [ours, control])
    assert ours.result.tokens == alone
    assert control.result.tokens != alone


@torch.inference_mode()
def test_admitted_rows_are_drafted_by_the_next_step_that_verifies_drafts(one_thread, monkeypatch):
    """A request joining the batch gets no drafts at its admission; the next step that verifies
    drafts draws them first, for the new rows only (not the request in flight, whose step drafted
    it), giving them the drafts and proposals that drafting the whole batch would. A step verifying
    none draws none. One done at its first token is never drafted."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=4, max_model_len=64,
                         k_choices=[0, 4])
    ks = iter([4, 4, 4, 0, 4])
    engine.speculation.choose = lambda bucket, greedy: next(ks)
    runner = engine.runner
    params = [SamplingParams(temperature=t, max_tokens=12, ignore_eos=True) for t in (0.9, 0.0)]
    engine.submit([2, 7, 1, 8], params[0])
    engine.step(), engine.step()  # its prompt, then its first step
    drafted, whole_batch = [], []
    draft = runner.draft

    def drafting(slots):
        draft(slots)
        drafted.append(list(slots))
        kept = runner.tokens.clone(), runner.draft_probs.clone()
        draft(range(3))
        whole_batch.append(torch.equal(runner.tokens[1:3], kept[0][1:3])
                           and torch.equal(runner.draft_probs[1:3], kept[1][1:3]))
        runner.tokens.copy_(kept[0]), runner.draft_probs.copy_(kept[1])

    monkeypatch.setattr(runner, "draft", drafting)
    for p in params:
        engine.submit([3, 1, 4], p)
    done_at_first = engine.submit([5, 9], SamplingParams(temperature=0.0, max_tokens=1))
    engine.step()  # K = 4 for the request in flight, then the admission of two
    assert drafted == [] and done_at_first.result.finished
    engine.step()  # K = 4: the admitted rows' drafts first
    assert drafted == [[1, 2]] and whole_batch == [True]
    engine.step()  # K = 0
    engine.step()  # K = 4: every row's drafts first, left from older anchors by the step at 0
    assert drafted == [[1, 2], [0, 1, 2]] and whole_batch == [True, True]


def test_submit_rejects_what_it_cannot_serve():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter), max_batch=2, max_model_len=32)
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
            make_engine(SpeculativeDecoder(target, drafter), max_model_len=bad)


@torch.inference_mode()
def test_a_cancelled_request_leaves_its_slot():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    request = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    request.cancelled = True
    engine.step()
    assert engine.slots == [None] and request.result.finish_reason == "abort" and request.blocks == []
    assert request.events.queue[-1] is None
    assert engine.stats.finished == {"abort": 1}  # /metrics tells it from a success
    gone = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))
    assert engine.num_waiting() == 1
    gone.cancelled = True  # its client left while it waited
    assert engine.num_waiting() == 0  # the gauge of /metrics does not count it
    engine.step()
    assert engine.slots == [None] and gone.result.finish_reason == "abort" and gone.result.tokens == []
    assert engine.stats.finished == {"abort": 2} and engine.stats.prompt_tokens == 2  # not prefilled


def test_a_request_whose_client_left_while_it_waited_is_dropped_before_the_next_step():
    """Not when a slot frees for it: its handler (a thread, and the client's socket) was held that long."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    running = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    gone = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))
    gone.cancelled = True
    launch, seen = engine._launch, []

    def first_step_then_stop(requests):
        seen.append((gone.result.finish_reason, gone.events.queue[-1] if gone.events.qsize() else "no event",
                     running.result.finished))
        engine.shutdown()
        return launch(requests)

    engine._launch = first_step_then_stop
    engine.run()
    assert seen == [("abort", None, False)]


def test_a_failing_step_fails_every_request_and_stops_the_engine():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    running = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    waiting = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))

    def broken(*args, **kwargs):
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
    engine = make_engine(SpeculativeDecoder(target, drafter), max_batch=2, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    running = engine.submit([1, 2], params)
    engine.step()
    engine.step()
    failing = engine.submit([3, 4], params)
    prefill = engine.decoder.prefill
    engine.decoder.prefill = lambda *args: (_ for _ in ()).throw(RuntimeError("out of memory"))
    engine.step()
    engine.decoder.prefill = prefill
    assert isinstance(failing.events.get_nowait(), RuntimeError) and engine.slots[1] is None
    assert failing.blocks == [] and len(engine.scheduler.running) == 1
    drain(engine, [running])
    assert running.result.tokens == target_greedy(target, [1, 2], 12)
    assert not engine.stopped.is_set() and engine.stats.finished == {"abort": 1, "length": 1}


@torch.inference_mode()
def test_a_generate_on_the_engines_models_stops_it_instead_of_corrupting_requests():
    """generate sets up caches of its own on the same target: the engine's requests in flight lost
    their context and went on silently with wrong tokens."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    generate(SpeculativeDecoder(target, drafter), [[5]], SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="caches are no longer this StepRunner's"):
        engine.step()


def test_after_shutdown_nothing_waits_forever():
    """A request submitted once the engine stops is refused; those in flight or waiting at shutdown
    receive EngineStopped rather than waiting on events that never come, and count as aborted."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    running = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    waiting = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))
    engine.step()
    engine.shutdown()
    engine.run()
    for request in (running, waiting):
        assert isinstance(request.events.queue[-1], EngineStopped)
    assert engine.stats.finished == {"abort": 2}
    with pytest.raises(EngineStopped):
        engine.submit([4], SamplingParams(max_tokens=2))


def test_without_speculation_the_response_reports_none():
    target, _ = tiny_pair(vocab=64)
    engine = make_engine(SpeculativeDecoder(target, None), max_batch=1, max_model_len=32)
    request = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    with torch.inference_mode():
        drain(engine, [request])
    assert request.result.tokens == target_greedy(target, [1, 2], 5)
    assert speculation([request.result]) is None and engine.stats.drafts == 0


PROMPTS = [list(range(3, 40)), [5, 9, 11, 2, 7], [4], list(range(3, 40)) + [8, 8, 1, 9, 2, 6]]  # the last
LENGTHS = [40, 6, 30, 25]  # extends the first: a cached prefix once the first has run


def small_engine(target, drafter, num_blocks, max_num_batched_tokens=7, **options):  # blocks of 4
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=4)
    return Engine(decoder, max_num_seqs=3, max_model_len=80, block_size=4, num_blocks=num_blocks,
                  max_num_batched_tokens=max_num_batched_tokens, **options)


@torch.inference_mode()
@pytest.mark.parametrize("window, overlap", [(None, False), (3, False), (None, True)])
def test_greedy_output_is_the_targets_through_chunks_preemption_and_prefix_reuse(one_thread, window, overlap):
    """A pool of 30 blocks of 4 for up to three requests of up to 43 + 25 tokens, prompts entering 7
    tokens per step: the long prompts take several chunks, requests join and leave mid-flight, the
    newest give way when blocks run out, and the fourth finds the first's prompt cached. With overlap
    each step is queued before the one before it is read (the host a step behind)."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4, drafter_window=window)
    engine = small_engine(target, drafter, num_blocks=30, overlap=overlap)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    requests = [engine.submit(p, sp) for p, sp in zip(PROMPTS[:3], params)]
    for _ in range(12):
        engine.step()
    requests.append(engine.submit(PROMPTS[3], params[3]))
    drain(engine, requests)
    for request, prompt, n in zip(requests, PROMPTS, LENGTHS):
        assert request.result.tokens == target_greedy(target, prompt, n)
        assert request.result.finish_reason == "length" and request.events.queue[-1] is None
    counters = engine.scheduler.counters
    assert counters.preemptions >= 1 and counters.prefix_hits >= 36  # the first's 9 full prompt blocks
    assert engine.pool.num_free == 29 and not any(engine.slots) and engine.stats.finished == {"length": 4}


@torch.inference_mode()
@pytest.mark.parametrize("overlap", [False, True])
def test_sampled_requests_lose_and_repeat_nothing_when_preempted(one_thread, overlap):
    """Seeded sampled requests in a pool too small for them all (preempted and resumed over and over)
    get exactly the tokens each gets alone in a large pool: nothing produced is lost or repeated, and
    a resumed request's drafter context is its own, recomputed. With overlap, a request preempted
    with a step in flight gets nothing from that step, and recomputes it once resumed."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    params = [SamplingParams(temperature=t, top_p=p, max_tokens=n, seed=i, ignore_eos=True)
              for i, (t, p, n) in enumerate([(1.0, 1.0, 40), (0.7, 0.9, 35), (1.0, 1.0, 30), (1.3, 1.0, 25)])]
    crowded = small_engine(target, drafter, num_blocks=26, overlap=overlap)
    requests = [crowded.submit(p, sp) for p, sp in zip(PROMPTS, params)]
    drain(crowded, requests)
    assert crowded.scheduler.counters.preemptions >= 2
    for request, prompt, sp in zip(requests, PROMPTS, params):
        alone = small_engine(target, drafter, num_blocks=200, enable_prefix_caching=False)
        solo = alone.submit(prompt, sp)
        drain(alone, [solo])
        assert request.result.tokens == solo.result.tokens and len(request.result.tokens) == sp.max_tokens


@torch.inference_mode()
def test_a_full_pool_queues_requests_and_serves_them_all(one_thread):
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = small_engine(target, drafter, num_blocks=26, max_num_batched_tokens=100)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [[i, i + 1, i + 2, i + 3, i + 4] * 7 for i in range(8)]
    requests = [engine.submit(p, params) for p in prompts]
    engine.step()
    assert engine.num_running() == 2 and engine.num_waiting() == 6  # 35 + 5 positions: 10 blocks; 25 usable
    drain(engine, requests)
    for request, prompt in zip(requests, prompts):
        assert request.result.tokens == target_greedy(target, prompt, 30)


def test_what_the_pool_cannot_hold_is_refused_naming_both_numbers():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    with pytest.raises(ValueError, match=r"KV cache holds 76 tokens \(19 blocks of 4\), less than one request of "
                                         r"max_model_len 80 needs \(92"):
        small_engine(target, drafter, num_blocks=20)
    engine = small_engine(target, drafter, num_blocks=30)
    with pytest.raises(ValueError, match="prompt length 79 \\+ max_tokens 2 exceeds the maximum model length 80 "
                                         "\\(the KV cache holds 116 tokens in all\\)"):
        engine.submit([1] * 79, SamplingParams(max_tokens=2))


@torch.inference_mode()
def test_a_cancelled_request_frees_its_blocks_and_slot(one_thread):
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = small_engine(target, drafter, num_blocks=30)
    keep, leave = (engine.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
                   for _ in range(2))
    for _ in range(3):
        engine.step()
    held = engine.pool.num_free
    leave.cancelled = True
    engine.step()
    assert leave.result.finish_reason == "abort" and leave.slot is None and leave.blocks == []
    assert engine.pool.num_free > held and engine.stats.finished == {"abort": 1}
    drain(engine, [keep])
    assert keep.result.tokens == target_greedy(target, [1, 2, 3], 20)


@torch.inference_mode()
def test_logprobs_are_the_targets_log_softmax_at_each_token(one_thread):
    """A sampled request asking for logprobs and prompt_logprobs, its prompt entering in chunks of 5
    and its tokens verified 4 drafts at a time: every prompt token after the first and every generated
    token carries the target's raw log-softmax at its position (computed here by one plain forward),
    with the likeliest alternatives in order. Its prompt is computed whole (the log-probabilities need
    every position), while a request of the same prompt without them finds it cached."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = small_engine(target, drafter, num_blocks=60, max_num_batched_tokens=5)
    prompt = [3, 9, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    asking = engine.submit(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True,
                                                  logprobs=3, prompt_logprobs=2))
    plain = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    drain(engine, [asking, plain])
    ids = torch.tensor([prompt + asking.result.tokens])
    logprobs = target(ids, torch.arange(ids.shape[1])[None])[0][0].log_softmax(-1)
    entries = asking.result.prompt_logprobs[1:] + asking.result.logprobs
    assert asking.result.prompt_logprobs[0] is None and len(entries) == ids.shape[1] - 1
    for position, entry in enumerate(entries):
        torch.testing.assert_close(entry.logprob, logprobs[position, ids[0, position + 1]].item(), atol=1e-5, rtol=0)
        top = logprobs[position].topk(len(entry.top))
        assert [i for i, _ in entry.top] == top.indices.tolist()
        torch.testing.assert_close([v for _, v in entry.top], top.values.tolist(), atol=1e-5, rtol=0)
    assert [len(e.top) for e in entries] == [2] * (len(prompt) - 1) + [3] * 12
    assert asking.num_cached == 0 and plain.num_cached == 8 and plain.result.logprobs is None


def test_logprobs_are_asked_in_range_and_given_by_generate_too():
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (-1, 21, 1.5, True):
            with pytest.raises(ValueError, match=f"{name} must be an int in \\[0, 20\\] or None"):
                SamplingParams(**{name: bad})
    target, drafter = tiny_pair(vocab=64, block_size=4)
    result = generate(SpeculativeDecoder(target, drafter), [[1, 2]], SamplingParams(logprobs=1, max_tokens=5))[0]
    assert len(result.logprobs) == len(result.tokens) == 5 and all(len(e.top) == 1 for e in result.logprobs)


@torch.inference_mode()
@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_output_is_the_targets_whatever_k_each_step_verifies(one_thread, overlap):
    """Steps verifying 7, 0, 1, 3 drafts in turn (a step at 0 drafts nothing; the next one draws the
    drafts again from its anchor): the target's greedy tokens, and the acceptance counted per step."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=7)
    engine = make_engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=7), max_batch=3,
                         k_choices=[0, 1, 3, 7], overlap=overlap)
    cycle = iter([7, 0, 1, 3] * 100)
    engine.speculation.choose = lambda bucket, greedy: next(cycle)
    prompts = [[1, 2, 3], [5, 9, 11, 2, 7], [4]]
    requests = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)) for p in prompts]
    drain(engine, requests)
    for request, prompt in zip(requests, prompts):
        assert request.result.tokens == target_greedy(target, prompt, 40)
    stats = engine.stats
    # draft blocks are counted per row and step: the steps at 0 verified none, those at 1 and 3 fewer than 7
    assert stats.drafts < 3 * stats.steps and stats.draft_tokens < 7 * stats.drafts


def test_each_step_verifies_the_k_expected_to_give_the_most_tokens_per_second():
    step_k = StepK(7, [0, 1, 3, 7])
    for k in (7, 3, 1, 0):  # nothing measured: the largest first, each run twice (its first step is not measured)
        for _ in range(2):
            assert step_k.choose(4) == k
            step_k.observe(4, k, {0: 1.0, 1: 1.2, 3: 1.5, 7: 2.0}[k], accepted=[min(k, 5)] * 8)  # all but the 6th
    assert 5 < step_k.expected_tokens(7) < 7 and step_k.choose(4) == 7  # about 6 / 2.0 beats 4 / 1.5
    slow = StepK(7, [0, 1, 3, 7])
    for k in (7, 7, 3, 3, 1, 1, 0, 0):
        slow.choose(4)
        slow.observe(4, k, {0: 1.0, 1: 1.9, 3: 2.5, 7: 4.0}[k], accepted=[0] * 8)  # drafts never accepted
    assert slow.choose(4) == 0 and slow.choose(8) == 7  # another bucket is measured on its own
    for _ in range(200):  # a choice not taken for a while is measured again
        slow.observe(4, 0, 1.0, accepted=[])
    assert slow.choose(4) == 7
    # greedy batches' acceptance is counted apart: drafts always accepted there, never in sampled batches
    mixed = StepK(7, [0, 7])
    for k in (7, 7, 0, 0):
        mixed.choose(4)
        mixed.observe(4, k, {0: 1.0, 7: 2.0}[k], accepted=[7] * 8 if k else [], greedy=True)
    for k in [7] * 50 + [0, 0]:
        mixed.observe(4, k, {0: 1.0, 7: 2.0}[k], accepted=[0] * 8 if k else [])  # sampled rows
    assert mixed.expected_tokens(7, greedy=True) > 6 and mixed.expected_tokens(7) < 1.5
    assert mixed.choose(4, greedy=True) == 7 and mixed.choose(4) == 0
    # and their step costs: a sampled step draws noise and keeps the proposals' statistics
    split = StepK(7, [0, 7])
    for greedy, drafting in ((True, 1.2), (False, 5.0)):
        for k in (7, 7, 0, 0):
            split.observe(4, k, {0: 1.0, 7: drafting}[k], accepted=[3] * 8 if k else [], greedy=greedy)
    assert split.choose(4, greedy=True) == 7 and split.choose(4) == 0  # about 4 / 1.2 and 4 / 5.0 against 1 / 1.0
    with pytest.raises(ValueError, match=r"must be in \[0, 7\]"):
        StepK(7, [8])
    assert default_k_choices(7) == [0, 1, 3, 7] and default_k_choices(2) == [0, 1, 2] and StepK(7, [7]).choose(1) == 7



def test_a_choices_first_step_is_not_measured():
    step_k = StepK(7, [0, 7])
    step_k.observe(1, 7, 30.0, accepted=[7])  # kernels built for new shapes, a graph captured: paid once
    assert step_k.choose(1) == 7  # not measured yet: it runs again
    step_k.observe(1, 7, 1.0, accepted=[7])
    assert step_k.cost[(1, 7, False)] == 1.0


def test_a_close_rival_is_measured_again_sooner_than_a_distant_one():
    def taken(cost: dict[int, float], steps: int) -> list[int]:
        step_k, ks = StepK(7, [0, 3, 7]), []
        step_k.ran.update((1, k, False) for k in cost)  # as if each had run a step already (a first step is not measured)
        for _ in range(500):  # drafts always accepted: K = 7 yields about twice K = 3's tokens
            step_k.acceptance[False].observe(7, [7])
        for _ in range(steps):
            ks.append(step_k.choose(1))
            step_k.observe(1, ks[-1], cost[ks[-1]], accepted=[ks[-1]])
        return ks

    ks = taken({0: 1.0, 3: 1.1, 7: 2.0}, 210)  # K = 3 within 15% of K = 7's rate, K = 0 far behind
    assert ks[:3] == [7, 3, 0]
    again = [i for i, k in enumerate(ks) if k == 3]
    assert [b - a for a, b in zip(again, again[1:])][:4] == [9, 17, 33, 65]  # 8, 16, 32, 64 steps without it
    assert ks.index(0, 3) == 203  # the distant one after DRIFT (200) steps
    slow_3 = taken({0: 1.0, 3: 2.0, 7: 2.0}, 150)  # K = 3 half K = 7's rate: not measured again
    assert slow_3.count(3) == 1 and slow_3.count(0) == 1

def test_the_best_choice_beaten_after_an_unlucky_step_is_measured_again_soon():
    step_k, ks = StepK(7, [3, 7]), []
    step_k.ran.update((1, k, False) for k in (3, 7))
    for _ in range(500):  # drafts always accepted: K = 7 yields about twice K = 3's tokens
        step_k.acceptance[False].observe(7, [7])
    unlucky = None
    for step in range(300):  # K = 7 the best (about 8 / 2.0 against 4 / 1.05), taken for 100 steps and more
        ks.append(step_k.choose(1))
        if unlucky is None and ks[-1] == 7 and step > 100:
            unlucky = step  # its cost's average goes to 2.2: K = 3 ahead, K = 7 within 5% of it
        step_k.observe(1, ks[-1], {3: 1.05, 7: 3.0 if step == unlucky else 2.0}[ks[-1]], accepted=[ks[-1]])
    assert ks[unlucky + 1] == 3 and 7 in ks[unlucky + 2:unlucky + 20]  # again after 8 or 16 steps, not 200


@torch.inference_mode()
def test_k_per_step_is_timed_by_the_engines_pace_from_read_to_read(one_thread, monkeypatch):
    """StepK gets the seconds from one step's read to the next's (the host's work included), and no
    time for a step read first after an iteration without a read, or after prompt chunks or drafts
    drawn again (after a step at K = 0) ran since the read before: those costs are not the step's."""
    import dspark.engine.engine as engine_module
    clock = iter(range(10**6))  # each reading of the clock one second after the last: a pace reads 1.0
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: float(next(clock)),
                                                                monotonic=time.monotonic))
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=2,
                         k_choices=[0, 4], overlap=False)
    ks = iter([4, 4, 4, 0, 4, 4, 4, 4] + [4] * 100)
    engine.speculation.choose = lambda bucket, greedy: next(ks)
    paces = []
    observe = engine.speculation.observe
    engine.speculation.observe = lambda bucket, k, seconds, accepted, greedy: (
        paces.append(seconds), observe(bucket, k, seconds, accepted, greedy))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = engine.submit([1, 2, 3], params)
    for _ in range(7):  # the prompt, then six steps (the fourth at K = 0)
        engine.step()
    second = engine.submit([4, 5], params)
    for _ in range(3):  # a step with the second prompt's chunk, then two more steps
        engine.step()
    assert paces == [None, 1.0, 1.0, 1.0, None, 1.0, 1.0, None, 1.0]
    assert first.status is second.status is Status.DECODING


@torch.inference_mode()
def test_a_request_with_a_seed_draws_the_same_tokens_whatever_k_the_engine_would_choose(one_thread):
    """Its steps verify all K, so its tokens are those of a fixed-K engine; a request without a seed
    in the same engine takes the K chosen per step."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=7)
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=11, ignore_eos=True)
    fixed = make_engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=7))
    alone = fixed.submit([2, 7, 1], params)
    drain(fixed, [alone])
    adaptive = make_engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=7), k_choices=[0, 1, 3, 7])
    chosen = []
    adaptive.speculation.choose = lambda bucket, greedy: chosen.append(1) or 1
    unseeded = adaptive.submit([2, 7, 1], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True))
    drain(adaptive, [unseeded])
    assert chosen and unseeded.result.accepted_per_position[1:] == [0] * 6  # its steps verified one draft
    chosen.clear()
    seeded = adaptive.submit([2, 7, 1], params)
    drain(adaptive, [seeded])
    assert seeded.result.tokens == alone.result.tokens and not chosen


@torch.inference_mode()
def test_a_long_mixed_run_compiles_nothing_after_the_warm_up(one_thread, monkeypatch):
    """A compiled engine choosing K per step, warmed up (every bucket, sampling variant and K): then
    twenty requests of other lengths and sampling parameters, joining and leaving, their prompts in
    chunks, K changing step to step, compile no step again (Dynamo's graphs counted; its eager
    backend, as what is counted is Dynamo's compilations, not Inductor's code)."""
    from torch._dynamo.utils import counters
    from dspark.compile.warmup import warm_up
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, **{**options, "backend": "eager"}))
    torch._dynamo.reset()
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4, compile=True), max_batch=2,
                         k_choices=[0, 2, 4], max_num_batched_tokens=8)
    warm_up(engine.runner, [0, 2, 4])
    graphs = counters["stats"]["unique_graphs"]
    cycle = iter([4, 0, 2] * 1000)
    engine.speculation.choose = lambda bucket, greedy: next(cycle)
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True)]
    requests = [engine.submit([1 + i % 7] * (2 + i % 11), params[i % 3]) for i in range(20)]
    drain(engine, requests)
    assert all(len(r.result.tokens) == r.params.max_tokens for r in requests)
    assert counters["stats"]["unique_graphs"] == graphs


@torch.inference_mode()
def test_with_overlap_a_finished_requests_next_step_runs_and_hands_it_nothing(one_thread):
    """Each step is queued before the one before it is read: a request ending in a step has already
    run in the next one, whose tokens it never gets (nor does /metrics count them), and its slot and
    blocks go to a request admitted meanwhile without that step's outputs reaching the newcomer."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = make_engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=1, overlap=True)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    first = engine.submit([1, 2, 3], params)
    steps = []
    launch = engine._launch
    engine._launch = lambda requests: steps.append([r is first for r in requests]) or launch(requests)
    second = engine.submit([4, 5], params)  # waits for the one slot
    drain(engine, [first, second])
    events = list(first.events.queue)
    assert sum(map(len, events[:-1])) == 9 and events[-1] is None and first.result.tokens == target_greedy(target, [1, 2, 3], 9)
    assert steps.count([True]) > len(first.result.accepted_per_position) // 4  # it ran a step past its end
    assert second.result.tokens == target_greedy(target, [4, 5], 9)
    assert engine.stats.generation_tokens == 18


@torch.inference_mode()
def test_generate_streams_each_prompts_tokens_and_raises_what_its_prefill_raised(monkeypatch):
    """dspark.engine.generate is a client of the engine: on_tokens hears every prompt's tokens in
    order (they add up to its result), and a prompt chunk that fails (the engine hands the error to
    its requests and goes on) fails the call."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=4)
    streamed = {0: [], 1: []}
    params = [SamplingParams(temperature=t, max_tokens=9, seed=3, ignore_eos=True) for t in (0.0, 1.0)]
    results = generate(decoder, [[1, 2, 3], [4]], params, on_tokens=lambda i, tokens: streamed[i].extend(tokens))
    assert [streamed[0], streamed[1]] == [r.tokens for r in results] and [len(r.tokens) for r in results] == [9, 9]
    assert results[0].tokens == target_greedy(target, [1, 2, 3], 9)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(decoder, "prefill", out_of_memory)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        generate(decoder, [[1, 2]])
    assert target.kv_block_size is None  # the caches freed all the same
