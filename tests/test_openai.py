"""The OpenAI shapes: what the official `openai` client gets from a real server process on the default
model (completion, chat, streams that reassemble to the non-streamed text, n samples, usage and the
speculation metrics, the API key, errors as the client's exception classes), and the request models
and text streams underneath."""
from __future__ import annotations

import json
import time

import openai as openai_client
import pytest
import torch

from dspark import SamplingParams, SpeculativeDecoder, load_target
from dspark.engine import Engine
from dspark.loading import default_gguf_path
from dspark.output import GenerationResult, StopCondition
from dspark.serve.openai import (BadRequest, ChatCompletionRequest, CompletionRequest, Reply, TextStream,
                                 sample_params)
from dspark.serve.server import create_app, validated
from test_decoder import STOP_TEXT, complete_text, tiny_pair
from test_serve_harness import ServerProcess
from test_tokenizer import sentencepiece_tokenizer

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def default_server():
    """The default model pair on a free port, with an API key, in float32 (the log-probabilities test
    computes the target's own in float32)."""
    process = ServerProcess("--api-key", KEY, "--max-batch", "4", "--dtype", "float32")
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(default_server):
    return openai_client.OpenAI(base_url=default_server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def test_a_completion_and_its_stream_give_the_same_text_at_temperature_0(client):
    whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                      max_tokens=24, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.choices[0].text and whole.usage.completion_tokens <= 24
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    spec = chunks[-1].model_extra["metrics"]["speculative_decoding"]  # vLLM's per-request shape
    assert spec["num_drafts"] >= 1 and len(spec["accepted_per_position"]) == 7


def test_a_chat_and_its_stream_give_the_same_text_at_temperature_0(client):
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                           temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@torch.inference_mode()
def test_logprobs_are_the_targets_log_softmax_computed_here(client, default_tokenizer):
    """A completion of token ids at T = 0 with echo and 5 alternatives: its tokens are the target's
    greedy continuation, and every token after the first carries the target's log-softmax at its
    position, with the 5 likeliest tokens', as one plain float32 forward of the default target in this
    process computes them (no cache, no speculation)."""
    target = load_target(default_gguf_path())
    prompt = default_tokenizer.encode("The capital of France is")
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(target(torch.tensor([ids]), torch.arange(len(ids))[None])[0][0, -1].argmax()))
    logprobs = target(torch.tensor([ids]), torch.arange(len(ids))[None])[0][0].log_softmax(-1)
    answer = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0,
                                       logprobs=5, echo=True, extra_body={"ignore_eos": True})
    columns = answer.choices[0].logprobs
    assert columns.tokens == [default_tokenizer.decode([i]) for i in ids]
    assert columns.token_logprobs[0] is None and columns.top_logprobs[0] is None
    for position in range(1, len(ids)):
        assert columns.token_logprobs[position] == pytest.approx(logprobs[position - 1, ids[position]].item(), abs=1e-4)
        top = logprobs[position - 1].topk(5)
        want = {default_tokenizer.decode([i]): v for i, v in zip(top.indices.tolist(), top.values.tolist())}
        assert columns.top_logprobs[position] == pytest.approx(want, abs=1e-4)
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "user", "content": "Hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)


def test_n_samples_of_one_prompt_are_indexed_and_streamed_with_their_index(client):
    """Seeded: sample i draws with seed + i, so the three differ (at T = 1 over 8 tokens of a
    49,152-token vocabulary a tie is beyond chance) and the stream's samples are the answer's."""
    asked = dict(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5,
                 n=3, extra_body={"ignore_eos": True})
    whole = client.completions.create(**asked)
    assert [c.index for c in whole.choices] == [0, 1, 2] and len({c.text for c in whole.choices}) == 3
    assert whole.usage.completion_tokens == 24
    one = client.completions.create(**{**asked, "n": 1})
    assert one.choices[0].text == whole.choices[0].text  # sample 0 is the n = 1 answer
    texts = ["", "", ""]
    for chunk in client.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


