"""The serving engine and the OpenAI-compatible server.

Engine: continuous batching is lossless and batch-invariant: every request, whatever joins or
leaves the batch around it, gets exactly what it would get decoding alone (greedy: the target's own
greedy tokens; sampled: the same tokens for the same seed), also when it is admitted mid-flight.
Server: the endpoints' shapes, streaming that reassembles to the non-streamed text, stop strings
cut as OpenAI cuts them, and a 400 that names the parameter for every request it cannot serve."""
from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from dspark import SamplingParams, SpeculativeDecoder
from dspark.checkpoint import save_drafter
from dspark.compile.cache import save_compile_cache
from dspark.compile.options import build_decoder, compiled_step_options, speculative_config
from dspark.output import StopCondition
from dspark.serve.engine import Engine, EngineStopped, Histogram
from dspark.serve.metrics import IterationLog, prometheus_text
from dspark.serve.openai import BadRequest, Reply, TextStream, parse_chat, parse_completion, speculation
from dspark.serve import server as server_module
from dspark.serve.server import Handler, Server, client_gone
from dspark.serve import __main__ as serve_main
from test_decoder import STOP_TEXT, complete_text, target_greedy, tiny_pair
from test_tokenizer import sentencepiece_tokenizer


def drain(engine: Engine, requests) -> None:
    """Runs the engine in this thread until every request has finished."""
    while not all(r.result.finished or r.cancelled for r in requests):
        engine._admit(block=False)
        if any(engine.slots):
            engine._step()


def decode_alone(target, drafter, prompt, params, k=4):
    return SpeculativeDecoder(target, drafter, num_speculative_tokens=k).generate([prompt], params)[0].tokens


@torch.inference_mode()
def test_continuous_batching_greedy_equals_target_greedy_with_admission_mid_flight(one_thread):
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=3, max_model_len=64)
    prompts = [[1, 2, 3], [5, 9, 11, 2, 7], [4], [8, 8, 1]]
    lengths = [20, 6, 14, 9]
    first = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
             for p, n in zip(prompts[:3], lengths[:3])]
    engine._admit(block=False)
    for _ in range(3):  # the short request leaves; the fourth joins the batch mid-flight
        engine._step()
    late = engine.submit(prompts[3], SamplingParams(temperature=0.0, max_tokens=lengths[3], ignore_eos=True))
    requests = first + [late]
    drain(engine, requests)
    for request, prompt, n in zip(requests, prompts, lengths):
        assert request.result.tokens == target_greedy(target, prompt, n)
        assert request.result.finish_reason == "length" and request.events.queue[-1] is None
    assert engine.stats.finished == {"length": 4} and not any(engine.slots)


