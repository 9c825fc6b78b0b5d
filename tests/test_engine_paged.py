"""The engine over paged KV caches: what a request gets does not depend on how its prompt was cut
into chunks, on being preempted and resumed, on a prefix found in the cache or on the requests
around it; the pool's limits queue requests instead of failing them."""
from __future__ import annotations

import pytest
import torch

from dspark import SamplingParams, SpeculativeDecoder
from dspark.engine import Engine
from test_decoder import target_greedy, tiny_pair


def drain(engine: Engine, requests) -> int:
    """Steps the engine in this thread until every request has finished -> the steps taken."""
    steps = 0
    while not all(r.result.finished or r.cancelled for r in requests):
        engine.step()
        steps += 1
    return steps


PROMPTS = [list(range(3, 40)), [5, 9, 11, 2, 7], [4], list(range(3, 40)) + [8, 8, 1, 9, 2, 6]]  # the last
LENGTHS = [40, 6, 30, 25]  # extends the first: a cached prefix once the first has run


def small_engine(target, drafter, num_blocks, max_num_batched_tokens=7, **options):
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=4)
    return Engine(decoder, max_num_seqs=3, max_model_len=80, block_size=4, num_blocks=num_blocks,
                  max_num_batched_tokens=max_num_batched_tokens, **options)


@torch.inference_mode()
@pytest.mark.parametrize("window", [None, 3])
def test_greedy_output_is_the_targets_through_chunks_preemption_and_prefix_reuse(one_thread, window):
    """A pool of 30 blocks of 4 for up to three requests of up to 43 + 25 tokens, prompts entering 7
    tokens per step: the long prompts take several chunks, requests join and leave mid-flight, the
    newest give way when blocks run out, and the fourth finds the first's prompt cached."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4, drafter_window=window)
    engine = small_engine(target, drafter, num_blocks=30)
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
def test_sampled_requests_lose_and_repeat_nothing_when_preempted(one_thread):
    """Seeded sampled requests in a pool too small for them all (preempted and resumed over and over)
    get exactly the tokens each gets alone in a large pool: nothing produced is lost or repeated, and
    a resumed request's drafter context is its own, recomputed."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    params = [SamplingParams(temperature=t, top_p=p, max_tokens=n, seed=i, ignore_eos=True)
              for i, (t, p, n) in enumerate([(1.0, 1.0, 40), (0.7, 0.9, 35), (1.0, 1.0, 30), (1.3, 1.0, 25)])]
    crowded = small_engine(target, drafter, num_blocks=26)
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
                                         r"max_model_len 80 needs \(88"):
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