def test_errors_reach_the_client_as_its_exception_classes(default_server, client):
    with pytest.raises(openai_client.BadRequestError, match="temperature") as caught:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", temperature=5)
    assert caught.value.body["param"] == "temperature"
    with pytest.raises(openai_client.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai_client.BadRequestError, match="maximum model length"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=10**6)
    keyless = openai_client.OpenAI(base_url=default_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai_client.AuthenticationError) as caught:
        keyless.models.list()
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]


# ---------------------------------------------------------------------------- the shapes underneath


def test_sample_seeds_are_the_seed_plus_the_index_wrapped_into_int64():
    params = SamplingParams(seed=2**63 - 2)
    assert [p.seed for p in sample_params(params, 3)] == [2**63 - 2, 2**63 - 1, -2**63]
    assert sample_params(SamplingParams(), 2) == [SamplingParams(), SamplingParams()]  # unseeded: each its own


@pytest.mark.parametrize("stop", [[], ["日本"], ["🚀 "], ["x**2", "Прив"], ["e\u0301 d"], ["absent"]])
def test_streamed_text_is_the_full_decode_cut_at_the_stop_string(default_tokenizer, stop):
    """The text the engine builds (StopCondition, once per request) and what the server streams of
    it, delta by delta, join to the whole output's decode (stop and special tokens left out) cut
    before its stop string; tokens come in steps of 1 to 4, up to where the engine stops, with a
    special token (end of turn, not a stop token here) in the middle of a character's bytes."""
    tok = default_tokenizer
    end_of_turn = tok.eos_token_id
    ids = tok.encode(STOP_TEXT)
    ids = ids[:9] + [end_of_turn] + ids[9:]
    stops_at = next((i for i in range(1, len(ids) + 1) if any(s in complete_text(tok, ids[:i]) for s in stop)),
                    len(ids))
    ids = ids[:stops_at]
    whole = tok.decode([t for t in ids if t != end_of_turn], skip_special_tokens=True)
    expected = whole[:min([whole.find(s) for s in stop if s in whole], default=len(whole))]
    params = SamplingParams(stop=stop, max_tokens=len(ids), detokenize=True)  # (end of turn: a special token here)
    condition, result = StopCondition(params, [], tok), GenerationResult()
    stream, deltas, n = TextStream(stop), [], 0
    while n < len(ids):
        n = min(len(ids), n + 1 + n % 4)
        condition.extend(result, ids[len(result.tokens):n])
        deltas.append(stream.delta(result.text, finished=result.finished))
    assert result.finished and result.tokens == ids
    assert "".join(deltas) == expected == result.text and "\ufffd" not in result.text


def test_the_answer_text_and_its_stop_strings_read_on_from_the_prompt(tmp_path):
    """With a SentencePiece tokenizer (Llama 2's), the answer to "The capital is" is " Paris.", not
    "Paris.": both what the client is sent and the text the engine's stop strings are looked for in."""
    sp = sentencepiece_tokenizer(tmp_path / "tokenizer.json")
    prompt, answer = sp.encode("The capital is"), sp.encode("Paris.")
    condition, result = StopCondition(SamplingParams(max_tokens=len(answer), detokenize=True), [], sp, prompt), \
        GenerationResult()
    condition.extend(result, answer)
    assert result.text == " Paris."
    params = SamplingParams(stop=" Paris", max_tokens=8)
    assert StopCondition(params, [], sp, prompt).finished(answer[:1]) == "stop"
    assert StopCondition(params, [], sp).finished(answer[:1]) is None  # no prompt: no space


def test_text_needs_a_tokenizer_and_the_server_the_decoders():
    with pytest.raises(ValueError, match="detokenize=True needs a tokenizer"):
        StopCondition(SamplingParams(detokenize=True), [])
    with pytest.raises(ValueError, match="detokenize must be a bool, got 1"):
        SamplingParams(detokenize=1)
    target, drafter = tiny_pair(vocab=64, block_size=4)
    with pytest.raises(ValueError, match="the server needs the decoder's tokenizer"):
        create_app(Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=16), "tiny", 16)