@torch.inference_mode()
def test_requests_done_at_their_first_token_leave_at_admission(one_thread):
    """max_tokens = 1: the prefill's token is the whole completion; no slot stays in use."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=2, max_model_len=64)
    requests = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)) for p in ([1, 2], [3])]
    engine._admit(block=False)
    assert not any(engine.slots) and [r.result.tokens for r in requests] == [
        target_greedy(target, [1, 2], 1), target_greedy(target, [3], 1)]
    late = engine.submit([4, 5], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    drain(engine, [late])
    assert late.result.tokens == target_greedy(target, [4, 5], 5)


@torch.inference_mode()
@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_seeded_request_draws_the_same_tokens_in_any_batch(one_thread, method, device):
    """Noise is keyed by (seed, position): a sampled request's tokens do not depend on its slot or
    its neighbours (on CUDA too, where a batch's size may change the kernels its products run).
    Control: another seed gives other tokens."""
    target, drafter = (m.to(device) for m in tiny_pair(vocab=64, logit_std=1.0, block_size=4))
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=4, rejection_sample_method=method)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=-1234, ignore_eos=True)
    alone = decoder.generate([[3, 1, 4]], params)[0].tokens
    engine = Engine(decoder, max_batch=4, max_model_len=64)
    others = [engine.submit([2, 7, 1, 8], SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True))
              for n in (5, 11)]
    engine._admit(block=False)
    engine._step()
    ours = engine.submit([3, 1, 4], params)
    control = engine.submit([3, 1, 4], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99,
                                                      ignore_eos=True))
    drain(engine, others + [ours, control])
    assert ours.result.tokens == alone
    assert control.result.tokens != alone


@torch.inference_mode()
def test_an_admission_drafts_the_new_rows_only(one_thread, monkeypatch):
    """A request joining the batch gets the drafts and proposals that drafting the whole batch would
    give it, and the row in flight is not drafted again: its drafts and proposals stay as its last
    step wrote them. One done at its first token is not drafted."""
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4), max_batch=4, max_model_len=64)
    runner = engine.runner
    params = [SamplingParams(temperature=t, max_tokens=12, seed=s, ignore_eos=True) for t, s in ((0.9, 1), (0.0, 2))]
    engine.submit([2, 7, 1, 8], params[0])
    engine._admit(block=False)
    engine._step()
    in_flight = runner.tokens[0].clone(), runner.draft_probs[0].clone()
    drafted = []
    draft = engine.decoder.draft
    monkeypatch.setattr(engine.decoder, "draft", lambda *a, rows: drafted.append(rows.tolist()) or draft(*a, rows=rows))
    for p in params:
        engine.submit([3, 1, 4], p)
    done_at_first = engine.submit([5, 9], SamplingParams(temperature=0.0, max_tokens=1))
    engine._admit(block=False)
    assert drafted == [[1, 2]] and done_at_first.result.finished  # it had row 3
    assert torch.equal(runner.tokens[0], in_flight[0]) and torch.equal(runner.draft_probs[0], in_flight[1])
    admitted = runner.tokens[1:3].clone(), runner.draft_probs[1:3].clone()
    runner.draft(range(3))
    assert torch.equal(runner.tokens[1:3], admitted[0]) and torch.equal(runner.draft_probs[1:3], admitted[1])


def test_submit_rejects_what_it_cannot_serve():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=2, max_model_len=32)
    with pytest.raises(ValueError, match="exceeds the maximum model length 32"):
        engine.submit([1] * 20, SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match=r"outside \[0, 64\): \[64\]"):
        engine.submit([1, 64], SamplingParams())
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="the prompt must be a list of token ids"):  # once failed the engine thread
        engine.submit([5, 2.5], SamplingParams())
    for bad in (10**9, 0):  # 0 once meant the model's maximum
        with pytest.raises(ValueError, match="max_model_len"):
            Engine(SpeculativeDecoder(target, drafter), max_model_len=bad)


@torch.inference_mode()
def test_a_cancelled_request_leaves_its_slot():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    request = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine._admit(block=False)
    engine._step()
    request.cancelled = True
    engine._step()
    assert engine.slots == [None] and request.result.finish_reason == "abort"
    assert request.events.queue[-1] is None
    assert engine.stats.finished == {"abort": 1}  # /metrics tells it from a success
    gone = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))
    assert engine.num_waiting() == 1
    gone.cancelled = True  # its client left while it waited
    assert engine.num_waiting() == 0  # the gauge of /metrics does not count it
    engine._admit(block=False)
    assert engine.slots == [None] and gone.result.finish_reason == "abort" and gone.result.tokens == []
    assert engine.stats.finished == {"abort": 2} and engine.stats.prompt_tokens == 2  # not prefilled


def test_a_request_whose_client_left_while_it_waited_is_dropped_before_the_next_step():
    """Not when a slot frees for it: its handler (a thread, and the client's socket) was held that long."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    running = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    gone = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))
    gone.cancelled = True
    step, seen = engine._step, []

    def first_step_then_stop():
        seen.append((gone.result.finish_reason, gone.events.queue[-1] if gone.events.qsize() else "no event",
                     running.result.finished))
        engine.shutdown()
        step()

    engine._step = first_step_then_stop
    engine.run()
    assert seen == [("abort", None, False)]


# ---------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def server(default_tokenizer):
    """The server on a random port: a tiny random target with the default model's tokenizer."""
    tokenizer = default_tokenizer
    target, drafter = tiny_pair(vocab=tokenizer.vocab_size, logit_std=1.0, block_size=4)
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=4, tokenizer=tokenizer)
    server = Server(("127.0.0.1", 0), Engine(decoder, max_batch=4, max_model_len=256), tokenizer, "tiny")
    server.start_engine()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def serving(engine: Engine, tokenizer):
    """A server of its own over `engine`, on a random port."""
    server = Server(("127.0.0.1", 0), engine, tokenizer, "tiny")
    server.start_engine()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def call(server, path, body=None, raw: bytes | None = None):
    """(status, parsed JSON or text) of a GET (body None) or POST."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def events(text: str) -> list:
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_streams_what_it_returns(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    status, whole = call(server, "/v1/completions", body)
    assert status == 200 and whole["object"] == "text_completion" and whole["model"] == "tiny"
    assert whole["usage"]["completion_tokens"] == 24 and whole["choices"][0]["finish_reason"] == "length"
    assert whole["metrics"]["speculative_decoding"]["num_drafts"] >= 1
    status, text = call(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = events(text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI's null until the usage chunk


def test_chat_completion_and_its_stream(server):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_completion_tokens": 12, "temperature": 0.8, "seed": 7}
    status, whole = call(server, "/v1/chat/completions", body)
    assert status == 200 and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    status, text = call(server, "/v1/chat/completions", {**body, "stream": True})
    chunks = events(text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert not any("usage" in c for c in chunks)  # without include_usage: no usage key at all
    assert streamed == whole["choices"][0]["message"]["content"]  # the same seed, the same tokens


@pytest.mark.parametrize("stop", [[], ["日本"], ["🚀 "], ["x**2", "Прив"], ["e\u0301 d"], ["absent"]])
def test_streamed_text_is_the_full_decode_cut_at_the_stop_string(default_tokenizer, stop):
    """What the server streams, delta by delta, joins to the whole output's decode (stop and special
    tokens left out) cut before its stop string; tokens come in steps of 1 to 4, up to where the
    engine would stop, with an end-of-turn token in the middle."""
    tok = default_tokenizer
    end_of_turn = tok.eos_token_id
    ids = tok.encode(STOP_TEXT)
    ids = ids[:9] + [end_of_turn] + ids[9:]
    stops_at = next((i for i in range(1, len(ids) + 1) if any(s in complete_text(tok, ids[:i]) for s in stop)),
                    len(ids))
    ids = ids[:stops_at]
    whole = tok.decode([t for t in ids if t != end_of_turn], skip_special_tokens=True)
    expected = whole[:min([whole.find(s) for s in stop if s in whole], default=len(whole))]
    stream, deltas, n = TextStream(tok, stop, {end_of_turn}), [], 0
    while n < len(ids):
        n = min(len(ids), n + 1 + n % 4)
        deltas.append(stream.delta(ids[:n], finished=n == len(ids)))
    assert "".join(deltas) == expected and "\ufffd" not in "".join(deltas)
    assert TextStream(tok, stop, {end_of_turn}).text(ids, finished=True) == expected


def test_the_answer_text_and_its_stop_strings_read_on_from_the_prompt(tmp_path):
    """With a SentencePiece tokenizer (Llama 2's), the answer to "The capital is" is " Paris.", not
    "Paris.": both what the client is sent and the text the engine's stop strings are looked for in."""
    sp = sentencepiece_tokenizer(tmp_path / "tokenizer.json")
    prompt, answer = sp.encode("The capital is"), sp.encode("Paris.")
    assert TextStream(sp, [], set(), prompt).text(answer, finished=True) == " Paris."
    params = SamplingParams(stop=" Paris", max_tokens=8)
    assert StopCondition(params, [], sp, prompt).finished(answer[:1]) == "stop"
    assert StopCondition(params, [], sp).finished(answer[:1]) is None  # no prompt: no space


def test_streamed_text_keeps_the_tokens_the_engine_appends_while_it_reads(default_tokenizer):
    tok = default_tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    live = ids[:5]  # the engine's list; it appends ids[5] while the stream decodes

    class EngineMeanwhile:
        def decode(self, piece, skip_special_tokens=False):
            if len(live) == 5:
                live.append(ids[5])
            return tok.decode(piece, skip_special_tokens=skip_special_tokens)

    stream = TextStream(EngineMeanwhile(), [], set())
    first = stream.delta(live, finished=False)
    live.extend(ids[6:])
    assert first + stream.delta(live, finished=True) == tok.decode(ids)


def test_a_stop_string_ends_the_text_before_it(server):
    body = {"prompt": "Count: 1 2 3", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    _, free = call(server, "/v1/completions", body)
    text = free["choices"][0]["text"]
    middle = len(text) // 2  # the first two printable characters from the middle on
    stop = next(text[i:i + 2] for i in range(middle, len(text) - 1) if text[i:i + 2].strip())
    _, cut = call(server, "/v1/completions", {**body, "stop": [stop]})
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[:text.find(stop)]
    _, text_stream = call(server, "/v1/completions", {**body, "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in events(text_stream)) == text[:text.find(stop)]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "stop_token_ids": 0}, "stop_token_ids"),  # once read as none
    ({"prompt": "x", "top_p": 0}, "top_p"),  # SamplingParams' checks
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": [str(i) for i in range(17)]}, "stop"),  # each is looked for after every token
    ({"prompt": "x", "stop": "y" * 513}, "stop"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "model": 3}, "model"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "colour": "blue"}, "colour"),
    ({"prompt": "x", "logprobs": 0}, "logprobs"),  # 0 asks for the sampled tokens' logprobs
    ({"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"prompt": "x", "top_k": 2**63}, "top_k"),  # once overflowed in the engine thread and stopped it
    ({"prompt": "x", "stream": True, "stream_options": "yes"}, "stream_options"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt": "x\ud800"}, "prompt"),  # a lone surrogate, which no tokenizer encodes
])
def test_bad_completion_requests_get_a_400_naming_the_parameter(server, body, param):
    status, answer = call(server, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["message"]
    assert call(server, "/health") == (200, {"status": "ok"})  # the engine serves on


@pytest.mark.parametrize("path, body, raw, status, words", [
    ("/v1/completions", None, b"{not json", 400, "not valid JSON"),
    ("/v1/completions", None, b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),  # too deep for json
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, None, 400, "maximum model length 256"),
    ("/v1/completions", {"prompt": [1, 10**9]}, None, 400, "outside [0, 49152)"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, None, 400, "at most 16 strings"),
    ("/v1/completions", {"prompt": "x", "model": ["tiny"]}, None, 400, "model must be a string"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, None, 400, "role"),
    ("/v1/embeddings", {"input": "x"}, None, 404, "no route"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, None, 404, "'gpt-4' is not served here"),
])
def test_other_bad_requests(server, path, body, raw, status, words):
    got, answer = call(server, path, body, raw)
    assert got == status and words in answer["error"]["message"]


def test_every_chunk_of_an_answer_carries_its_created_time(monkeypatch):
    reply = Reply("chat", "chatcmpl-x", "tiny")
    monkeypatch.setattr(time, "time", lambda: reply.created + 5.0)  # a stream five seconds long
    assert {reply.chunk("a", None)["created"], reply.chunk(None, "stop")["created"]} == {reply.created}


def test_response_ids_are_random_not_counted(server):
    body = {"prompt": "x", "max_tokens": 1}
    ids = {call(server, "/v1/completions", body)[1]["id"] for _ in range(2)}
    assert len(ids) == 2 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)  # once cmpl-0, cmpl-1 ...


def test_null_means_the_default(server):
    body = {"prompt": "x", "max_tokens": 2, "stream": None, "ignore_eos": None, "n": None, "stop": None,
            "stop_token_ids": None, "temperature": None}
    assert call(server, "/v1/completions", body)[0] == 200
    status, text = call(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": None}})
    assert status == 200 and "usage" not in events(text)[-1]


def test_a_string_prompt_gets_the_models_own_special_tokens():
    class AddsBos:  # as a Llama 3 tokenizer
        def encode(self, text, add_special_tokens=False):
            return [0, 7] if add_special_tokens else [7]

    assert parse_completion({"prompt": "hi"}, AddsBos())[0] == [0, 7]


def test_every_sampling_field_of_a_request_reaches_its_sampling_params():
    body = {"prompt": [5, 6], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3,
            "max_tokens": 7, "stop": "x", "stop_token_ids": [2], "ignore_eos": True}
    params = parse_completion(body, tokenizer=None)[1]
    assert params == SamplingParams(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, max_tokens=7,
                                    stop="x", stop_token_ids=[2], ignore_eos=True)
    assert parse_completion({**body, "top_k": -1}, tokenizer=None)[1].top_k == 0  # vLLM's "off"


def test_chat_text_parts_are_joined_by_newlines_and_developer_is_system(default_tokenizer):
    tok = default_tokenizer
    parts = {"messages": [{"role": "developer", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Line one."},
                                                       {"type": "text", "text": "Line two."}]}]}
    expected = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Line one.\nLine two."}],
                                       add_generation_prompt=True, tokenize=True)
    assert parse_chat(parts, tok, 256)[0] == expected


class TemplateSpy:
    """A tokenizer whose chat template records the messages it is given."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.messages = messages
        return [1, 2]


def test_a_messages_name_reaches_the_template_and_its_other_fields_must_be_empty():
    spy = TemplateSpy()
    chat = [{"role": "user", "content": "Hi.", "name": "ann"},
            {"role": "assistant", "content": "Hello.", "tool_calls": [], "refusal": None, "audio": {}}]  # as SDKs send them
    parse_chat({"messages": chat}, spy, 256)
    assert spy.messages == [{"role": "user", "content": "Hi.", "name": "ann"},
                            {"role": "assistant", "content": "Hello."}]
    for message, words in [({"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]},
                            r"messages\[0\]\.tool_calls is not supported"),
                           ({"role": "user", "content": "x", "name": 3}, r"messages\[0\]\.name must be a string")]:
        with pytest.raises(BadRequest, match=words) as caught:
            parse_chat({"messages": [message]}, spy, 256)
        assert caught.value.param == "messages"


def test_skip_special_tokens_may_ask_only_for_what_the_server_does():
    body = {"prompt": [5, 6]}
    for value in (True, None):
        assert parse_completion({**body, "skip_special_tokens": value}, tokenizer=None)[0] == [5, 6]
    for value in (False, "no", 1):
        with pytest.raises(BadRequest, match="skip_special_tokens must be true") as caught:
            parse_completion({**body, "skip_special_tokens": value}, tokenizer=None)
        assert caught.value.param == "skip_special_tokens"


def test_the_listen_backlog_holds_many_clients_at_once():
    """64 clients connecting at once all get through while the server is busy (the standard
    library's backlog of 5 dropped the rest, which waited a second or were reset)."""
    engine = type("Idle", (), {"run": lambda self: None, "shutdown": lambda self: None})()
    server = Server(("127.0.0.1", 0), engine, None, "x")  # listening, accepting none
    clients = []
    try:
        for _ in range(64):
            clients.append(socket.create_connection(server.server_address, timeout=0.5))
    finally:
        for client in clients:
            client.close()
        server.server_close()
    assert len(clients) == 64


def post_raw(server, headers: bytes, body: bytes, half_close: bool = False) -> bytes:
    """The whole answer to a POST /v1/completions written byte for byte, on a connection that closes
    (half_close: the client's side closes after the body, so a body cut short ends there)."""
    client = socket.create_connection(server.server_address, timeout=120)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + headers + b"\r\n" + body)
    if half_close:
        client.shutdown(socket.SHUT_WR)
    answer = b"".join(iter(lambda: client.recv(65536), b""))
    client.close()
    return answer


def test_a_chunked_body_is_read_as_a_whole_and_the_connection_kept(server):
    """Chunked bodies (as HTTP/1.1 clients send a body of unknown length) give the answer a
    Content-Length body gives, and the next request on the connection is read where it starts; with
    a Content-Length beside the chunked coding, the server closes after its answer (RFC 9112 §6.3)."""
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}).encode()
    _, expected = call(server, "/v1/completions", raw=body)
    connection = http.client.HTTPConnection(*server.server_address, timeout=120)
    for _ in range(2):
        connection.request("POST", "/v1/completions", body=iter([body[:5], body[5:17], body[17:]]),
                           headers={"Transfer-Encoding": "chunked", "Content-Type": "application/json"},
                           encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 200
        assert json.loads(response.read())["choices"] == expected["choices"]
    connection.close()
    framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(part), part) for part in (body[:9], body[9:]))
    answer = post_raw(server, b"Transfer-Encoding: chunked\r\n", framed + b"0\r\nX-Checksum: 1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and expected["choices"][0]["text"].encode() in answer
    client = socket.create_connection(server.server_address, timeout=10)  # the server idles 20 s first
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n")
    answer = b"".join(iter(lambda: client.recv(65536), b""))  # ends: with both headers, it closes
    client.close()
    assert answer.startswith(b"HTTP/1.1 200") and expected["choices"][0]["text"].encode() in answer


@pytest.mark.parametrize("coding, framed, status, message", [
    (b"chunked", b"zz\r\n{}\r\n0\r\n\r\n", 400, b"malformed chunk size line"),
    (b"chunked", b"0x2\r\n{}\r\n0\r\n\r\n", 400, b"malformed chunk size line"),
    (b"chunked", b"9\r\n{}", 400, b"shorter than its size"),
    (b"chunked", b"14\r\n" + b" " * 20 + b"\r\n0\r\n\r\n", 413, b"larger than 16 bytes"),
    (b"chunked", b"2\r\n{}\r\n0\r\n" + b"X-A: 1\r\n" * 4 + b"\r\n", 413, b"larger than 16 bytes"),  # trailers
    (b"gzip, chunked", b"2\r\n{}\r\n0\r\n\r\n", 501, b"is not supported (only chunked)"),
])
def test_a_bad_chunked_body_gets_an_error_that_says_why(server, monkeypatch, coding, framed, status, message):
    monkeypatch.setattr(server_module, "MAX_BODY_BYTES", 16)
    answer = post_raw(server, b"Transfer-Encoding: " + coding + b"\r\n", framed, half_close=True)
    assert answer.startswith(b"HTTP/1.1 %d" % status) and message in answer


def exchange(server, request: bytes) -> bytes:
    """Everything the server sends back for the raw `request` until it closes the connection (the
    server idles CLIENT_TIMEOUT_S, 20 s, on a connection it keeps)."""
    client = socket.create_connection(server.server_address, timeout=60)
    client.sendall(request)
    answer = b"".join(iter(lambda: client.recv(65536), b""))
    client.close()
    return answer


@pytest.mark.parametrize("headers, status, message", [
    (b"Content-Length: \xb2\r\n", 400, b"Content-Length must be one decimal number"),  # "2", as str.isdigit sees it
    (b"Content-Length: 2\r\nContent-Length: 3\r\n", 400, b"Content-Length must be one decimal number"),
    (b"Content-Length: 17\r\nExpect: 100-continue\r\n", 413, b"larger than 16 bytes"),
])
def test_a_body_of_a_bad_length_is_refused_and_the_connection_closed(server, monkeypatch, headers, status, message):
    """The body is not read, so nothing of it may be taken for a next request; a client that waits
    for a 100 Continue gets the refusal instead."""
    monkeypatch.setattr(server_module, "MAX_BODY_BYTES", 16)
    answer = exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 %d" % status) and message in answer
    assert answer.count(b"HTTP/1.1") == 1 and b"Connection: close" in answer


def test_a_get_with_a_body_is_answered_and_its_body_not_read_as_a_request(server):
    """The body here is a request line: once, it was answered as a second request."""
    answer = exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 18\r\n\r\nGET /x HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1


def test_methods_a_route_does_not_take_get_a_405_naming_the_allowed_ones(server):
    connection = http.client.HTTPConnection(*server.server_address, timeout=60)
    for method, path, allowed in [("POST", "/health", "GET, HEAD"), ("PUT", "/v1/models", "GET, HEAD"),
                                  ("DELETE", "/v1/completions", "POST"), ("OPTIONS", "/v1/chat/completions", "POST"),
                                  ("GET", "/v1/completions", "POST")]:
        connection.request(method, path)
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert (response.status, response.getheader("Allow")) == (405, allowed) and path in error["message"]
    connection.request("HEAD", "/health")  # health probes: the GET's headers, no body, the connection kept
    response = connection.getresponse()
    assert response.status == 200 and int(response.getheader("Content-Length")) > 0 and response.read() == b""
    connection.request("GET", "/health")
    assert json.loads(connection.getresponse().read()) == {"status": "ok"}
    connection.close()
    answer = exchange(server, b"BREW /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the standard library's refusal
    assert answer.startswith(b"HTTP/1.1 501") and json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]


def test_a_stalled_or_idle_client_is_let_go(server, monkeypatch):
    """A body that stops arriving gets a 408 and the connection closes; so does an idle one (each
    once held a server thread for ever)."""
    monkeypatch.setattr(Handler, "timeout", 0.2)
    stalled = socket.create_connection(server.server_address, timeout=10)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    answer = b"".join(iter(lambda: stalled.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.2 s" in answer
    idle = socket.create_connection(server.server_address, timeout=10)
    assert idle.recv(1) == b""  # closed by the server, not the 10 s timeout here
    stalled.close()
    idle.close()


def test_the_get_endpoints(server):
    assert call(server, "/health") == (200, {"status": "ok"})
    assert call(server, "/version") == (200, {"version": importlib.metadata.version("dspark")})
    status, models = call(server, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
    assert isinstance(models["data"][0]["created"], int)  # typed clients require it
    assert call(server, "/v1/completions")[0] == 405
    call(server, "/v1/completions", {"prompt": "metrics", "max_tokens": 3, "temperature": 0})
    status, text = call(server, "/metrics")
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line and not line.startswith("#") and "position" not in line and "finished_reason" not in line}
    finished = {line.split('finished_reason="')[1].split('"')[0]: float(line.split()[-1])
                for line in text.splitlines() if line.startswith("dspark:request_success_total{")}
    assert status == 200 and finished["length"] >= 1
    assert values["dspark:spec_decode_num_draft_tokens_total"] == 4 * values["dspark:spec_decode_num_drafts_total"]
    assert values["dspark:generation_tokens_total"] >= 3
    assert values["dspark:time_to_first_token_seconds_count"] >= 1


@torch.inference_mode()
@pytest.mark.parametrize("k", [0, 4])
def test_the_iteration_log_gives_the_rates_and_acceptance_of_the_seconds_since_its_last_line(k):
    target, drafter = tiny_pair(vocab=64, logit_std=1.0, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter if k else None), max_batch=2, max_model_len=64)
    clock = [100.0]
    log = IterationLog(engine, clock=lambda: clock[0])
    requests = [engine.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
                for _ in range(2)]
    drain(engine, requests)
    clock[0] += 2.0
    expected = "dspark: prompt 3.0 tokens/s, generation 20.0 tokens/s, 0 running, 0 waiting"
    if k:
        stats = engine.stats
        assert sum(stats.accepted_per_position) == stats.accepted_tokens > 0
        expected += (f"; mean acceptance length {1 + stats.accepted_tokens / stats.drafts:.2f}, accepted per "
                     "position " + " ".join(f"{n / stats.drafts:.2f}" for n in stats.accepted_per_position))
    assert log.line() == expected
    clock[0] += 10.0
    assert log.line() is None  # an idle engine writes nothing


def test_a_log_stats_interval_that_is_not_positive_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve_main.parse_args(["--log-stats-interval", "0"])
    assert "--log-stats-interval must be > 0, got 0.0" in capsys.readouterr().err


def test_a_failing_step_fails_every_request_and_stops_the_engine():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    running = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    waiting = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))

    def broken(*args):
        raise RuntimeError("device lost")

    engine.decoder.step = broken
    with pytest.raises(RuntimeError, match="device lost"):
        engine.run()
    for request in (running, waiting):
        assert isinstance(request.events.queue[-1], RuntimeError)
    assert engine.stopped.is_set() and engine.slots == [None]


