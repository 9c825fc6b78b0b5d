"""dspark.compile: the static batch and its buckets (StepRunner), the compile cache, the warm-up.

A CUDA graph of the step is captured after two warm-up runs with the same inputs; that a rerun
changes nothing (once the overwritten proposals are put back) is checked here on the CPU, the graphs
themselves by the `gpu` test. The warm-up must compile every graph a server's steps need: after it,
steps of every bucket and sampling variant compile nothing more."""
from __future__ import annotations

import json

import pytest
import torch
from torch._dynamo.utils import counters

from dspark import SamplingParams, SpeculativeDecoder
from dspark.compile.cache import compiled_for, load_compile_cache, save_compile_cache
from dspark.compile.runner import IDLE, StepRunner, default_buckets
from dspark.compile.warmup import VARIANTS, warm_up
from dspark.engine import Engine
from test_decoder import target_greedy, tiny_pair
from test_engine import drain

SAMPLED = SamplingParams(temperature=1.0, seed=7)


def test_buckets_are_powers_of_two_up_to_the_batch():
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(1) == [1]


def test_bad_buckets_and_cpu_graphs_are_refused():
    target, drafter = tiny_pair()
    decoder = SpeculativeDecoder(target, drafter)
    with pytest.raises(ValueError, match="end at max_batch 4"):
        StepRunner(decoder, 4, 8, 33, 4, buckets=[1, 2])
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StepRunner(decoder, 4, 8, 33, 4, cuda_graphs=True)
    with pytest.raises(ValueError, match="not one of the buckets"):
        StepRunner(decoder, 4, 8, 33, 4).step(3)


def prefilled_runner(k=4):
    """A runner of 4 slots with blocks of 4, slots 0..2 prefilled (slot 1 greedy, the others sampled)
    and drafted, each in 3 blocks of its own."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=k)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=k)
    runner = StepRunner(decoder, 4, 3, 10, 4)
    params = [SAMPLED, SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3), IDLE]
    runner.set_params(params)
    for slot, prompt in enumerate([[1, 2, 3], [5, 9, 11, 2], [4]]):
        blocks = [1 + 3 * slot, 2 + 3 * slot, 3 + 3 * slot]
        runner.set_blocks(slot, blocks)
        runner.tokens[slot, 0] = runner.prefill([prompt], [0], [blocks], [params[slot]])[0][0]
        runner.start[slot] = len(prompt)
    runner.draft(range(4))
    return runner


def cache_state(runner):
    buffers = [b.clone() for m in (runner.decoder.target, runner.decoder.drafter) for b in m.buffers()]
    return buffers + [runner.draft_probs.clone()]


@torch.inference_mode()
def test_a_rerun_with_the_proposals_put_back_changes_nothing(one_thread):
    """What a CUDA graph's capture assumes (StepRunner._capture): two warm-up runs with the
    proposals restored after each, then the recorded run, give what one run gives."""
    once = prefilled_runner()
    *want, logprobs = once.step(4)
    want = [t.clone() for t in want]
    assert logprobs is None  # no request asked for them
    twice = prefilled_runner()
    proposals = twice.draft_probs.clone()
    for _ in range(2):
        twice.step(4)
        twice.draft_probs.copy_(proposals)
    got = twice.step(4)[:4]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(cache_state(twice), cache_state(once)))


@torch.inference_mode()
def test_the_engine_steps_the_smallest_bucket_that_holds_its_requests(one_thread, monkeypatch):
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=4, max_model_len=64)
    batches = []
    step = engine.runner.step
    monkeypatch.setattr(engine.runner, "step", lambda batch, k: batches.append(batch) or step(batch, k))
    greedy = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
              for p, n in (([1, 2, 3], 3), ([5, 9], 30), ([4], 30))]
    engine.step()  # the three prompts: slots 0..2
    engine.step()
    assert batches == [4]  # slots 0..2: bucket 4
    drain(engine, greedy[:1])  # slot 0 leaves; slots 1, 2 still need bucket 4
    assert batches[-1] == 4 and engine.slots[0] is None
    late = engine.submit([8, 8, 1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    engine.step()  # into the lowest free slot, 0
    assert engine.slots[0] is late
    drain(engine, greedy + [late])
    for request, (prompt, n) in zip(greedy + [late], (([1, 2, 3], 3), ([5, 9], 30), ([4], 30), ([8, 8, 1], 5))):
        assert request.result.tokens == target_greedy(target, prompt, n)
    solo = engine.submit([2, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    drain(engine, [solo])
    assert batches[-1] == 1  # alone in row 0: bucket 1


@torch.inference_mode()
def test_rows_that_leave_stop_counting_for_the_sampling_variant(one_thread):
    """Once the sampled request has left, the batch is all greedy: the step takes the greedy graph
    (no noise, no proposals), and the greedy request still gets the target's greedy tokens."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=2, max_model_len=64)
    greedy = engine.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    sampled = engine.submit([4, 5], SamplingParams(temperature=1.0, max_tokens=3, seed=1, ignore_eos=True))
    engine.step(), engine.step()  # the prompts, then a step (which hands the runner its slots' parameters)

    def all_greedy():
        return engine.runner.sampling(slice(0, 2), engine.runner.params[:2]).all_greedy

    assert not all_greedy()
    drain(engine, [sampled])
    engine.step()  # (a step hands the runner the parameters of the slots that changed hands)
    assert engine.slots[1] is None and all_greedy() and not greedy.result.finished
    drain(engine, [greedy])
    assert greedy.result.tokens == target_greedy(target, [1, 2, 3], 20)


