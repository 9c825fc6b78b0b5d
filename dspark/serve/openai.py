"""The OpenAI API's request and response shapes: /v1/completions and /v1/chat/completions.

Requests are validated here; anything malformed or unsupported raises BadRequest with a message
that names the parameter (the server answers 400), never a silent default. Supported: model,
prompt (one string or one list of token ids; a string gets the model's own special tokens, e.g.
Llama 3's BOS) / messages (roles system, developer, user, assistant; text content or text parts,
joined by newlines; a message's name goes to the chat template), max_tokens (chat: also
max_completion_tokens), temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos,
skip_special_tokens = true (the text never holds special tokens), n = 1, stream,
stream_options.include_usage, user. A null value means the default. A temperature below 1e-5 is
greedy (vLLM's rule).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from dspark.output import GenerationResult
from dspark.sampling import SamplingParams
from dspark.tokenizer import IncrementalDecoder

UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "best_of", "logit_bias", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "min_tokens", "tools", "tool_choice", "functions",
               "parallel_tool_calls", "response_format", "prompt_logprobs", "store")
OFF_VALUES = {"repetition_penalty": [1], "best_of": [1], "response_format": [{"type": "text"}], "suffix": [""],
              "tool_choice": ["none"], "parallel_tool_calls": [True]}  # else 0, [], {} (and null, false)
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
          "ignore_eos", "skip_special_tokens", "n", "stream", "stream_options", "user", *UNSUPPORTED}
COMPLETION_KEYS = COMMON | {"prompt"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens"}
ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "name")  # others (tool_calls, refusal, ...) only at their off values
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
# Every stop string is looked for after every token, on the engine's thread that all requests share:
# a request may not make that slow for the others (OpenAI allows 4 strings, vLLM any).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 512


class BadRequest(ValueError):
    """A request the server cannot serve: HTTP `status` (400, or 404 for a model not served here)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


def _number(body: dict, key: str, default, kind=float, low=None, high=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"{key} must be {'a number' if kind is float else 'an integer'}, got {value!r}", key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"{key} must be in [{low}, {high}], got {value!r}", key)
    return kind(value)


def _asks_for_nothing(key: str, value) -> bool:
    """Whether an unsupported parameter's value is its off value, which clients send by default."""
    if value is None or value is False:
        return True
    if key == "logprobs":  # logprobs 0: the sampled tokens' logprobs
        return False
    off = OFF_VALUES.get(key, [0, [], {}])
    if isinstance(value, bool):  # True is no number: no repetition_penalty 1
        return any(value is v for v in off)
    return value in off