@torch.inference_mode()
def test_a_failing_prefill_fails_only_the_requests_it_admitted():
    """A prefill's failure (say, out of memory on a long prompt) once stopped the engine and every
    request in flight with it."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=2, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    running = engine.submit([1, 2], params)
    engine._admit(block=False)
    engine._step()
    failing = engine.submit([3, 4], params)
    prefill = engine.decoder.prefill
    engine.decoder.prefill = lambda *args: (_ for _ in ()).throw(RuntimeError("out of memory"))
    engine._admit(block=False)
    engine.decoder.prefill = prefill
    assert isinstance(failing.events.get_nowait(), RuntimeError) and engine.slots[1] is None
    drain(engine, [running])
    assert running.result.tokens == target_greedy(target, [1, 2], 12)
    assert not engine.stopped.is_set() and engine.stats.finished == {"abort": 1, "length": 1}


@torch.inference_mode()
def test_a_generate_on_the_engines_models_stops_it_instead_of_corrupting_requests():
    """generate sets up caches of its own on the same target: the engine's requests in flight lost
    their context and went on silently with wrong tokens."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine._admit(block=False)
    engine._step()
    SpeculativeDecoder(target, drafter).generate([[5]], SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="caches are no longer this StepRunner's"):
        engine._step()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's raise
