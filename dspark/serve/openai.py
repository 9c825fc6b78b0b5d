"""The OpenAI API's request and response shapes for /v1/completions and /v1/chat/completions, as
pydantic models, and what turns a request into the engine's prompt and SamplingParams.

Validation is strict: a field of the wrong type (no "1" for 1, no 1 for true), NaN or Infinity, a
value out of range or an unknown field is refused, naming the field; null means the default.
Supported: model, prompt (one string or one list of token ids; a string gets the model's own special
tokens, e.g. Llama 3's BOS) / messages (roles system, developer, user, assistant; text content or
text parts, joined by newlines; a message's name goes to the chat template), max_tokens (chat: also
max_completion_tokens), temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos,
skip_special_tokens = true (the text never holds special tokens), n (sample i of a seeded request
draws with seed + i), stream, stream_options.include_usage, user; logprobs (completions: 0-5
alternatives; chat: with top_logprobs 0-20) and, on completions, echo (the prompt's text before the
completion's, with its tokens' log-probabilities when logprobs is given). Log-probabilities are the
target's raw log-softmax, before temperature and filters (vLLM's default, --logprobs-mode
raw_logprobs), one per generated token (a stop token's included). A temperature below 1e-5 is
greedy (vLLM's rule). The parameters in UNSUPPORTED are accepted only at their off values, which SDKs
send by default.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dspark.output import GenerationResult, TokenLogprob
from dspark.sampling import MAX_SEED, SamplingParams

UNSUPPORTED = ("suffix", "best_of", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "min_tokens", "prompt_logprobs", "store", "tools", "tool_choice", "functions", "parallel_tool_calls",
               "response_format")
# their off values (besides null and false) where not 0, [] or {}; any other value is refused
OFF_VALUES = {"repetition_penalty": [1], "best_of": [1], "response_format": [{"type": "text"}], "suffix": [""],
              "tool_choice": ["none"], "parallel_tool_calls": [True]}
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128  # OpenAI's limit on n
# Every stop string is looked for after every token, on the engine's thread that all requests share:
# a request may not make that slow for the others (OpenAI allows 4 strings, vLLM any).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 512


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class BadRequest(ValueError):
    """A request the server cannot serve: HTTP `status` (400, or 404 for a model not served here)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        return error_body(str(self), param=self.param, code=self.code)


def asks_for_nothing(key: str, value) -> bool:
    """Whether an unsupported parameter's value is its off value (True is no number: no
    repetition_penalty 1)."""
    if value is None or value is False:
        return True
    return any(value == off and isinstance(value, bool) == isinstance(off, bool)
               for off in OFF_VALUES.get(key, [0, [], {}]))


def _refuse_unless_off(value, info: ValidationInfo):
    if not asks_for_nothing(info.field_name, value):
        raise PydanticCustomError("unsupported", "{name} {value} is not supported by this server",
                                  {"name": info.field_name, "value": repr(value)[:60]})
    return value


def _needs(flag: str):
    """A validator refusing its field unless the field `flag` (declared before it) is true."""
    def check(value, info: ValidationInfo):
        if value is not None and not info.data.get(flag):
            raise PydanticCustomError("unsupported", "{name} needs {flag}: true", {"name": info.field_name, "flag": flag})
        return value
    return check


