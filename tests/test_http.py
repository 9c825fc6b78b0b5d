"""The HTTP layer (the real app on uvicorn, in this process, over a tiny random model with the default
model's tokenizer): the endpoints' shapes, streams that reassemble to the answer, a 400 that names
the parameter for every request the server cannot serve, the other error statuses, the safe
defaults (Host allow-list, API key, content type, no CORS), timeouts, and clients that leave."""
from __future__ import annotations

import http.client
import importlib.metadata
import json
import logging
import os
import re
import resource
import socket
import threading
import time

import pytest

from dspark import SpeculativeDecoder
from dspark.engine import Engine
from dspark.serve import process as process_module
from dspark.serve import server as server_module
from dspark.serve.process import QuietProbes
from test_decoder import tiny_pair
from test_serve_harness import call, events, exchange, serving, tiny_engine


@pytest.fixture(scope="module")
def server(default_tokenizer):
    with serving(tiny_engine(default_tokenizer), default_tokenizer) as running:
        yield running


def test_completion_streams_what_it_returns(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    status, whole = call(server.port, "/v1/completions", body)
    assert status == 200 and whole["object"] == "text_completion" and whole["model"] == "tiny"
    assert whole["usage"]["completion_tokens"] == 24 and whole["choices"][0]["finish_reason"] == "length"
    assert whole["metrics"]["speculative_decoding"]["num_drafts"] >= 1
    status, text = call(server.port, "/v1/completions",
                        {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = events(text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert chunks[-1]["metrics"]["speculative_decoding"] == whole["metrics"]["speculative_decoding"]
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI's null until the usage chunk


def test_chat_completion_and_its_stream(server):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_completion_tokens": 12, "temperature": 0.8, "seed": 7}
    status, whole = call(server.port, "/v1/chat/completions", body)
    assert status == 200 and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    status, text = call(server.port, "/v1/chat/completions", {**body, "stream": True})
    chunks = events(text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert not any("usage" in c for c in chunks)  # without include_usage: no usage key at all
    assert streamed == whole["choices"][0]["message"]["content"]  # the same seed, the same tokens


def test_a_stop_string_ends_the_text_before_it(server):
    body = {"prompt": "Count: 1 2 3", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    _, free = call(server.port, "/v1/completions", body)
    text = free["choices"][0]["text"]
    middle = len(text) // 2  # the first two printable characters from the middle on
    stop = next(text[i:i + 2] for i in range(middle, len(text) - 1) if text[i:i + 2].strip())
    _, cut = call(server.port, "/v1/completions", {**body, "stop": [stop]})
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[:text.find(stop)]
    _, text_stream = call(server.port, "/v1/completions", {**body, "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in events(text_stream)) == text[:text.find(stop)]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": float("inf")}, "top_p"),
    ({"prompt": "x", "min_p": -float("inf")}, "min_p"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),  # OpenAI's completions take 0-5
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
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
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": "x", "top_k": 2**63}, "top_k"),  # once overflowed in the engine thread and stopped it
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "stream": True, "stream_options": "yes"}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt": "x\ud800"}, "prompt"),  # a lone surrogate, which no tokenizer encodes
])
def test_bad_completion_requests_get_a_400_naming_the_parameter(server, body, param):
    status, answer = call(server.port, "/v1/completions", raw=json.dumps(body).encode())  # NaN as JSON writes it
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    assert call(server.port, "/health") == (200, {"status": "ok"})  # the engine serves on


@pytest.mark.parametrize("path, body, raw, status, words", [
    ("/v1/completions", None, b"{not json", 400, "not valid JSON"),
    ("/v1/completions", None, b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),  # too deep for json
    ("/v1/completions", None, b"[1]", 400, "must be a JSON object"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, None, 400, "maximum model length 256"),
    ("/v1/completions", {"prompt": [1, 10**9]}, None, 400, "outside [0, 49152)"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, None, 400, "at most 16 items"),
    ("/v1/completions", {"prompt": "x", "model": ["tiny"]}, None, 400, "model: Input should be a valid string"),
    ("/v1/completions", {"max_tokens": 3}, None, 400, "prompt: Field required"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "at least 1 item"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, None, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400,
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None, 400,
     "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     None, 400, "top_logprobs: Input should be less than or equal to 20"),
    ("/v1/embeddings", {"input": "x"}, None, 404, "no route"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, None, 404, "'gpt-4' is not served here"),
])
def test_other_bad_requests(server, path, body, raw, status, words):
    got, answer = call(server.port, path, body, raw)
    assert got == status and words in answer["error"]["message"]


def test_n_samples_stream_with_their_index_and_sum_their_usage(server):
    body = {"prompt": "x", "max_tokens": 5, "n": 3, "seed": 1, "ignore_eos": True}
    _, whole = call(server.port, "/v1/completions", body)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and whole["usage"]["completion_tokens"] == 15
    assert whole["usage"]["prompt_tokens"] == len(server.engine.decoder.tokenizer.encode("x"))  # counted once
    _, text = call(server.port, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    streamed = ["", "", ""]
    for chunk in events(text)[:-1]:
        streamed[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert streamed == [c["text"] for c in whole["choices"]] and events(text)[-1]["usage"] == whole["usage"]


def test_logprobs_stream_as_the_tokens_come_and_add_up_to_the_whole_answer(server):
    """Completions with echo: the prompt's text and tokens first (the first token without a
    log-probability), then the completion's, each token with its alternatives; the stream's chunks
    carry the same columns, their text offsets counted on across chunks. A chat's logprobs likewise."""
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True}
    _, whole = call(server.port, "/v1/completions", body)
    choice, prompt = whole["choices"][0], server.engine.decoder.tokenizer.encode("Hello there")
    columns = choice["logprobs"]
    assert choice["text"].startswith("Hello there") and len(columns["tokens"]) == len(prompt) + 6
    assert columns["token_logprobs"][0] is None and columns["top_logprobs"][0] is None
    assert all(len(top) <= 2 and max(top.values()) >= lp for top, lp in
               zip(columns["top_logprobs"][1:], columns["token_logprobs"][1:]))
    assert columns["text_offset"] == [sum(map(len, columns["tokens"][:i])) for i in range(len(columns["tokens"]))]
    _, text = call(server.port, "/v1/completions", {**body, "stream": True})
    streamed = {key: [] for key in columns}
    for chunk in events(text):
        for key, value in (chunk["choices"][0]["logprobs"] or {}).items():
            streamed[key] += value
    assert streamed == columns and "".join(c["choices"][0]["text"] for c in events(text)) == choice["text"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "ignore_eos": True}
    _, whole = call(server.port, "/v1/chat/completions", chat)
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(c["top_logprobs"]) == 3 for c in content)
    assert all(bytes(c["bytes"]).decode() == c["token"] for c in content)
    _, text = call(server.port, "/v1/chat/completions", {**chat, "stream": True})
    streamed = [c for e in events(text) for c in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
    # the prompt is cached by now: its keys were computed in another order, so values agree to rounding
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    assert [c["logprob"] for c in streamed] == pytest.approx([c["logprob"] for c in content], abs=1e-5)


def test_response_ids_are_random_not_counted(server):
    body = {"prompt": "x", "max_tokens": 1}
    ids = {call(server.port, "/v1/completions", body)[1]["id"] for _ in range(2)}
    assert len(ids) == 2 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)  # once cmpl-0, cmpl-1 ...


def test_null_means_the_default(server):
    body = {"prompt": "x", "max_tokens": 2, "stream": None, "ignore_eos": None, "n": None, "stop": None,
            "stop_token_ids": None, "temperature": None}
    assert call(server.port, "/v1/completions", body)[0] == 200
    status, text = call(server.port, "/v1/completions",
                        {**body, "stream": True, "stream_options": {"include_usage": None}})
    assert status == 200 and "usage" not in events(text)[-1]


def test_unsupported_parameters_at_their_off_values_are_accepted(server):
    body = {"prompt": "x", "max_tokens": 2, "repetition_penalty": 1.0, "best_of": 1, "frequency_penalty": 0,
            "response_format": {"type": "text"}, "logprobs": None, "echo": False, "logit_bias": {}, "suffix": ""}
    assert call(server.port, "/v1/completions", body)[0] == 200
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": [], "tool_choice": "none",
            "parallel_tool_calls": True, "store": False, "logprobs": False}  # what agent frameworks send with no tools
    assert call(server.port, "/v1/chat/completions", chat)[0] == 200
    for key, value in [("tool_choice", "auto"), ("store", True), ("suffix", " end"), ("repetition_penalty", True)]:
        status, answer = call(server.port, "/v1/chat/completions", {**chat, key: value})
        assert status == 400 and answer["error"]["param"] == key


def test_a_temperature_below_1e_5_is_greedy(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True}
    _, greedy = call(server.port, "/v1/completions", {**body, "temperature": 0})
    _, tiny = call(server.port, "/v1/completions", {**body, "temperature": 1e-40})  # once: token 0 repeated
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_the_get_endpoints(server):
    assert call(server.port, "/health") == (200, {"status": "ok"})
    assert call(server.port, "/version") == (200, {"version": importlib.metadata.version("dspark")})
    status, models = call(server.port, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
    assert isinstance(models["data"][0]["created"], int)  # typed clients require it
    assert call(server.port, "/v1/completions")[0] == 405
    call(server.port, "/v1/completions", {"prompt": "metrics", "max_tokens": 3, "temperature": 0})
    status, text = call(server.port, "/metrics")
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("dspark:") and "position" not in line and "finished_reason" not in line}
    finished = {line.split('finished_reason="')[1].split('"')[0]: float(line.split()[-1])
                for line in text.splitlines() if line.startswith("dspark:request_success_total{")}
    assert status == 200 and finished["length"] >= 1
    assert values["dspark:spec_decode_num_draft_tokens_total"] == 4 * values["dspark:spec_decode_num_drafts_total"]
    assert values["dspark:generation_tokens_total"] >= 3
    assert values["dspark:time_to_first_token_seconds_count"] >= 1
    assert "process_resident_memory_bytes" in text


def test_methods_a_route_does_not_take_get_a_405_naming_the_allowed_ones(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    for method, path, allowed in [("POST", "/health", {"GET", "HEAD"}), ("PUT", "/v1/models", {"GET", "HEAD"}),
                                  ("DELETE", "/v1/completions", {"POST"}),
                                  ("OPTIONS", "/v1/chat/completions", {"POST"}),
                                  ("GET", "/v1/completions", {"POST"}), ("BREW", "/health", {"GET", "HEAD"})]:
        connection.request(method, path, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 405 and set(response.getheader("Allow").split(", ")) == allowed
        assert path in error["message"]
    connection.request("HEAD", "/health")  # health probes: the GET's headers, no body, the connection kept
    response = connection.getresponse()
    assert response.status == 200 and int(response.getheader("Content-Length")) > 0 and response.read() == b""
    connection.request("GET", "/health")
    assert json.loads(connection.getresponse().read()) == {"status": "ok"}
    connection.close()


# ---------------------------------------------------------------------------- bodies on the wire

POST = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"


def test_a_chunked_body_is_read_as_a_whole_and_the_connection_kept(server):
    """Chunked bodies (as HTTP/1.1 clients send a body of unknown length) give the answer a
    Content-Length body gives, and the next request on the connection is read where it starts;
    chunk extensions and trailers are read and dropped."""
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}).encode()
    _, expected = call(server.port, "/v1/completions", raw=body)
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    for _ in range(2):
        connection.request("POST", "/v1/completions", body=iter([body[:5], body[5:17], body[17:]]),
                           headers={"Transfer-Encoding": "chunked", "Content-Type": "application/json"},
                           encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 200
        assert json.loads(response.read())["choices"] == expected["choices"]
    connection.close()
    framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(part), part) for part in (body[:9], body[9:]))
    trailer = b"0\r\nX-Checksum: 1\r\n\r\n"
    answer = exchange(server.port, POST + b"Transfer-Encoding: chunked\r\n\r\n" + framed + trailer)
    assert answer.startswith(b"HTTP/1.1 200") and expected["choices"][0]["text"].encode() in answer


@pytest.mark.parametrize("headers, framed, status, message", [
    (b"Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n\r\n", 400, b"Invalid HTTP request"),
    (b"Transfer-Encoding: chunked\r\n", b"0x2\r\n{}\r\n0\r\n\r\n", 400, b"Invalid HTTP request"),
    (b"Transfer-Encoding: chunked\r\n", b"14\r\n" + b" " * 20 + b"\r\n0\r\n\r\n", 413, b"larger than 16 bytes"),
    (b"Transfer-Encoding: gzip, chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n", 400, b"Invalid HTTP request"),
    (b"Content-Length: \xb2\r\n", b"", 400, b"Invalid HTTP request"),  # "2", as str.isdigit sees it
    (b"Content-Length: 2\r\nContent-Length: 3\r\n", b"", 400, b"Invalid HTTP request"),
    (b"Content-Length: 17\r\nExpect: 100-continue\r\n", b"", 413, b"larger than 16 bytes"),  # refused, no 100
])
def test_a_body_that_is_malformed_or_too_large_is_refused(server, monkeypatch, headers, framed, status, message):
    """uvicorn refuses malformed framing (its 400, in plain text); the size limit is the server's (in
    JSON), before the body is read when its length is given."""
    monkeypatch.setattr(server_module, "MAX_BODY_BYTES", 16)
    answer = exchange(server.port, POST + headers + b"\r\n" + framed)
    assert answer.startswith(b"HTTP/1.1 %d" % status) and message in answer
    assert answer.count(b"HTTP/1.1") == 1


def test_a_get_with_a_body_is_answered_and_its_body_not_read_as_a_request(server):
    """The body here is a request line: once, it was answered as a second request."""
    answer = exchange(server.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                   b"Content-Length: 18\r\n\r\nGET /x HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1


def test_a_stalled_or_idle_client_is_let_go(server, monkeypatch):
    """A body that stops arriving gets a 408; a connection that sends no whole request head within
    the head deadline is closed, and so is one idle after its answer (each once held a server
    thread for ever)."""
    monkeypatch.setattr(server_module, "BODY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(process_module, "HEADER_TIMEOUT_S", 0.2)
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    stalled.sendall(POST + b"Content-Length: 100\r\n\r\n{\"prompt\"")
    answer = b"".join(iter(lambda: stalled.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.2 s" in answer
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    slow.sendall(b"GET /hea")  # a head that never ends
    assert slow.recv(1) == b""  # closed by the server, not the 10 s timeout here
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    assert idle.recv(1) == b""
    for connection in (stalled, slow, idle):
        connection.close()


def test_slow_connections_do_not_hold_back_a_request(server):
    """Fifty connections sending their heads a byte at a time (each once held a thread): a request
    beside them is answered while they are open."""
    slow = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(50)]
    for connection in slow:
        connection.sendall(b"G")
    assert call(server.port, "/v1/completions", {"prompt": "x", "max_tokens": 4})[0] == 200
    for connection in slow:
        connection.sendall(b"E")
        connection.close()


def test_the_listen_backlog_holds_many_clients_at_once(server):
    """64 clients connecting at once are all answered (the standard library's backlog of 5 dropped
    the rest, which waited a second or were reset)."""
    answers = []
    clients = [threading.Thread(target=lambda: answers.append(call(server.port, "/health")[0])) for _ in range(64)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(60)
    assert answers == [200] * 64


def test_connections_on_descriptors_past_1024_are_served(server):
    """select() refuses a descriptor of 1024 or more; a server with many connections has them (here
    the server's sockets are numbered past the test's 1030 spare descriptors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        assert call(server.port, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    finally:
        for fd in spare:
            os.close(fd)


# ---------------------------------------------------------------------------- safe defaults


def test_the_host_must_name_this_machine_when_bound_to_loopback(server):
    for host in ("localhost", f"localhost:{server.port}", "127.0.0.1", f"[::1]:{server.port}", "[::1]"):
        assert call(server.port, "/health", headers={"Host": host})[0] == 200
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example"):
        status, answer = call(server.port, "/v1/models", headers={"Host": host})
        assert status == 400 and answer["error"]["param"] == "Host" and "DNS rebinding" in answer["error"]["message"]


def test_a_post_body_must_be_json(server):
    """A form (what any web page may post to any address) is refused before it reaches a model."""
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {} if content_type is None else {"Content-Type": content_type}
        status, answer = call(server.port, "/v1/completions", {"prompt": "x"}, headers=headers)
        assert status == 415 and answer["error"]["param"] == "Content-Type"
    headers = {"Content-Type": "application/json; charset=utf-8"}
    assert call(server.port, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers=headers)[0] == 200


def test_no_cors_headers_unless_origins_are_allowed(server, default_tokenizer):
    origin = {"Origin": "http://localhost:3000", "Content-Type": "application/json"}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("GET", "/v1/models", headers=origin)
    response = connection.getresponse()
    response.read()
    assert response.getheader("Access-Control-Allow-Origin") is None
    with serving(tiny_engine(default_tokenizer), default_tokenizer,
                 allowed_origins=["http://localhost:3000"]) as allowing:
        connection = http.client.HTTPConnection("127.0.0.1", allowing.port, timeout=60)
        connection.request("OPTIONS", "/v1/completions", headers={
            **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
        preflight = connection.getresponse()
        preflight.read()
        assert preflight.status == 200
        assert preflight.getheader("Access-Control-Allow-Origin") == "http://localhost:3000"
        connection.request("GET", "/v1/models", headers={"Origin": "http://elsewhere.example"})
        other = connection.getresponse()
        other.read()
        assert other.getheader("Access-Control-Allow-Origin") is None


def test_an_api_key_is_required_on_v1_when_set(default_tokenizer):
    with serving(tiny_engine(default_tokenizer), default_tokenizer, api_key="sk-1", hosts=None) as keyed:
        for headers in ({}, {"Authorization": "Bearer sk-2"}, {"Authorization": "sk-1"}):
            status, answer = call(keyed.port, "/v1/models", headers=headers)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        assert call(keyed.port, "/v1/models", headers={"Authorization": "Bearer sk-1"})[0] == 200
        assert call(keyed.port, "/health", headers={})[0] == 200  # probes need no key
        assert call(keyed.port, "/v1/models", headers={"Host": "anything.example", "Authorization": "Bearer sk-1"})[0] \
            == 200  # hosts=None: not bound to loopback, any Host


def test_without_an_api_key_any_key_is_accepted(server):
    """The official client needs some key: a dummy one works when the server has none."""
    assert call(server.port, "/v1/models", headers={"Authorization": "Bearer EMPTY"})[0] == 200


def test_the_access_log_leaves_out_probes():
    def record(path):
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    quiet = QuietProbes()
    assert not quiet.filter(record("/health")) and not quiet.filter(record("/metrics?x=1"))
    assert quiet.filter(record("/v1/models"))


# ---------------------------------------------------------------------------- clients that leave, failures


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_closes_its_side_is_gone_and_gets_no_answer(server, caplog, stream):
    """Its request is aborted (freeing the slot) and nothing is written to it: not a 200 with a
    finish reason OpenAI does not have; the server logs one line, no traceback."""
    aborted = server.engine.stats.finished.get("abort", 0)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True, "stream": stream}).encode()
    client = socket.create_connection(("127.0.0.1", server.port))
    client.sendall(POST + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    if stream:
        assert client.recv(16).startswith(b"HTTP/1.1 200")  # its stream has begun
    client.shutdown(socket.SHUT_WR)  # as uvicorn, a half-close is a leave
    answer = b"".join(iter(lambda: client.recv(65536), b""))
    client.close()
    deadline = time.monotonic() + 60
    while server.engine.stats.finished.get("abort", 0) == aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.engine.stats.finished.get("abort", 0) == aborted + 1
    assert b"[DONE]" not in answer and b'"finish_reason":"abort"' not in answer
    assert answer == b"" or stream
    left = [r for r in caplog.records if "client left" in r.getMessage()]
    assert len(left) == 1 and left[0].exc_info is None and "\n" not in left[0].getMessage()


def test_a_client_that_leaves_before_its_body_arrives_is_one_log_line(server, caplog):
    exchange(server.port, POST + b"Content-Length: 100\r\n\r\n{\"prompt\"", half_close=True)
    deadline = time.monotonic() + 60
    while not any("before its body arrived" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.exc_info for r in caplog.records if "before its body arrived" in r.getMessage()] == [None]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no "Exception in ASGI application"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's raise
def test_a_stream_whose_generation_fails_ends_with_an_error_event_and_done_and_health_fails(default_tokenizer):
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=64)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.decoder.step = broken
    with serving(engine, default_tokenizer) as running:
        status, text = call(running.port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 8, "stream": True})
        health = call(running.port, "/health")
    assert status == 200 and "device lost" in events(text)[-1]["error"]["message"]
    assert health == (503, {"status": "engine stopped"})  # probes see it; the server answers until told to exit


def test_the_server_raises_what_ended_uvicorns_thread_and_stops_the_engine(default_tokenizer):
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter, tokenizer=default_tokenizer), max_batch=1, max_model_len=64)
    server = process_module.Server(server_module.create_app(engine, "tiny", 64), engine)
    sock = socket.create_server(("127.0.0.1", 0))
    sock.close()  # uvicorn cannot serve a closed socket
    with pytest.raises(OSError, match="Bad file descriptor"):
        server.run(sockets=[sock])
    assert engine.stopped.is_set()


def test_a_request_waiting_when_the_engine_shuts_down_gets_a_503(default_tokenizer):
    target, drafter = tiny_pair(vocab=64, block_size=4)
    engine = Engine(SpeculativeDecoder(target, drafter), max_batch=1, max_model_len=256)
    step = engine.decoder.step

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return step(*args, **kwargs)

    engine.decoder.step = slow
    answer = []
    with serving(engine, default_tokenizer) as running:
        body = {"prompt": [1, 2], "max_tokens": 200, "ignore_eos": True}  # 40+ steps of 20 ms
        client = threading.Thread(target=lambda: answer.extend(call(running.port, "/v1/completions", body)))
        client.start()
        deadline = time.monotonic() + 60
        while not engine.num_running() and time.monotonic() < deadline:  # until it is decoding
            time.sleep(0.005)
        engine.shutdown()
        client.join(60)
    status, body = answer
    assert status == 503 and body["error"]["message"].startswith("the engine was shut down")  # was a 500
