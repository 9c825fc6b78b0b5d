"""The serving engine is lossless: requests served through Engine draw their first three tokens from
the target's exact law, checked as the decoder's are (test_decoder's checks, with a power of its own
at its smaller N), with a negative control that fails them. The engine is set up so that everything
it does to a request happens many times over: continuous batching (requests admitted while others
decode, of other lengths and sampling parameters around them), prompts entering in chunks of a
small token budget, the shared prompt's first block found in the prefix cache, requests preempted
when the small pool runs out and recomputed, and the number of drafts a step verifies changing from
step to step.

`serve` is the one place these tests drive the engine, through its public calls only."""
from __future__ import annotations

import itertools
import threading

import numpy as np
import torch

from dspark import SamplingParams, SpeculativeDecoder
from dspark.output import GenerationResult
from dspark.engine import Engine
from stats import POWER, design, noncentrality, power
from test_decoder import (TopPOnDrafts, assert_first_three_match, assert_first_two_differ, first_three_checks,
                          first_three_counts, target_joint_law, tiny_pair, top_p_on_drafts)

MAX_MODEL_LEN = 32
PROMPT = [3, 7, 1]
N_REQUESTS = 3000  # counted requests (a served request costs several times a generate row)
N_CONTROL = 2000
DETECTS = {"all three": 0.12, "first two": 0.115, "first token": 0.085}  # TV, probability 0.99 (stats.design)
MAX_BATCH = 256
BLOCK_SIZE, NUM_BLOCKS = 2, 40  # a request holds 4-6 blocks: 6 to 9 run at once, the newest giving way
BUDGET = 8  # prompt tokens per engine step: some prompts of 3 and 4 tokens enter in chunks
K_CYCLE = [4, 0, 2, 4, 1, 3]  # the drafts the steps verify, in turn


def serve(decoder: SpeculativeDecoder, prompts: list[list[int]], params: list[SamplingParams],
          max_batch: int = MAX_BATCH) -> list[GenerationResult]:
    """Serves the prompts with an Engine run in a thread: submits them all, waits for each one's events
    to end (raising a request's exception), shuts the engine down, returns the results in order. The
    steps verify K_CYCLE's drafts in turn, for the seeded requests too (their seeds key the noise; what
    is checked is the law, which the number of drafts verified does not change)."""
    engine = Engine(decoder, max_batch=max_batch, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                    num_blocks=NUM_BLOCKS, max_num_batched_tokens=BUDGET, k_choices=sorted(set(K_CYCLE)))
    cycle = itertools.cycle(K_CYCLE)
    engine.speculation.choose = lambda bucket, greedy: next(cycle)
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    try:
        requests = [engine.submit(prompt, p) for prompt, p in zip(prompts, params)]
        for request in requests:
            request.seeded = False
        for request in requests:
            while (event := request.events.get(timeout=600)) is not None:
                if isinstance(event, Exception):
                    raise event
    finally:
        engine.shutdown()
        thread.join(timeout=600)
    counters = engine.scheduler.counters
    assert counters.preemptions > 0 and counters.prefix_hits > 0  # the paths these tests are for were taken
    return [request.result for request in requests]


def served_first_three(decoder: SpeculativeDecoder, params: SamplingParams, n: int, seed: int) -> np.ndarray:
    """Counts [V^3] of the first three tokens of n requests of PROMPT with `params` (seeds seed n + i),
    served with a filler request after every fourth: another prompt, length and temperature, not counted."""
    prompts, all_params, counted = [], [], []
    for i in range(n):
        prompts.append(PROMPT)
        all_params.append(SamplingParams(**{**params.__dict__, "seed": seed * n + i}))
        counted.append(len(prompts) - 1)
        if i % 4 == 3:
            prompts.append([5, 9, 11, 2][:1 + i % 4])
            all_params.append(SamplingParams(temperature=float(i % 2), max_tokens=3 + i % 6, seed=-1 - i,
                                             ignore_eos=True))
    results = serve(decoder, prompts, all_params)
    return first_three_counts([results[i].tokens for i in counted], decoder.target.config.vocab_size)


@torch.inference_mode()
def test_served_requests_follow_the_target(rng_seed, one_thread):
    """Block verification, T = 0.7, top-p 0.9, K = 4 (the decoder's tests cover the rest): N_REQUESTS counted requests among fillers pass the decoder's checks
    of the first three tokens, each detecting the total-variation error DETECTS states (df 126, 90
    and 8)."""
    target, drafter = tiny_pair()
    law = target_joint_law(target, PROMPT, 0.7, 0.9)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=4, rejection_sample_method="block")
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=3, ignore_eos=True)
    counts = served_first_three(decoder, params, N_REQUESTS, rng_seed)
    assert_first_three_match(counts, law, "served", DETECTS)


@torch.inference_mode()
def test_served_top_p_on_the_drafts_fails(monkeypatch, rng_seed, one_thread):
    """The control: requests served by TopPOnDrafts (top-p applied to the drafts' law instead of the
    target's) fail the first-two check, with probability >= 0.99 by its exact law (N_CONTROL)."""
    target, drafter = tiny_pair()
    law = target_joint_law(target, PROMPT, 0.7, 0.9)
    wrong = first_three_checks(target_joint_law(target, PROMPT, 0.7, 0.9, later_top_p=1.0))["first two"]
    probs = first_three_checks(law)["first two"]
    assert power(noncentrality(wrong, probs, N_CONTROL), design(probs, N_CONTROL).df) >= POWER
    top_p_on_drafts(monkeypatch, 0.9)
    decoder = TopPOnDrafts(target, drafter, num_speculative_tokens=4, rejection_sample_method="block")
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=3, ignore_eos=True)
    counts = served_first_three(decoder, params, N_CONTROL, rng_seed)
    assert_first_two_differ(counts, law, "served, top-p on drafts", checks=("first two",))
