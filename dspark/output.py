"""What a request has produced, and when it is finished: the decoder's and the engine's shared
bookkeeping of emitted tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from dspark.sampling import SamplingParams
from dspark.tokenizer import IncrementalDecoder


class TokenLogprob(NamedTuple):
    """A token's log-probability under the target (raw log-softmax) and the likeliest tokens' (id, log-probability)."""
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)  # generated ids, the stopping token included
    accepted_per_position: list[int] = field(default_factory=list)  # steps whose draft k was accepted
    num_steps: int = 0  # decode steps after the prefill
    finish_reason: str = "length"  # "stop" (stop token or string), "length" (max_tokens); the engine adds "abort"
    finished: bool = False
    logprobs: list[TokenLogprob] | None = None  # one per token, when SamplingParams.logprobs asks for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None)


class StopCondition:
    """Decides, one emitted token at a time, whether a request is finished. Stop strings are looked
    for in the text a client is sent: special tokens skipped, and a character whose bytes span
    tokens read once its last byte has come (IncrementalDecoder; vLLM's detokenizer does the same).
    A stop string found must end in the newest piece of text, so only that piece and the characters
    before it that the longest stop string could reach back to are searched."""

    def __init__(self, params: SamplingParams, eos_ids: Sequence[int], tokenizer=None, prompt: Sequence[int] = ()):
        self.max_tokens = params.max_tokens
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_ids)
        self.stop_strings = params.stop
        if self.stop_strings and tokenizer is None:
            raise ValueError(f"stop strings {self.stop_strings!r} need a tokenizer: "
                             "pass tokenizer= to SpeculativeDecoder")
        self.text = (IncrementalDecoder(tokenizer, skip_special_tokens=True, prompt=prompt)
                     if self.stop_strings else None)
        self.keep = max((len(s) for s in self.stop_strings), default=1) - 1
        self.tail = ""  # the text's last `keep` characters

    def finished(self, tokens: list[int]) -> str | None:
        """`tokens` just grew by one (each token passes here once, in order); returns the finish
        reason or None."""
        if tokens[-1] in self.stop_ids:
            return "stop"
        if self.text is not None and self._ends_stop_string(tokens[-1]):
            return "stop"
        if len(tokens) >= self.max_tokens:
            return "length"
        return None

    def _ends_stop_string(self, token: int) -> bool:
        text = self.tail + self.text.push(token)
        self.tail = text[max(0, len(text) - self.keep):]
        return any(s in text for s in self.stop_strings)

    def extend(self, result: GenerationResult, new: list[int]) -> list[int]:
        """Appends `new` to result.tokens one token at a time until the request is finished (then
        sets result.finish_reason and result.finished); returns the tokens it took."""
        taken = []
        for token in new:
            result.tokens.append(token)
            taken.append(token)
            reason = self.finished(result.tokens)
            if reason is not None:
                result.finish_reason, result.finished = reason, True
                break
        return taken

    def take_step(self, result: GenerationResult, emitted: list[int], num_accepted: int) -> tuple[list[int], int]:
        """One decode step's tokens, `emitted` [K+1] (the accepted drafts, then the correction or
        bonus token, then padding), taken up to the request's stop; counts the step, and the accepted
        drafts the stop did not cut off per position. Returns the tokens taken and those drafts' count."""
        result.num_steps += 1
        taken = self.extend(result, emitted[:num_accepted + 1])
        accepted = min(num_accepted, len(taken))
        for position in range(accepted):
            result.accepted_per_position[position] += 1
        return taken, accepted