def _encodable(text: str) -> str:
    """`text`, if it is valid Unicode (JSON can carry a lone surrogate, which no tokenizer encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PydanticCustomError("unicode", "not valid Unicode: {reason} at {start}",
                                  {"reason": error.reason, "start": error.start}) from None
    return text


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


Unsupported = Annotated[Any, Field(default=None, exclude=True)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StreamOptions(Strict):
    include_usage: bool | None = None


class SamplingRequest(Strict):
    """What both endpoints take."""
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: float | None = None  # its range: SamplingParams' (0, 1]
    top_k: Annotated[int, Field(ge=-1, lt=2**63)] | None = None  # -1: vLLM's off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-MAX_SEED, lt=MAX_SEED)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    suffix: Unsupported
    best_of: Unsupported
    logit_bias: Unsupported
    presence_penalty: Unsupported
    frequency_penalty: Unsupported
    repetition_penalty: Unsupported
    min_tokens: Unsupported
    prompt_logprobs: Unsupported
    store: Unsupported
    tools: Unsupported
    tool_choice: Unsupported
    functions: Unsupported
    parallel_tool_calls: Unsupported
    response_format: Unsupported

    _off = field_validator(*UNSUPPORTED)(_refuse_unless_off)

    @field_validator("skip_special_tokens")
    @classmethod
    def _skip_special_tokens(cls, value):
        if value is False:
            raise PydanticCustomError("unsupported", "skip_special_tokens must be true (the text leaves "
                                      "special tokens out)")
        return value

    _with_stream = field_validator("stream_options")(_needs("stream"))

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The request's SamplingParams (OpenAI's defaults: temperature 1, top_p 1)."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0),
                min_p=self.min_p or 0.0, seed=self.seed, max_tokens=self.max_tokens or default_max_tokens,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos),
                detokenize=True)
        except ValueError as error:  # SamplingParams' message starts with the field's name ("top_p must be ...")
            raise BadRequest(str(error), str(error).split()[0]) from error

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def sample_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The SamplingParams of each of n samples: a seeded request's sample i draws with seed + i
    (wrapped into the seeds' int64 range), so the samples differ and sample 0 is the n = 1 answer."""
    if params.seed is None:
        return [params] * n
    return [SamplingParams(**{**vars(params), "seed": (params.seed + i + MAX_SEED) % (2 * MAX_SEED) - MAX_SEED})
            for i in range(n)]


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        params = super().sampling_params(default_max_tokens)
        params.logprobs = self.logprobs
        params.prompt_logprobs = self.logprobs if self.echo else None
        return params

    def echo_text(self, tokenizer, prompt: list[int]) -> str:
        """The text echo puts before the completion's: the prompt as given, or its tokens' text."""
        if not self.echo:
            return ""
        return self.prompt if isinstance(self.prompt, str) else tokenizer.decode(prompt, skip_special_tokens=True)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not prompt or (isinstance(prompt, list) and not isinstance(prompt[0], int)):
            raise PydanticCustomError("prompt", "prompt must be a non-empty string or a non-empty list of token "
                                      "ids (one prompt per request)")
        return _encodable(prompt) if isinstance(prompt, str) else prompt

    def prompt_ids(self, tokenizer) -> list[int]:
        if isinstance(self.prompt, str):
            return tokenizer.encode(self.prompt, add_special_tokens=True)  # e.g. Llama 3's BOS
        return self.prompt


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message for the chat template: its other fields (tool_calls, refusal, audio, ...) only at
    their off values, as SDKs send them."""
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", "name")
    @classmethod
    def _unicode(cls, value):
        for text in [value] if isinstance(value, str) else [part.text for part in value or []]:
            _encodable(text)
        return value

    @model_validator(mode="after")
    def _others_ask_nothing(self):
        for key, value in (self.model_extra or {}).items():
            if not asks_for_nothing(key, value):
                raise PydanticCustomError("unsupported", "{key} is not supported by this server", {"key": key})
        return self

    def template_entry(self) -> dict:
        """role ("developer" is OpenAI's newer "system"), the text (parts joined by newlines, as
        vLLM joins them) and the name if given."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        entry = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return entry if self.name is None else {**entry, "name": self.name}


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    _with_logprobs = field_validator("top_logprobs")(_needs("logprobs"))

    def prompt_ids(self, tokenizer) -> list[int]:
        return tokenizer.apply_chat_template([m.template_entry() for m in self.messages],
                                             add_generation_prompt=True, tokenize=True)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        params = super().sampling_params(default_max_tokens)
        params.logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return params

    def echo_text(self, tokenizer, prompt: list[int]) -> str:
        return ""


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise BadRequest(f"model {requested!r} is not served here; this server serves {served!r}", "model",
                         status=404, code="model_not_found")  # OpenAI's and vLLM's answer


class TextStream:
    """What a stream sends of a request's text, which the engine builds (GenerationResult.text, by
    StopCondition: stop and special tokens left out, cut before a stop string): all of it once the
    request has finished, else all but the last characters that could still begin a stop string.
    The text only grows, but for a cut at a stop string, which never reaches back past what was sent."""

    def __init__(self, stop: list[str]):
        self.keep = max((len(s) for s in stop), default=1) - 1  # characters a stop string may reach back
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else len(text) - self.keep
        delta, self.sent = text[self.sent:max(end, self.sent)], max(end, self.sent)
        return delta