def test_a_stream_whose_generation_fails_ends_with_an_error_event_and_done(default_tokenizer):
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)

    def broken(*args):
        raise RuntimeError("device lost")

    engine.decoder.step = broken
    with serving(engine, default_tokenizer) as server:
        status, text = call(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 8, "stream": True})
    assert status == 200 and "device lost" in events(text)[-1]["error"]["message"]


def test_a_request_waiting_when_the_engine_shuts_down_gets_a_503(default_tokenizer):
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=256)
    step = engine.decoder.step

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return step(*args, **kwargs)

    engine.decoder.step = slow
    answer = []
    with serving(engine, default_tokenizer) as server:
        body = {"prompt": [1, 2], "max_tokens": 200, "ignore_eos": True}  # 40+ steps of 20 ms
        client = threading.Thread(target=lambda: answer.extend(call(server, "/v1/completions", body)))
        client.start()
        deadline = time.monotonic() + 60
        while not any(engine.slots) and time.monotonic() < deadline:  # until it is decoding
            time.sleep(0.005)
        engine.shutdown()
        client.join(60)
    status, body = answer
    assert status == 503 and body["error"]["message"] == "the engine was shut down"  # was a 500


def test_metrics_escape_the_model_name():
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    text = prometheus_text(engine, 'my "model"\\x\nz')
    assert all(line.startswith(("# ", "dspark:")) for line in text.splitlines())  # a raw newline split one
    assert 'model_name="my \\"model\\"\\\\x\\nz"' in text
    assert 'dspark:time_to_first_token_seconds_count{model_name="my' in text


