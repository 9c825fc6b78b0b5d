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

The target's own responses to the prompts (self-distillation) come from dspark.train.self_distill.
"""
from __future__ import annotations

import ast
import json
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics as pydoc_topics


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
