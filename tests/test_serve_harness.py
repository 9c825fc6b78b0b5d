"""What the server's tests share (no tests here): a server in this process on a tiny model (the real
app on the real uvicorn, in a thread, where a test may reach into the engine), a server process
(`python -m dspark.serve` on a free port, the default model unless told), and HTTP helpers."""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from dspark import SpeculativeDecoder
from dspark.engine import Engine
from dspark.serve.process import Server
from dspark.serve.server import create_app
from test_decoder import tiny_pair

HEADERS = {"Content-Type": "application/json"}


class Serving:
    """A server's address (`port`), and its engine where it runs in this process."""

    def __init__(self, port: int, engine: Engine | None = None, server: Server | None = None):
        self.port, self.engine, self.server = port, engine, server
        self.url = f"http://127.0.0.1:{port}"


def tiny_engine(tokenizer, max_batch: int = 4, max_model_len: int = 256) -> Engine:
    target, drafter = tiny_pair(vocab=tokenizer.vocab_size, logit_std=1.0, block_size=4)
    return Engine(SpeculativeDecoder(target, drafter, num_speculative_tokens=4, tokenizer=tokenizer),
                  max_batch=max_batch, max_model_len=max_model_len)


@contextlib.contextmanager
def serving(engine: Engine, tokenizer, shutdown_timeout: float = 10.0, **app_options):
    """The app over `engine` ("tiny", loopback only unless told) on uvicorn in a thread, on a free port;
    `tokenizer` becomes the engine's decoder's (the tests' tiny pairs are built without one)."""
    engine.decoder.tokenizer = tokenizer
    app = create_app(engine, "tiny", engine.max_model_len, **app_options)
    server = Server(app, engine, shutdown_timeout)
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the server did not start"
    try:
        yield Serving(sock.getsockname()[1], engine, server)
    finally:
        server.should_exit = True
        thread.join(60)


class ServerProcess:
    """`python -m dspark.serve --port 0 *options` until stop(); the default model unless --model."""

    def __init__(self, *options: str, env: dict | None = None):
        self.process = subprocess.Popen([sys.executable, "-m", "dspark.serve", "--port", "0", *options],
                                        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        for line in self.process.stderr:
            self.lines.append(line)
            found = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                break
        else:
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        self.url = f"http://127.0.0.1:{self.port}"
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True)
        self.reader.start()

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        code = self.process.wait(timeout)
        self.reader.join(timeout)
        return code


def call(port: int, path: str, body=None, raw: bytes | None = None, headers: dict | None = None,
         method: str | None = None):
    """(status, parsed JSON or text) of a GET (no body) or POST to the server on `port`."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers=HEADERS if headers is None else headers)
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
    """The JSON events of a stream, which must end with [DONE]."""
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def exchange(port: int, request: bytes, half_close: bool = False) -> bytes:
    """Everything the server sends back for the raw `request` until it closes the connection
    (half_close: this side closes after the request, so a body cut short ends there)."""
    client = socket.create_connection(("127.0.0.1", port), timeout=60)
    client.sendall(request)
    if half_close:
        client.shutdown(socket.SHUT_WR)
    answer = b"".join(iter(lambda: client.recv(65536), b""))
    client.close()
    return answer