def test_a_stream_never_takes_back_what_it_sent_and_holds_back_what_could_begin_a_stop_string():
    stream = TextStream(["STOP"])
    assert stream.delta("Hello ST", finished=False) == "Hello"  # "ST" may begin "STOP"
    assert stream.delta("Hello STAR", finished=False) == " S"
    assert stream.delta("Hello STARS", finished=True) == "TARS"
    cut = TextStream(["lo"])
    assert cut.delta("Hel", finished=False) == "He" and cut.delta("He", finished=True) == ""  # cut at "lo"


def test_every_chunk_of_an_answer_carries_its_created_time(monkeypatch):
    reply = Reply("chat", "chatcmpl-x", "tiny", prompt_tokens=3)
    monkeypatch.setattr(time, "time", lambda: reply.created + 5.0)  # a stream five seconds long
    assert {json.loads(reply.chunk(0, "a"))["created"], json.loads(reply.chunk(0, None, "stop"))["created"]} == {
        reply.created}


def test_a_string_prompt_gets_the_models_own_special_tokens():
    class AddsBos:  # as a Llama 3 tokenizer
        def encode(self, text, add_special_tokens=False):
            return [0, 7] if add_special_tokens else [7]

    assert validated({"prompt": "hi"}, CompletionRequest).prompt_ids(AddsBos()) == [0, 7]


def test_every_sampling_field_of_a_request_reaches_its_sampling_params():
    body = {"prompt": [5, 6], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3,
            "max_tokens": 7, "stop": "x", "stop_token_ids": [2], "ignore_eos": True}
    params = validated(body, CompletionRequest).sampling_params(16)
    assert params == SamplingParams(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, max_tokens=7,
                                    stop="x", stop_token_ids=[2], ignore_eos=True, detokenize=True)
    assert validated({**body, "top_k": -1}, CompletionRequest).sampling_params(16).top_k == 0  # vLLM's "off"
    chat = validated({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9},
                     ChatCompletionRequest)
    assert chat.sampling_params(100).max_tokens == 9  # the chat's name for it


def test_chat_text_parts_are_joined_by_newlines_and_developer_is_system(default_tokenizer):
    tok = default_tokenizer
    parts = {"messages": [{"role": "developer", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Line one."},
                                                       {"type": "text", "text": "Line two."}]}]}
    expected = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Line one.\nLine two."}],
                                       add_generation_prompt=True, tokenize=True)
    assert validated(parts, ChatCompletionRequest).prompt_ids(tok) == expected


class TemplateSpy:
    """A tokenizer whose chat template records the messages it is given."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.messages = messages
        return [1, 2]


def test_a_messages_name_reaches_the_template_and_its_other_fields_must_be_empty():
    spy = TemplateSpy()
    chat = [{"role": "user", "content": "Hi.", "name": "ann"},
            {"role": "assistant", "content": "Hello.", "tool_calls": [], "refusal": None, "audio": {}}]  # as SDKs send them
    validated({"messages": chat}, ChatCompletionRequest).prompt_ids(spy)
    assert spy.messages == [{"role": "user", "content": "Hi.", "name": "ann"},
                            {"role": "assistant", "content": "Hello."}]
    for message, words in [({"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]},
                            r"messages\[0\]: tool_calls is not supported"),
                           ({"role": "user", "content": "x", "name": 3}, r"messages\[0\]\.name: Input should be a "
                                                                         "valid string")]:
        with pytest.raises(BadRequest, match=words) as caught:
            validated({"messages": [message]}, ChatCompletionRequest)
        assert caught.value.param == "messages"


def test_skip_special_tokens_may_ask_only_for_what_the_server_does():
    body = {"prompt": [5, 6]}
    for value in (True, None):
        assert validated({**body, "skip_special_tokens": value}, CompletionRequest).prompt_ids(None) == [5, 6]
    for value, words in ((False, "skip_special_tokens must be true"), ("no", "valid boolean"), (1, "valid boolean")):
        with pytest.raises(BadRequest, match=words) as caught:
            validated({**body, "skip_special_tokens": value}, CompletionRequest)
        assert caught.value.param == "skip_special_tokens"
