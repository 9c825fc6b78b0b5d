"""Self-distillation: the target answers each training prompt (DeepSpec regenerates responses with the
target too) `responses_per_prompt` times: once greedily, the other times at temperature 1 with
their own seeds. Greedy responses are the paths a T=0 evaluation walks; sampled ones cover what T=1
walks and give more varied prefixes. The loss's TV and KL terms compare the drafter with the
target's full distribution at every position, so for them the sampling temperature chooses only
which prefixes are trained on; its CE term takes the response's own next token as the label.
The responses are appended to a JSONL cache as they are generated, so an interrupted run continues
where it stopped.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from dspark.data import Prompt, Sequence, user_turn_prefix
from dspark.decoder import SpeculativeDecoder
from dspark.engine import generate
from dspark.sampling import SamplingParams
from dspark.target import TargetModel


def synthetic_prompts(target: TargetModel, tokenizer, path: Path, count: int, *, seed: int, max_tokens: int = 96,
                      batch_size: int = 2048, exclude: list[Prompt] = (),
                      stop: Callable[[int], bool] | None = None) -> list[Prompt] | None:
    """`count` user messages the target writes after user_turn_prefix (the first greedy, the others
    at temperature 1 with seeds of their own; cached at `path` like self_distill's responses). Kept:
    those it ends with an end-of-turn token within `max_tokens`, without special tokens inside (a
    turn of the chat template), not blank, each text once, none equal to a prompt of `exclude` (the
    held-out set). Domain "chat". None if `stop` ended the call."""
    prefix = user_turn_prefix(tokenizer)
    sequences, done = self_distill(target, [prefix], path, max_tokens=max_tokens, seed=seed,
                                   stop_token_ids=tokenizer.eos_token_ids, responses_per_prompt=count,
                                   batch_size=batch_size, stop=stop)
    if not done:
        return None
    ends, texts = set(tokenizer.eos_token_ids), []
    for s in sequences:
        body = s.tokens[s.prompt_len:-1]
        text = tokenizer.decode(body)
        if s.tokens[-1] in ends and text == tokenizer.decode(body, skip_special_tokens=True):
            texts.append(text.strip())
    excluded = {p.text for p in exclude}
    return [Prompt(text, "chat") for text in dict.fromkeys(texts) if text and text not in excluded]


def response_params(index: int, responses_per_prompt: int, seed: int, max_tokens: int,
                    stop_token_ids: list[int]) -> SamplingParams:
    """Response `index` answers prompt index // responses_per_prompt: greedily when it is that
    prompt's first response, else at temperature 1 with a seed of its own."""
    return SamplingParams(temperature=float(index % responses_per_prompt > 0), seed=seed * 1_000_003 + index,
                          max_tokens=max_tokens, stop_token_ids=stop_token_ids)


def read_cache(path: Path, settings: dict) -> list[Sequence]:
    """The sequences cached at `path` (none if absent). A half-written last line (an interrupted
    run) is dropped; a cache made with other `settings` is an error."""
    lines = path.read_text().splitlines() if path.exists() else []
    if not lines:
        return []
    header = json.loads(lines[0])
    if header != settings:
        raise ValueError(f"{path} was generated with {header}, not {settings}; use another cache path or delete it")
    sequences = []
    for line in lines[1:]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        sequences.append(Sequence(row["tokens"], row["prompt_len"]))
    return sequences


def _cache_line(sequence: Sequence) -> str:
    return json.dumps({"prompt_len": sequence.prompt_len, "tokens": sequence.tokens}) + "\n"


def self_distill(target: TargetModel, prompts: list[list[int]], path: Path, *, max_tokens: int, seed: int,
                 stop_token_ids: list[int], responses_per_prompt: int = 1, batch_size: int = 64,
                 stop: Callable[[int], bool] | None = None,
                 progress: Callable[[int], None] | None = None) -> tuple[list[Sequence], bool]:
    """Generates `responses_per_prompt` target responses to every prompt (rendered token ids; see
    response_params), `batch_size` per batch, appending each batch to the JSONL cache at `path`.
    Batches take the prompts in order of length, so a batch's KV cache is as short as its longest
    prompt allows and its prefill has few distinct lengths; on CUDA each batch's steps replay a
    CUDA graph (eager steps of 2048 rows are bound by their launches: `python -m bench.engine_step
    --batches 2048`). Before each batch `stop(number of
    responses so far)` may end the call; `progress(n)` hears of n more responses. Returns the
    sequences (all of them in prompt order, or those so far) and whether all are done."""
    if responses_per_prompt < 1:
        raise ValueError(f"responses_per_prompt must be >= 1, got {responses_per_prompt}")
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    settings = {"prompts": digest, "num_prompts": len(prompts), "responses_per_prompt": responses_per_prompt,
                "max_tokens": max_tokens, "seed": seed, "order": "length", "stop_token_ids": list(stop_token_ids),
                "dtype": str(target.embed_tokens.weight.dtype)}  # bfloat16 answers differ from float32 ones
    prompts = [p for p in prompts for _ in range(responses_per_prompt)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # generation order (stable)
    sequences = read_cache(path, settings)
    if progress is not None:
        progress(len(sequences))
    if len(sequences) == len(prompts):  # complete: read, not written (its folder may be read-only)
        return _in_prompt_order(sequences, order), True
    path.parent.mkdir(parents=True, exist_ok=True)
    decoder = SpeculativeDecoder(target, None)
    rewritten = path.with_suffix(".tmp")  # without a half-written last line; replaces the cache at once
    rewritten.write_text(json.dumps(settings) + "\n" + "".join(_cache_line(s) for s in sequences))
    os.replace(rewritten, path)
    with path.open("a") as cache:
        for begin in range(len(sequences), len(prompts), batch_size):
            if stop is not None and stop(begin):
                return sequences, False
            indices = order[begin:begin + batch_size]
            batch = [prompts[i] for i in indices]
            params = [response_params(i, responses_per_prompt, seed, max_tokens, stop_token_ids) for i in indices]
            for prompt, result in zip(batch, generate(decoder, batch, params)):
                sequences.append(Sequence(prompt + result.tokens, len(prompt)))
                cache.write(_cache_line(sequences[-1]))
            cache.flush()
            if progress is not None:
                progress(len(batch))
    return _in_prompt_order(sequences, order), True


def _in_prompt_order(sequences: list[Sequence], order: list[int]) -> list[Sequence]:
    """The sequences generated in `order` (prompt indices), put back in the prompts' order."""
    ordered = [None] * len(sequences)
    for i, sequence in zip(order, sequences, strict=True):
        ordered[i] = sequence
    return ordered