def _check_keys(body: dict, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key in body:
        if key not in allowed:
            raise BadRequest(f"unknown parameter {key!r}", key)
        if key in UNSUPPORTED and not _asks_for_nothing(key, body[key]):
            raise BadRequest(f"{key} is not supported by this server", key)
    if _number(body, "n", 1, int, 1) != 1:
        raise BadRequest("n must be 1: one completion per request", "n")
    for key in ("stream", "ignore_eos"):  # null: the default, as in OpenAI's schema
        if not isinstance(body.get(key, False), (bool, type(None))):
            raise BadRequest(f"{key} must be a boolean, got {body[key]!r}", key)
    skip = body.get("skip_special_tokens")
    if skip is not True and skip is not None:  # not `in (True, None)`: 1 == True
        raise BadRequest(f"skip_special_tokens must be true (the text leaves special tokens out), got {skip!r}",
                         "skip_special_tokens")
    options = body.get("stream_options")
    if options is not None and not (body.get("stream") and isinstance(options, dict)
                                    and set(options) <= {"include_usage"}
                                    and isinstance(options.get("include_usage"), (bool, type(None)))):
        raise BadRequest(f"stream_options must be {{\"include_usage\": true or false}} with stream: true, "
                         f"got {options!r:.80}", "stream_options")


def _encodable(text: str, field: str) -> str:
    """`text`, if it is valid Unicode (JSON can carry a lone surrogate, which no tokenizer encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadRequest(f"{field} is not valid Unicode: {error.reason} at {error.start}", field) from error
    return text


def sampling_params(body: dict, max_tokens_key: str, default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams (OpenAI defaults: temperature 1, top_p 1; top_k -1 is vLLM's off)."""
    key = max_tokens_key if body.get(max_tokens_key) is not None else "max_tokens"
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or
                                 (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise BadRequest(f"stop must be a string or a list of strings, got {stop!r:.80}", "stop")
    stop_token_ids = body.get("stop_token_ids")
    stop_token_ids = [] if stop_token_ids is None else stop_token_ids
    if not (isinstance(stop_token_ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in stop_token_ids)):
        raise BadRequest(f"stop_token_ids must be a list of integers, got {stop_token_ids!r}", "stop_token_ids")
    values = dict(temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
                  top_p=_number(body, "top_p", 1.0, float),  # its range: SamplingParams' (0, 1]
                  top_k=max(_number(body, "top_k", 0, int, -1, 2**63 - 1), 0),
                  min_p=_number(body, "min_p", 0.0, float, 0.0, 1.0),
                  seed=_number(body, "seed", None, int, -2**63, 2**63 - 1),
                  max_tokens=_number(body, key, default_max_tokens, int, 1))
    try:
        params = SamplingParams(**values, stop=stop or None, stop_token_ids=stop_token_ids,
                                ignore_eos=bool(body.get("ignore_eos")))
    except ValueError as error:  # SamplingParams' message starts with the field's name (e.g. "top_p must be ...")
        raise BadRequest(str(error), str(error).split()[0]) from error
    if len(params.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in params.stop):
        raise BadRequest(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters, "
                         f"got {len(params.stop)} of up to {max(map(len, params.stop))}", "stop")
    return params


def parse_completion(body: dict, tokenizer) -> tuple[list[int], SamplingParams]:
    _check_keys(body, COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        ids = tokenizer.encode(_encodable(prompt, "prompt"), add_special_tokens=True)  # e.g. Llama 3's BOS
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    else:
        raise BadRequest("prompt must be a non-empty string or a non-empty list of token ids (one prompt "
                         f"per request), got {prompt!r:.80}", "prompt")
    return ids, sampling_params(body, "max_tokens", DEFAULT_COMPLETION_TOKENS)


def _message(message, index: int) -> dict:
    """The chat template's message: role, text content, and the name if one is given."""
    role = message.get("role") if isinstance(message, dict) else None
    role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else None
    if role not in ROLES:
        raise BadRequest(f"messages[{index}] must be an object with a role in {ROLES + tuple(ROLE_ALIASES)}, "
                         f"got {message!r:.80}", "messages")
    for key, value in message.items():
        if key not in MESSAGE_KEYS and not _asks_for_nothing(key, value):
            raise BadRequest(f"messages[{index}].{key} is not supported by this server", "messages")
    name = message.get("name")
    if not isinstance(name, (str, type(None))):
        raise BadRequest(f"messages[{index}].name must be a string, got {name!r:.80}", "messages")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise BadRequest(f"messages[{index}].content: only text parts are supported", "messages")
        content = "\n".join(part["text"] for part in content)  # as vLLM joins them
    if not isinstance(content, str):
        raise BadRequest(f"messages[{index}].content must be a string, got {content!r:.80}", "messages")
    entry = {"role": role, "content": _encodable(content, "messages")}
    return entry if name is None else {**entry, "name": _encodable(name, "messages")}


def parse_chat(body: dict, tokenizer, max_model_len: int) -> tuple[list[int], SamplingParams]:
    _check_keys(body, CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return ids, sampling_params(body, "max_completion_tokens", max(1, max_model_len - len(ids)))


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {model!r:.80}", "model")
    if model is not None and model != served:
        raise BadRequest(f"model {model!r} is not served here; this server serves {served!r}", "model",
                         status=404, code="model_not_found")  # OpenAI's and vLLM's answer


class TextStream:
    """The text of a request's tokens as it grows, each token decoded once: stop tokens and special
    tokens left out (as vLLM's default), a stop string and what follows it cut, and held back while
    it could still be the start of a stop string. The engine's StopCondition reads the same text and
    ends a request at the first token whose text holds a stop string, so the first one found is
    where the text ends."""

    def __init__(self, tokenizer, stop: list[str], stop_ids: set[int], prompt: list[int] = ()):
        self.stop, self.stop_ids = stop, stop_ids
        self.pieces = IncrementalDecoder(tokenizer, skip_special_tokens=True, prompt=prompt)
        self.keep = max((len(s) for s in stop), default=1) - 1  # characters a stop string may reach back
        self.decoded, self.seen, self.cut = "", 0, False  # the text so far, of tokens[:seen]
        self.sent = 0

    def text(self, tokens: list[int], finished: bool) -> str:
        """The text of `tokens`, which extend the last call's (the engine's list, which may grow
        while this reads it); `finished`: no token follows, so an incomplete last character is
        given as a replacement character."""
        new = tokens[self.seen:]
        self.seen += len(new)
        for token in new:
            if token not in self.stop_ids:
                self._add(self.pieces.push(token))
        if finished:
            self._add(self.pieces.flush())
        return self.decoded

    def _add(self, piece: str) -> None:
        if self.cut or not piece:
            return
        start = max(0, len(self.decoded) - self.keep)
        self.decoded += piece
        cuts = [i for i in (self.decoded.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            self.decoded, self.cut = self.decoded[:min(cuts)], True

    def delta(self, tokens: list[int], finished: bool) -> str:
        text = self.text(tokens, finished)
        end = len(text) if finished or self.cut else len(text) - self.keep
        delta, self.sent = text[self.sent:max(end, self.sent)], max(end, self.sent)
        return delta


def speculation(result: GenerationResult) -> dict | None:
    """Per-request acceptance under metrics.speculative_decoding (None when the server does not
    speculate); mean_acceptance_length counts the bonus token, as vLLM's field of that name."""
    if not result.accepted_per_position:
        return None
    accepted = sum(result.accepted_per_position)
    return {"num_drafts": result.num_steps, "num_accepted_tokens": accepted,
            "accepted_per_position": result.accepted_per_position,
            "mean_acceptance_length": round(1 + accepted / result.num_steps, 4) if result.num_steps else None}


def _totals(prompt_tokens: int, result: GenerationResult) -> dict:
    """A whole answer's usage and its speculation metrics."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.tokens),
             "total_tokens": prompt_tokens + len(result.tokens)}
    return {"usage": usage, "metrics": {"speculative_decoding": speculation(result)}}


@dataclass(frozen=True)
class Reply:
    """What every object of one request's answer shares: the kind ("text" or "chat"), the id, the
    model and one `created` time (OpenAI's chunks of a stream all carry the same). With
    `include_usage` (stream_options') every chunk but the usage chunk carries "usage": null, as OpenAI's."""
    kind: str
    id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _object(self, choices: list[dict], suffix: str = "") -> dict:
        name = "chat.completion" + suffix if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": name, "created": self.created, "model": self.model, "choices": choices}

    def response(self, text: str, result: GenerationResult, prompt_tokens: int) -> dict:
        choice = {"index": 0, "finish_reason": result.finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**self._object([choice]), **_totals(prompt_tokens, result)}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        """One streamed chunk: text (None with role=True for the chat's opening chunk)."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._object([choice], ".chunk"), **({"usage": None} if self.include_usage else {})}

    def usage_chunk(self, prompt_tokens: int, result: GenerationResult) -> dict:
        """The stream's last chunk when stream_options.include_usage asks for it: no choices."""
        return {**self._object([], ".chunk"), **_totals(prompt_tokens, result)}
