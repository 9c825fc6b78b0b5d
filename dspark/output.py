"""What a request has produced, and when it is finished: the engine's bookkeeping of emitted tokens
and their text (each request's one detokenisation, which the server's streams read)."""
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
    text: str = ""  # with SamplingParams.detokenize or stop strings: the tokens' text (see StopCondition)


class StopCondition:
    """Decides, one emitted token at a time, whether a request is finished, and builds its text when
    the request wants it (SamplingParams.detokenize) or its stop strings need it: the request's one
    detokenisation (vLLM's output processor's job), which the server's streams read. The text leaves
    out stop tokens and special tokens, reads a character whose bytes span tokens once its last byte
    has come (IncrementalDecoder; vLLM's detokenizer does the same), follows on from the prompt's
    text, and ends before the first stop string. A stop string found must end in the newest piece,
    so only that piece and the `keep` characters before it (the longest stop string's reach) are
    searched."""

    def __init__(self, params: SamplingParams, eos_ids: Sequence[int], tokenizer=None, prompt: Sequence[int] = ()):
        self.max_tokens = params.max_tokens
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_ids)
        self.stop_strings = params.stop
        if self.stop_strings and tokenizer is None:
            raise ValueError(f"stop strings {self.stop_strings!r} need a tokenizer: "
                             "pass tokenizer= to SpeculativeDecoder")
        if params.detokenize and tokenizer is None:
            raise ValueError("detokenize=True needs a tokenizer: pass tokenizer= to SpeculativeDecoder")
        self.pieces = (IncrementalDecoder(tokenizer, skip_special_tokens=True, prompt=prompt)
                       if self.stop_strings or params.detokenize else None)
        self.keep = max((len(s) for s in self.stop_strings), default=1) - 1
        self.text = ""

    def finished(self, tokens: list[int]) -> str | None:
        """`tokens` just grew by one (each token passes here once, in order); returns the finish
        reason or None. The text grows by the token's piece (a finished request's is complete)."""
        if tokens[-1] in self.stop_ids:
            self._flush()
            return "stop"
        if self.pieces is not None and self._add(self.pieces.push(tokens[-1])):
            return "stop"
        if len(tokens) >= self.max_tokens:
            self._flush()
            return "length"
        return None

    def _add(self, piece: str) -> bool:
        """Appends a piece of text, cut before a stop string that it completes -> whether one did."""
        start = max(0, len(self.text) - self.keep)
        self.text += piece
        cuts = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        if cuts:
            self.text = self.text[:min(cuts)]
        return bool(cuts)

    def _flush(self) -> None:
        """No token follows: an incomplete last character is given as a replacement character."""
        if self.pieces is not None:
            self._add(self.pieces.flush())

    def extend(self, result: GenerationResult, new: list[int]) -> list[int]:
        """Appends `new` to result.tokens one token at a time until the request is finished (then
        sets result.finish_reason and result.finished) and keeps result.text; returns the tokens it took."""
        taken = []
        for token in new:
            result.tokens.append(token)
            taken.append(token)
            reason = self.finished(result.tokens)
            result.text = self.text
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
