"""Per-request sampling parameters, their batched tensors, the target-side filters and the
log-probabilities a request may ask for.

Temperature alone changes no token set; top-k, top-p and min-p do. The filters run only when
some request of the batch asks for one (`SamplingTensors.uses_filters`), so a temperature-only
batch pays for no sort over the vocabulary; likewise log-probabilities (`wants_logprobs`).
"""
from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass

import torch

from dspark.ops.temperature import scaled

MAX_SEED = 2**63  # seeds are int64 Philox keys: [-MAX_SEED, MAX_SEED), as vLLM takes them
GREEDY_BELOW = 1e-5  # temperatures below this are greedy
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs maximum)


def _finite(value) -> bool:
    """A finite real number (not a bool: True is no temperature)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """What one request asks for. A temperature below GREEDY_BELOW is greedy (vLLM's rule: dividing
    by it would overflow float32); `top_k=0`, `top_p=1` and `min_p=0` switch their filter off;
    `seed=None` draws a fresh random seed when the request is batched. `logprobs=n` returns each
    generated token's log-probability and the n likeliest alternatives' (0 <= n <= MAX_LOGPROBS),
    `prompt_logprobs=n` the same for each prompt token after the first; both are the target's raw
    log-softmax (before temperature and filters, vLLM's default). `detokenize=True` builds the
    completion's text as it is generated (GenerationResult.text; the server's streams send it),
    which needs the decoder's tokenizer; stop strings build it in any case."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    stop: str | list[str] | None = None  # normalised to a list of strings
    stop_token_ids: list[int] | None = None  # normalised to a list of ints
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = False

    def __post_init__(self):
        if not (_finite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_finite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (is_int(self.top_k) and 0 <= self.top_k < 2**63):
            raise ValueError(f"top_k must be an int in [0, 2**63) (0 = off), got {self.top_k!r}")
        if not (_finite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (is_int(self.seed) and -MAX_SEED <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be an int in [-2**63, 2**63), got {self.seed!r}")
        if not (is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(stop)
        stop_token_ids = self.stop_token_ids or []
        if not (isinstance(stop_token_ids, (list, tuple)) and all(is_int(t) and t >= 0 for t in stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(stop_token_ids)
        for name in ("ignore_eos", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_filters(self) -> bool:
        """Whether this request needs top-k / top-p / min-p (greedy requests never do)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


@dataclass
class SamplingTensors:
    """SamplingParams of a batch as per-row tensors, the form the ops take."""
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    uses_filters: bool = False  # some row needs apply_filters
    all_greedy: bool = False  # every row is greedy: drafting and verification need no noise
    wants_logprobs: bool = False  # some row asks for its tokens' log-probabilities

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        rng = random.SystemRandom()
        seeds = [p.seed if p.seed is not None else rng.getrandbits(63) for p in params]

        def tensor(values, dtype):  # non_blocking from pageable memory: staged at once, no wait for the device
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=tensor([0.0 if p.greedy else p.temperature for p in params], torch.float32),
            top_k=tensor([p.top_k for p in params], torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            seed=tensor(seeds, torch.int64),
            uses_filters=any(p.uses_filters for p in params),
            all_greedy=all(p.greedy for p in params),
            wants_logprobs=any(p.logprobs is not None for p in params),
        )


def apply_filters(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set the tokens that min-p, top-k or top-p remove to -inf; the kept logits are unchanged.

    logits: [B, N, V] float32 (N positions per request, not yet divided by T); the other arguments
    are [B]. The filters act on softmax(logits / T) in vLLM's order: min-p (keep p >= min_p * p_max)
    and top-k (the k most likely and the tokens tied with the k-th), then top-p over what they kept,
    renormalised (keep the smallest most-likely set whose mass reaches top_p). Rows whose parameters
    are neutral, and greedy rows, come back unchanged. Sort-based, static shapes, no host sync.
    """
    B, N, V = logits.shape
    greedy = temperature == 0
    sorted_logits, order = scaled(logits, temperature).sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)

    rank = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k, V).clamp(max=V).view(B, 1, 1)
    kth = sorted_logits.gather(-1, (k - 1).expand(B, N, 1))  # tokens tied with the k-th stay, as in vLLM
    keep = (sorted_logits >= kth) & (probs >= min_p.view(B, 1, 1) * probs[..., :1])
    kept = torch.where(keep, probs, 0.0)
    mass_before = kept.cumsum(dim=-1) - kept
    p = top_p.view(B, 1, 1)
    keep &= (mass_before < p * kept.sum(dim=-1, keepdim=True)) | (p >= 1) | (rank == 0)  # a tiny p: the top one

    removed = torch.empty_like(keep).scatter_(-1, order, ~keep)
    uses_filter = ~greedy & ((top_k > 0) | (top_p < 1) | (min_p > 0))
    removed &= uses_filter.view(B, 1, 1)
    return logits.masked_fill(removed, float("-inf"))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw log-softmax of `logits` [B, N, V] (float32, NaN as -inf) at `tokens` [B, N] (a negative
    id reads as id 0: padding), and its MAX_LOGPROBS likeliest tokens
    -> chosen [B, N], top ids [B, N, MAX_LOGPROBS], top log-probabilities [B, N, MAX_LOGPROBS]."""
    logits = logits.float()
    logprobs = logits.masked_fill(logits.isnan(), float("-inf")).log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1)
    top = logprobs.topk(min(MAX_LOGPROBS, logprobs.shape[-1]), dim=-1)
    return chosen, top.indices, top.values
