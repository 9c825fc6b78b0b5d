"""Offline generation as a client of the engine: the prompts are submitted to an Engine sized for
them, and its loop runs on the caller's thread until every one is done (nano-vllm's LLM.generate
over LLMEngine.step). The server, `python -m dspark.generate`, `dspark.eval` and the training data
all decode through this one loop."""
from __future__ import annotations

from typing import Callable

import torch

from dspark.compile.runner import blocks_per_request
from dspark.decoder import SpeculativeDecoder
from dspark.engine.engine import Engine
from dspark.kv_cache import KV_BLOCK_SIZE
from dspark.output import GenerationResult
from dspark.sampling import SamplingParams


class _Events:
    """Request i's events: its new tokens go to on_tokens(i, tokens); a failure is kept to raise."""

    def __init__(self, index: int, on_tokens: Callable[[int, list[int]], None] | None):
        self.index, self.on_tokens, self.error = index, on_tokens, None

    def put(self, item) -> None:
        if isinstance(item, Exception):
            self.error = item
        elif item and self.on_tokens is not None:
            self.on_tokens(self.index, item)


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


@torch.inference_mode()
def generate(decoder: SpeculativeDecoder, prompts: list[list[int]],
             params: SamplingParams | list[SamplingParams] | None = None,
             on_tokens: Callable[[int, list[int]], None] | None = None, cuda_graphs: bool | None = None,
             **engine_options) -> list[GenerationResult]:
    """Decodes every prompt (token ids) to completion with its SamplingParams (one for all, or one
    per prompt) -> a GenerationResult per prompt. `on_tokens(i, new_tokens)` streams prompt i's
    tokens as they are accepted. The engine runs every prompt at once (max_num_seqs = the number of
    prompts) in a KV cache that holds them all, so nothing is preempted, and prefills them all in its
    first iteration (max_num_batched_tokens = their tokens); `engine_options` go to Engine
    (max_num_batched_tokens, enable_prefix_caching, k_choices, overlap, ...). cuda_graphs: replay
    the steps from CUDA graphs (default: on CUDA). A compiled
    decoder's cache and block table are sized in powers of two, so that its step graphs, which are
    specialized to their shapes, serve many calls; it keeps its caches after the call, an eager one
    frees them."""
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    for i, prompt in enumerate(prompts):
        decoder.check_prompt(prompt, f"prompt {i}")
    params = SamplingParams() if params is None else params
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    stray = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if stray is not None:
        raise ValueError(f"params must be SamplingParams, got {type(stray).__name__} {stray!r:.80}")
    lengths = [len(p) + sp.max_tokens for p, sp in zip(prompts, params)]
    limit = decoder.target.config.max_position_embeddings
    if max(lengths) > limit:
        raise ValueError(f"prompt length + max_tokens = {max(lengths)} exceeds the model's "
                         f"max_position_embeddings {limit}")
    block_size = engine_options.pop("block_size", KV_BLOCK_SIZE)
    engine_options.setdefault("max_num_batched_tokens", sum(map(len, prompts)))
    max_model_len, lookahead = max(lengths), 2 * (decoder.k + 1)
    num_blocks = 1 + sum(blocks_per_request(n, decoder.k, block_size) for n in lengths)
    if decoder.compiled:
        width = _power_of_two(blocks_per_request(max_model_len, decoder.k, block_size))
        max_model_len = min(width * block_size - lookahead, limit)
        num_blocks = _power_of_two(max(num_blocks, 1 + width))
    engine = Engine(decoder, max_num_seqs=len(prompts), max_model_len=max_model_len, cuda_graphs=cuda_graphs,
                    block_size=block_size, num_blocks=num_blocks, **engine_options)
    events = [_Events(i, on_tokens) for i in range(len(prompts))]
    requests = [engine.submit(prompt, sp, events=e) for prompt, sp, e in zip(prompts, params, events)]
    try:
        while not all(r.result.finished for r in requests):
            engine.step()
            failed = next((e.error for e in events if e.error is not None), None)
            if failed is not None:
                raise failed
    finally:
        if not decoder.compiled:  # an eager target's forward is a plain causal forward again
            decoder.target.drop_caches()
            if decoder.drafter is not None:
                decoder.drafter.drop_caches()
    return [r.result for r in requests]
