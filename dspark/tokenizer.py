"""Tokenizer: byte-level BPE from GGUF metadata or an HF tokenizer.json, the chat template, and a
streaming decoder.

Built on the `tokenizers` library, so encodings equal Hugging Face's for the same vocabulary, merges
and pre-tokenizer; transformers is not needed at runtime.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import gguf
import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from dspark.weights import gguf_reader

# HF's old default template, used when a model ships none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tokens that end a chat turn (ChatML, Llama 3). Generation stops on them when the template uses them,
# even where the model's eos token is another one (e.g. <|endoftext|>).
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>")

PROMPT_CONTEXT = 5  # prompt tokens an IncrementalDecoder reads before the first generated one (vLLM's 5)

# Split regexes of HF's Llama 3 and Qwen2 tokenizer.json files; they differ only in how digits group.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer that splits text as llama.cpp does for `tokenizer.ggml.pre`."""
    if pre in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":  # llama.cpp: "\p{N}" then GPT-2's regex, i.e. every digit on its own
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in ("llama-bpe", "qwen2"):
        split = _LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; "
                     "supported: default, gpt2, smollm, llama-bpe, qwen2")


def _gguf_tokenizer_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def _token_content(token: str | dict | None) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as serialized AddedTokens."""
    return token["content"] if isinstance(token, dict) else token


def _config_chat_template(template: str | list[dict] | None) -> str | None:
    """tokenizer_config.json holds one template or a list of named ones; we use the default."""
    if isinstance(template, list):
        template = next((t["template"] for t in template if t["name"] == "default"), None)
    return template


def _raise_exception(message: str):
    raise ValueError(f"chat template rejected the messages: {message}")


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    """HF's tojson: plain json.dumps, without jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compiles a chat template in the sandboxed environment HF renders templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(self, backend: Backend, *, bos_token_id: int | None, eos_token_id: int | None,
                 pad_token_id: int | None = None, chat_template: str | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template or CHATML_TEMPLATE
        self._template = _compile_chat_template(self.chat_template)
        chat_end_ids = [self.token_to_id(t) for t in CHAT_END_TOKENS if t in self.chat_template]
        self.eos_token_ids = list(dict.fromkeys(
            i for i in [eos_token_id, *chat_end_ids] if i is not None))

    @classmethod
    def from_gguf(cls, path: str | Path, reader: gguf.GGUFReader | None = None) -> Tokenizer:
        """Builds the tokenizer from a GGUF file's `tokenizer.*` metadata (byte-level BPE, "gpt2");
        `reader`: the file already parsed (dspark.loading.load_gguf shares its parse)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        meta = _gguf_tokenizer_fields(reader or gguf_reader(path))
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{path}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') is supported")
        tokens = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        pre = meta.get("tokenizer.ggml.pre", "default")
        backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                     ignore_merges=pre == "llama-bpe"))
        if pre == "qwen2":  # as in Qwen2's tokenizer.json
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()

        types = meta["tokenizer.ggml.token_type"]
        special = {gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN}
        backend.add_tokens([AddedToken(t, special=types[i] in special, normalized=False)
                            for i, t in enumerate(tokens)
                            if types[i] in special or types[i] == gguf.TokenType.USER_DEFINED])

        bos = meta.get("tokenizer.ggml.bos_token_id")
        if bos is not None and meta.get("tokenizer.ggml.add_bos_token"):  # e.g. Llama 3
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)])
        return cls(backend, bos_token_id=bos, eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                   pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, config: dict[str, Any] | None = None) -> Tokenizer:
        """An HF tokenizer.json, with the special tokens and chat template of tokenizer_config.json
        (`config`, already parsed) when given."""
        tokenizer_json = Path(tokenizer_json)
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_json}")
        try:
            backend = Backend.from_file(str(tokenizer_json))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception, naming no file
            raise ValueError(f"{tokenizer_json}: not a tokenizer file ({e})") from None
        config = config or {}

        def token_id(key: str) -> int | None:
            token = _token_content(config.get(key))
            if token is None:
                return None
            if (i := backend.token_to_id(token)) is None:
                raise ValueError(f"{key}={token!r} from the tokenizer config is not in {tokenizer_json}")
            return i

        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   pad_token_id=token_id("pad_token"),
                   chat_template=_config_chat_template(config.get("chat_template")))

    @classmethod
    def from_pretrained(cls, hf_dir: str | Path) -> Tokenizer:
        """An HF model folder: tokenizer.json, plus tokenizer_config.json and chat_template.jinja if present."""
        hf_dir = Path(hf_dir)
        config_path, template_path = hf_dir / "tokenizer_config.json", hf_dir / "chat_template.jinja"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except ValueError as e:
            raise ValueError(f"{config_path}: not valid JSON ({e})") from None
        if template_path.is_file():
            config["chat_template"] = template_path.read_text()
        return cls.from_file(hf_dir / "tokenizer.json", config)

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """An HF folder, or a tokenizer file: a tokenizer.json comes with the special tokens and chat
        template of its folder (from_pretrained), a file of another name alone (from_file)."""
        path = Path(path)
        if path.is_dir():
            return cls.from_pretrained(path)
        if path.name == "tokenizer.json":
            return cls.from_pretrained(path.parent)
        return cls.from_file(path)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token`, or None if it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level form, e.g. "Ġthe"), or None if out of range."""
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. <|im_start|>) become their ids;
        `add_special_tokens` adds the model's own (e.g. Llama 3's BOS), if it adds any."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        """Renders `messages` ([{"role": ..., "content": ...}]) as the model's prompt; with
        `add_generation_prompt` it ends where the assistant's reply begins."""
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"message {i} needs a string 'role' and a string 'content': {message!r}")
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos, eos_token=eos)
        return self.encode(text) if tokenize else text


class IncrementalDecoder:
    """Turns token ids, fed one at a time, into text as it becomes complete.

    A character whose UTF-8 bytes are split across tokens is held back until its last byte arrives,
    so no replacement character is emitted for it. The pieces returned by `push` and `flush` join to
    the text the ids add to `prompt`'s: decode(prompt + ids) less decode(prompt), read at the
    prompt's last PROMPT_CONTEXT tokens. Without a prompt, `tokenizer.decode(ids)`; with one, a
    decoder that strips the leading space of a text (SentencePiece's, as Llama 2's and Mistral's)
    keeps the first token's (" Paris", not "Paris"), as vLLM's detokenizer does.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False,
                 prompt: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt[-PROMPT_CONTEXT:])
        if self._decode(context).endswith("\ufffd"):  # a prompt ending inside a character: no prefix
            context = []
        self._context: list[int] = context  # tokens of the last emitted piece: decoders may look back at them
        self._pending: list[int] = []  # tokens not emitted yet

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes ("" while a character is incomplete)."""
        self._pending.append(token_id)
        return self._take(hold_incomplete=True)

    def flush(self) -> str:
        """Returns what is still held back (an incomplete character decodes to a replacement char)."""
        return self._take(hold_incomplete=False)

    def _take(self, hold_incomplete: bool) -> str:
        if not self._pending:
            return ""
        prefix = self._decode(self._context)
        text = self._decode(self._context + self._pending)
        if hold_incomplete and text.endswith("\ufffd"):
            return ""
        self._context, self._pending = self._pending, []
        return text[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