def test_the_compile_cache_round_trips_and_names_a_mismatch(tmp_path):
    compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    x = torch.randn(8)
    want = compiled(x)
    path, options = tmp_path / "cache.bin", {"max_batch": 8, "model": "default"}
    assert save_compile_cache(path, x.device, options) > 0
    header, _ = path.read_bytes().split(b"\n", 1)
    assert json.loads(header) == compiled_for(x.device, options)
    load_compile_cache(path, x.device, options)
    assert torch.equal(compiled(x), want)
    with pytest.raises(ValueError, match=r"other max_batch .*\(8, 16\)"):
        load_compile_cache(path, x.device, {**options, "max_batch": 16})
    other = tmp_path / "other.bin"
    other.write_bytes(json.dumps({**compiled_for(x.device), "torch": "1.0"}).encode() + b"\n" + b"x")
    with pytest.raises(ValueError, match="other torch .*'torch': \\('1.0', "):
        load_compile_cache(other, x.device)
    for junk in (b"not a header\n", b"\x80\xff binary\n", b"[1, 2]\n"):
        (tmp_path / "junk.bin").write_bytes(junk)
        with pytest.raises(ValueError, match="not a dspark compile cache"):
            load_compile_cache(tmp_path / "junk.bin", x.device)
    cut = tmp_path / "cut.bin"  # as a warm-up killed while writing once left it: loaded as nothing, silently
    cut.write_bytes(path.read_bytes()[:len(header) + 1 + 40])
    with pytest.raises(ValueError, match="cut.bin: its compiled code does not load"):
        load_compile_cache(cut, x.device, options)
    assert not list(tmp_path.glob("*.tmp"))  # save_compile_cache wrote through a temporary file


@torch.inference_mode()
def test_after_the_warm_up_no_step_compiles_again(tmp_path):
    """Two buckets x three sampling variants; then a step of each, in another state, compiles
    nothing. (That the compiled step decodes as the eager one: test_decoder.)"""
    torch._dynamo.reset()
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=3)
    runner = StepRunner(SpeculativeDecoder(target, drafter, num_speculative_tokens=3, compile=True), 2, 9, 19, 4)
    timings = warm_up(runner)
    assert [(name, batch) for name, batch, _ in timings] == [(n, b) for n in VARIANTS for b in (1, 2)]
    assert save_compile_cache(tmp_path / "cache.bin", runner.tokens.device) > 0
    graphs = counters["stats"]["unique_graphs"]
    for slot, prompt in enumerate([[1, 2, 3], [4]]):
        runner.set_blocks(slot, [1 + slot, 3 + slot])
        runner.prefill([prompt], [0], [[1 + slot, 3 + slot]], None)
    runner.start[:2] = torch.tensor([3, 1])
    for params in ([SamplingParams(temperature=0.0)] * 2, [IDLE, SAMPLED],
                   [SamplingParams(temperature=0.5, top_k=5, seed=1), IDLE]):
        runner.set_params(params)
        runner.draft([0, 1])
        for batch in (1, 2):
            runner.step(batch)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@torch.inference_mode()
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_cuda_graphs_serve_what_plain_steps_serve(compile):
    """The engine with and without CUDA graphs, the same requests (greedy, seeded sampled, top-p;
    one admitted mid-flight, so the bucket grows and shrinks): the same tokens, and graphs were
    captured for several buckets and sampling variants."""
    results = []
    for cuda_graphs in (False, True):
        target, drafter = (m.cuda() for m in tiny_pair(vocab=64, logit_std=1.0, block_size=4))
        decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=4, compile=compile)
        engine = Engine(decoder, max_batch=4, max_model_len=64, cuda_graphs=cuda_graphs)
        params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),  # the last one left
                  SamplingParams(temperature=1.0, max_tokens=8, seed=7, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=5, ignore_eos=True)]
        requests = [engine.submit(p, s) for p, s in zip(([1, 2, 3], [5, 9, 11], [4]), params)]
        engine.step()
        engine.step()
        requests.append(engine.submit([8, 8, 1], SamplingParams(temperature=1.0, max_tokens=5, seed=11,
                                                                ignore_eos=True)))
        drain(engine, requests)
        results.append([r.result.tokens for r in requests])
    assert results[0] == results[1]
    assert {1, 4} <= {key[0] for key in engine.runner.graphs}  # 4 requests; row 0 alone at the end: bucket 1
