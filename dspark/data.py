"""Training data for the drafter, all offline: a prompt corpus and the target's own responses to it.

Prompts come from three places:
- `assets/prompts/train.json`: templates x topics for chat, code, prose and math (math templates are
  filled with seeded random numbers), plus hand-written prompts;
- the Python standard library on this machine: functions to explain or continue, and docstrings and
  `pydoc_data` topics to summarise;
- optionally, the target itself (`synthetic_prompts`): given its chat template up to where a user's
  message begins, an instruction-tuned model writes user messages like those it was tuned on
  (Magpie, Xu et al. 2024), far more varied than templates; the ones it ends itself are kept.
`assets/prompts/heldout.jsonl` is the evaluation set. It uses other topics and templates, and its
code comes from stdlib modules (`HELDOUT_MODULES`) that the training prompts never read.

Self-distillation: the target answers each training prompt (DeepSpec regenerates responses with the
target too) `responses_per_prompt` times: once greedily, the other times at temperature 1 with
their own seeds. Greedy responses are the paths a T=0 evaluation walks; sampled ones cover what T=1
walks and give more varied prefixes. The loss's TV and KL terms compare the drafter with the
target's full distribution at every position, so for them the sampling temperature chooses only
which prefixes are trained on; its CE term takes the response's own next token as the label.
The responses are appended to a JSONL cache as they are generated, so an interrupted run continues
where it stopped.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from pydoc_data.topics import topics as pydoc_topics

from dspark.decoder import SpeculativeDecoder
from dspark.sampling import SamplingParams
from dspark.target import TargetModel

PROMPT_DIR = Path(__file__).parent / "assets" / "prompts"
DOMAINS = ("chat", "code", "math", "prose")
# Modules whose code only the held-out set uses.
HELDOUT_MODULES = ("bisect", "calendar", "colorsys", "fractions", "heapq", "statistics", "textwrap")
# Stdlib folders that are not library code worth imitating (tests, demos, vendored tools).
SKIPPED_STDLIB_DIRS = ("test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages",
                       "__pycache__", "__phello__")
MAX_SNIPPET_LINES = 30
MAX_SNIPPET_CHARS = 1500


@dataclass(frozen=True)
class Prompt:
    text: str
    domain: str  # one of DOMAINS


@dataclass
class Sequence:
    tokens: list[int]  # prompt (chat-templated) + the target's response, its stop token included
    prompt_len: int


# ---------------------------------------------------------------------------- prompts


def template_prompts(path: Path = PROMPT_DIR / "train.json", seed: int = 0) -> list[Prompt]:
    """Every template of a domain filled with every topic of that domain, the math templates with
    `math_per_template` draws of random numbers, and the hand-written prompts."""
    spec = json.loads(path.read_text())
    prompts = []
    for domain, topics in spec["topics"].items():
        prompts += [Prompt(t.format(topic=topic), domain) for t in spec["templates"][domain] for topic in topics]
    rng = random.Random(seed)
    for template in spec["templates"]["math"]:
        for _ in range(spec["math_per_template"]):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            numbers = dict(a=a, b=b, c=a + b + rng.randint(1, 200), p=rng.choice((5, 10, 15, 20, 25, 50, 75)))
            prompts.append(Prompt(template.format(**numbers), "math"))
    prompts += [Prompt(p["text"], p["domain"]) for p in spec["handwritten"]]
    return list(dict.fromkeys(prompts))


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted, without tests, tools and HELDOUT_MODULES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in SKIPPED_STDLIB_DIRS for p in parts[:-1]) or path.stem in HELDOUT_MODULES:
            continue
        files.append(path)
    return files


def _definitions(tree: ast.Module):
    """Module-level functions and classes, and the methods of those classes."""
    for node in tree.body:
        yield node
        if isinstance(node, ast.ClassDef):
            yield from node.body


def _passage(docstring: str | None) -> str | None:
    """A docstring long enough to summarise, cut to MAX_SNIPPET_CHARS."""
    if not docstring or len(docstring) < 300:
        return None
    return docstring.strip()[:MAX_SNIPPET_CHARS]


def prompts_from_source(source: str, rng: random.Random) -> list[Prompt]:
    """Code prompts from the functions of one module (explain one, or continue its first half) and
    prose prompts from its long docstrings."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    prompts = []
    if passage := _passage(ast.get_docstring(tree)):
        prompts.append(Prompt(f"Summarise the following documentation in a few sentences:\n\n{passage}", "prose"))
    for node in _definitions(tree):
        if isinstance(node, ast.ClassDef) and (passage := _passage(ast.get_docstring(node))):
            prompts.append(Prompt(f"Explain this documentation in plain English:\n\n{passage}", "prose"))
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = lines[node.lineno - 1:node.end_lineno]
        code = textwrap.dedent("\n".join(body))
        if not 4 <= len(body) <= MAX_SNIPPET_LINES or len(code) > MAX_SNIPPET_CHARS:
            continue
        if rng.random() < 0.5:
            prompts.append(Prompt(f"Explain what this Python function does:\n\n```python\n{code}\n```", "code"))
        else:
            head = "\n".join(code.splitlines()[:len(body) // 2])
            prompts.append(Prompt(f"Continue this Python code:\n\n```python\n{head}\n```", "code"))
    return prompts


def pydoc_prompts() -> list[Prompt]:
    """Passages of the Python language reference (`pydoc_data.topics`) to explain."""
    return [Prompt("Explain this passage from the Python reference in simple words:\n\n"
                   + text.strip()[:MAX_SNIPPET_CHARS], "prose") for _, text in sorted(pydoc_topics.items())]


def stdlib_prompts(per_module: int = 3, seed: int = 0) -> list[Prompt]:
    """Up to `per_module` prompts from each stdlib module (HELDOUT_MODULES excluded), plus pydoc topics."""
    rng = random.Random(seed)
    prompts = []
    for path in stdlib_files():
        found = prompts_from_source(path.read_text(encoding="utf-8", errors="replace"), rng)
        prompts += rng.sample(found, min(per_module, len(found)))
    return prompts + pydoc_prompts()


def training_prompts(num_prompts: int | None = None, seed: int = 0) -> list[Prompt]:
    """The template and stdlib prompts, deduplicated and shuffled with `seed`; the first `num_prompts`."""
    prompts = list(dict.fromkeys(template_prompts(seed=seed) + stdlib_prompts(seed=seed)))
    random.Random(seed).shuffle(prompts)
    return prompts[:num_prompts]


def heldout_prompts(path: Path = PROMPT_DIR / "heldout.jsonl") -> list[Prompt]:
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        row = json.loads(line)
        if row.get("domain") not in DOMAINS or not row.get("text"):
            raise ValueError(f"{path}:{n}: needs a non-empty 'text' and a 'domain' in {DOMAINS}: {line[:80]}")
        prompts.append(Prompt(row["text"], row["domain"]))
    return prompts


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens up to where a user's message begins (a system turn, if the
    template adds one, included)."""
    marker = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False)
    return tokenizer.encode(text[:text.index(marker)])


def render(tokenizer, prompts: list[Prompt]) -> list[list[int]]:
    """Each prompt as a single user turn in the model's chat template, ready for the reply."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                          tokenize=True) for p in prompts]


# ---------------------------------------------------------------------------- self-distillation


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
    graphs = decoder.device.type == "cuda"
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
            for prompt, result in zip(batch, decoder.generate(batch, params, cuda_graph=graphs)):
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