def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it():
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 3.0):
        histogram.observe(value)
    assert (histogram.counts, histogram.total) == ([2, 1, 1], 6.0)


def test_the_latency_histograms_count_each_request_served():
    """Every admitted request has a queue time and a first token; those that stop or reach their
    length (not an abort) an end-to-end latency, and a time per output token if they have a second."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=3, max_model_len=64)
    requests = [engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                for n in (1, 6, 20)]
    with torch.inference_mode():
        engine._admit(block=False)
        requests[2].cancelled = True  # its client leaves after its first token
        drain(engine, requests)  # its first step frees the cancelled one's slot
    assert engine.stats.finished == {"length": 2, "abort": 1}
    lines = prometheus_text(engine, "m").splitlines()
    for name, count in [("time_to_first_token", 3), ("request_queue_time", 3), ("e2e_request_latency", 2),
                        ("request_time_per_output_token", 1)]:
        prefix = f"dspark:{name}_seconds"
        assert f"# TYPE {prefix} histogram" in lines
        buckets = [float(line.split()[-1]) for line in lines if line.startswith(prefix + "_bucket{")]
        assert buckets == sorted(buckets) and buckets[-1] == count  # cumulative; le="+Inf" holds all
        assert any(line.startswith(prefix + '_bucket{model_name="m",le="+Inf"}') for line in lines)
        assert [float(line.split()[-1]) for line in lines if line.startswith(prefix + "_count{")] == [count]
    sums = {line.split("_seconds_sum")[0]: float(line.split()[-1]) for line in lines if "_seconds_sum{" in line}
    assert sums["dspark:e2e_request_latency"] >= sums["dspark:time_to_first_token"] > 0


def test_after_shutdown_nothing_waits_forever():
    """A request submitted once the engine stops is refused; those in flight or waiting at shutdown
    receive EngineStopped rather than waiting on events that never come, and count as aborted."""
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)
    running = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    waiting = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=5))
    engine._admit(block=False)
    engine.shutdown()
    engine.run()
    for request in (running, waiting):
        assert isinstance(request.events.queue[-1], EngineStopped)
    assert engine.stats.finished == {"abort": 2}
    with pytest.raises(EngineStopped):
        engine.submit([4], SamplingParams(max_tokens=2))


def test_client_gone_tells_a_closed_connection_from_a_quiet_or_talking_one():
    """What a non-streaming request polls while it waits, to give up its slot once its client left."""
    ours, theirs = socket.socketpair()
    assert not client_gone(ours)  # quiet
    theirs.sendall(b"GET")  # a pipelined request: still there
    assert not client_gone(ours)
    theirs.close()
    ours.recv(3)
    assert client_gone(ours)
    ours.close()


def test_client_gone_reads_descriptors_past_1024():
    """select() refuses a descriptor of 1024 or more; a server with many connections has them."""
    ours, theirs = socket.socketpair()
    high = socket.socket(fileno=os.dup2(ours.fileno(), 1500))
    ours.close()
    assert not client_gone(high)
    theirs.close()
    assert client_gone(high)
    high.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_closes_its_side_is_gone_and_gets_no_answer(server, monkeypatch, stream):
    """Its request is aborted (freeing the slot) and nothing is written to it: not a 200 with a
    finish reason OpenAI does not have."""
    monkeypatch.setattr(server_module, "CLIENT_POLL_S", 0.01)
    aborted = server.engine.stats.finished.get("abort", 0)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True, "stream": stream}).encode()
    client = socket.create_connection(("127.0.0.1", server.server_address[1]))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
    client.shutdown(socket.SHUT_WR)
    answer = b"".join(iter(lambda: client.recv(65536), b""))
    client.close()
    assert server.engine.stats.finished.get("abort", 0) == aborted + 1
    assert b"[DONE]" not in answer and b'"finish_reason": "abort"' not in answer
    assert answer == b"" or stream  # a stream may have sent its first events before the poll


def test_unsupported_parameters_at_their_off_values_are_accepted(server):
    body = {"prompt": "x", "max_tokens": 2, "repetition_penalty": 1.0, "best_of": 1, "frequency_penalty": 0,
            "response_format": {"type": "text"}, "logprobs": None, "echo": False, "logit_bias": {}, "suffix": ""}
    assert call(server, "/v1/completions", body)[0] == 200
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": [], "tool_choice": "none",
            "parallel_tool_calls": True, "store": False}  # what agent frameworks send with no tools
    assert call(server, "/v1/chat/completions", chat)[0] == 200
    for key, value in [("tool_choice", "auto"), ("store", True), ("suffix", " end")]:
        status, answer = call(server, "/v1/chat/completions", {**chat, key: value})
        assert status == 400 and answer["error"]["param"] == key


def test_a_temperature_below_1e_5_is_greedy(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True}
    _, greedy = call(server, "/v1/completions", {**body, "temperature": 0})
    _, tiny = call(server, "/v1/completions", {**body, "temperature": 1e-40})  # once: token 0 repeated
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_without_speculation_the_response_reports_none():
    target, _ = tiny_pair(vocab=64)
    engine = Engine(SpeculativeDecoder(target, None), max_batch=1, max_model_len=32)
    request = engine.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    with torch.inference_mode():
        drain(engine, [request])
    assert request.result.tokens == target_greedy(target, [1, 2], 5)
    assert speculation(request.result) is None and engine.stats.drafts == 0


@pytest.mark.parametrize("text, words", [("{'k': 1}", "is not JSON"), ("[1]", "must be a JSON object"),
                                         ('{"k": 1}', "unknown keys"), ('{"method": "eagle"}', "method must name DSpark, got 'eagle'"),
                                         ('{"num_speculative_tokens": "7"}', "num_speculative_tokens must be"),
                                         ('{"use_rejection_sampling": "false"}', "true or false"),
                                         ('{"model": 3}', "model must be"),
                                         ('{"decoding_type": "Eagle3"}', "decoding_type must name DSpark, got 'Eagle3'"),
                                         ('{"num_speculative_tokens": 3, "max_draft_len": 4}',
                                          "max_draft_len=4 disagrees with num_speculative_tokens=3"),
                                         ('{"max_draft_len": -1}', "max_draft_len must be an integer >= 0, got -1")])
def test_a_bad_speculative_config_exits_naming_what_is_wrong(text, words):
    with pytest.raises(SystemExit, match=words):
        speculative_config(text)


@pytest.mark.parametrize("spec, k, block, greedy_drafts", [
    ("{}", 3, False, False),  # the drafter's block size, vLLM's defaults
    ('{"max_draft_len": 2, "rejection_sample_method": "block"}', 2, True, False),
    ('{"num_speculative_tokens": 1, "use_rejection_sampling": false}', 1, False, True),
    ('{"draft_sample_method": "greedy"}', 3, False, True),
    ('{"model": "none"}', 0, False, False),
    ('{"num_speculative_tokens": 0}', 0, False, False),
    # the seed's TensorRT-LLM config, as it reads
    ('{"decoding_type": "DSpark", "max_draft_len": 2, "speculative_model": "DRAFTER", "use_rejection_sampling": true,'
     ' "rejection_sample_method": "block"}', 2, True, False),
    ('{"method": "dspark", "decoding_type": "DSpark", "speculative_model_dir": "DRAFTER"}', 3, False, False)])
def test_the_speculative_config_reaches_the_decoder(default_tokenizer, tmp_path, spec, k, block, greedy_drafts):
    from test_checkpoint import make_drafter
    from test_loading import make_model, save_hf
    target = make_model(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0)
    save_hf(target, tmp_path / "target")
    default_tokenizer.backend.save(str(tmp_path / "target" / "tokenizer.json"))
    save_drafter(make_drafter(target), tmp_path / "drafter")  # block size 3
    spec = json.loads(spec.replace("DRAFTER", str(tmp_path / "drafter")))
    if not {"model", "speculative_model", "speculative_model_dir"} & set(spec):
        spec["model"] = str(tmp_path / "drafter")
    args = serve_main.parse_args(["--model", str(tmp_path / "target"), "--device", "cpu", "--dtype", "float32",
                                  "--speculative-config", json.dumps(spec)])
    decoder, _ = build_decoder(args, compile=False)
    assert (decoder.k, decoder.block_verify, decoder.greedy_drafts) == (k, block, greedy_drafts)
    assert (decoder.drafter is None) == (k == 0) == (args.drafter == "none")  # K = 0 loads no drafter


def test_the_default_max_model_len_fits_a_model_of_a_shorter_context(default_tokenizer, tmp_path):
    """--max-model-len's default is 2048 or the model's maximum, if smaller (a 512-token model once
    failed to start); given, it is kept."""
    from test_loading import make_model, save_hf
    save_hf(make_model(max_position_embeddings=512), tmp_path)
    default_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    for given, want in (([], 512), (["--max-model-len", "300"], 300)):
        args = serve_main.parse_args(["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", *given])
        build_decoder(args, compile=False)
        assert args.max_model_len == want


def test_bad_server_options_exit_naming_them(default_tokenizer, tmp_path):
    """Each once ended in a traceback, from the decoder's or the engine's build."""
    from test_loading import make_model, save_hf
    save_hf(make_model(max_position_embeddings=512), tmp_path)
    default_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    given = ["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--port", "0"]
    busy = socket.create_server(("127.0.0.1", 0))  # a port in use
    for options, words in [(["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
                           (["--max-model-len", "513"], r"--max-model-len must be in \[1, 512\] for this model"),
                           (["--speculative-config", '{"num_speculative_tokens": 3}'],
                            "num_speculative_tokens=3 needs a drafter"),
                           (["--model", str(tmp_path / "absent")], "absent: no such model folder"),
                           (["--host", "127.0.0.1", "--port", str(busy.getsockname()[1])], "cannot serve on")]:
        with pytest.raises(SystemExit, match=f"python -m dspark.serve: .*{words}"):
            serve_main.main([*given, *options])
    busy.close()


@pytest.mark.parametrize("model, name", [(None, "SmolLM2-135M-Instruct"),
                                         ("m/Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B-Instruct"),
                                         ("m/Qwen2.5-0.5B-Instruct/", "Qwen2.5-0.5B-Instruct"),
                                         ("m/SmolLM2-135M.Q4_1.GGUF", "SmolLM2-135M.Q4_1")])
def test_the_served_name_is_the_models_folder_or_file_name(model, name):
    """Path.stem once cut folder names at their last dot (Qwen2.5-0.5B-Instruct was served as Qwen2.5-0)."""
    assert serve_main.served_name(model) == name


def test_a_compile_cache_for_other_options_stops_the_server_naming_them(default_tokenizer, tmp_path):
    """A warm-up's cache records the server options its step was compiled for; a server started
    with others exits naming the option (it used to load the file and compile everything again)."""
    from test_loading import make_model, save_hf
    save_hf(make_model(), tmp_path)
    default_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    given = ["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--port", "0"]
    args = serve_main.parse_args([*given, "--max-batch", "4"])
    decoder, _ = build_decoder(args, compile=False)
    torch.compile(lambda x: x.cos() + 1)(torch.randn(4))  # something compiled, to save
    cache = tmp_path / "cache.bin"
    save_compile_cache(cache, decoder.device, compiled_step_options(args, decoder))
    with pytest.raises(SystemExit, match=r"other max_batch .*'max_batch': \(4, 8\)"):
        serve_main.main([*given, "--compile-cache", str(cache)])
    with pytest.raises(SystemExit, match="--compile-cache: .*No such file"):
        serve_main.main([*given, "--compile-cache", str(tmp_path / "missing.bin")])