class Logprobs:
    """Tokens and their log-probabilities in an answer's shape: chat's content list (token, logprob,
    bytes, top_logprobs), or completions' columns (tokens, token_logprobs, top_logprobs, text_offset,
    the offsets counted on from `offset`, the text before these tokens). A token's text is its own
    decode, special tokens kept (as vLLM's)."""

    def __init__(self, tokenizer, kind: str):
        self.tokenizer, self.kind = tokenizer, kind

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def of(self, tokens: list[int], entries: list[TokenLogprob | None], offset: int = 0) -> dict:
        if self.kind == "chat":
            def item(token: int, logprob: float) -> dict:
                text = self.text(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [{**item(t, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]}
                                for t, e in zip(tokens, entries)]}
        texts = [self.text(t) for t in tokens]
        offsets = [offset + sum(map(len, texts[:i])) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {self.text(i): v for i, v in e.top} for e in entries],
                "text_offset": offsets}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeDecoding(BaseModel):
    """Acceptance over a request's samples; mean_acceptance_length counts the bonus token, as
    vLLM's field of that name."""
    num_drafts: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    mean_acceptance_length: float | None


class Metrics(BaseModel):
    speculative_decoding: SpeculativeDecoding | None  # None: the server does not speculate


def speculation(results: list[GenerationResult]) -> SpeculativeDecoding | None:
    if not results[0].accepted_per_position:
        return None
    per_position = [sum(column) for column in zip(*(r.accepted_per_position for r in results))]
    drafts, accepted = sum(r.num_steps for r in results), sum(per_position)
    return SpeculativeDecoding(num_drafts=drafts, num_accepted_tokens=accepted, accepted_per_position=per_position,
                               mean_acceptance_length=round(1 + accepted / drafts, 4) if drafts else None)


class Choice(BaseModel):
    """One sample of an answer or of a chunk: `text` (completions), `message` (chat) or `delta`
    (chat chunks)."""
    model_config = ConfigDict(extra="allow")
    index: int
    logprobs: dict | None = None
    finish_reason: str | None = None


class Answer(BaseModel):
    """A whole answer or a stream's chunk. Without include_usage, a chunk has no usage key at all;
    with it, every chunk but the last carries "usage": null, as OpenAI's."""
    id: str
    object: Literal["text_completion", "chat.completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    metrics: Metrics | None = None


@dataclass(frozen=True)
class Reply:
    """What every object of one request's answer shares: the kind ("text" or "chat"), the id, the
    model, one `created` time (OpenAI's chunks of a stream all carry the same) and the prompt's
    length."""
    kind: str
    id: str
    model: str
    prompt_tokens: int
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _answer(self, choices: list[Choice], chunk: bool, results: list[GenerationResult] | None = None) -> Answer:
        name = "text_completion" if self.kind == "text" else "chat.completion.chunk" if chunk else "chat.completion"
        totals = {}
        if results is not None:
            completion = sum(len(r.tokens) for r in results)
            totals = {"usage": Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                                     total_tokens=self.prompt_tokens + completion),
                      "metrics": Metrics(speculative_decoding=speculation(results))}
        return Answer(id=self.id, object=name, created=self.created, model=self.model, choices=choices, **totals)

    def response(self, texts: list[str], results: list[GenerationResult], logprobs: list[dict | None]) -> Answer:
        key = "message" if self.kind == "chat" else "text"
        return self._answer([Choice(index=i, finish_reason=r.finish_reason, logprobs=lp,
                                    **{key: {"role": "assistant", "content": t} if self.kind == "chat" else t})
                             for i, (t, r, lp) in enumerate(zip(texts, results, logprobs))], chunk=False,
                            results=results)

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, role: bool = False,
              logprobs: dict | None = None) -> str:
        """One streamed chunk as JSON: sample `index`'s text and its tokens' log-probabilities (with
        role=True, the chat's opening chunk)."""
        if self.kind == "chat":
            choice = Choice(index=index, finish_reason=finish_reason, logprobs=logprobs,
                            delta={"role": "assistant", "content": ""} if role else {"content": text} if text else {})
        else:
            choice = Choice(index=index, text=text or "", finish_reason=finish_reason, logprobs=logprobs)
        return self._answer([choice], chunk=True).model_dump_json(
            exclude={"metrics"} if self.include_usage else {"usage", "metrics"})

    def usage_chunk(self, results: list[GenerationResult]) -> str:
        """The stream's last chunk when stream_options.include_usage asks for it: no choices."""
        return self._answer([], chunk=True, results=results).model_dump_json()
