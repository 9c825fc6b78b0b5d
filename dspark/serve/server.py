"""The OpenAI-compatible HTTP server over an Engine (standard library only).

    POST /v1/completions, /v1/chat/completions   (stream: server-sent events ending in [DONE])
    GET  /v1/models, /health, /metrics (Prometheus text), /version   (and HEAD: their headers)

Each HTTP request runs in its own thread and waits on its engine request's events, checking every
CLIENT_POLL_S that its client is still there (a request whose client left is aborted, its slot
freed, and nothing is written); the engine runs in one thread of its own. Errors are JSON objects
in OpenAI's shape: 400 for a request the server cannot serve (the message names the parameter),
404 for a wrong path or a model not served here, 405 (with Allow) for a wrong method, 408 for a body
that does not arrive within CLIENT_TIMEOUT_S (a connection idle that long is closed), 413 for a body
over MAX_BODY_BYTES (refused before it is sent when the client expects a 100 Continue), 501 for a
transfer coding other than chunked or an unknown method, 503 when the engine has stopped, 500 for a
fault of the server's own (the message says which). A body comes with a Content-Length or chunked;
a request whose body is not read (a wrong route, a refused body) closes its connection.
"""
from __future__ import annotations

import json
import queue
import re
import selectors
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dspark import __version__
from dspark.serve import openai
from dspark.serve.engine import Engine, EngineStopped, Request
from dspark.serve.metrics import prometheus_text

COMPLETION_ROUTES = {"/v1/completions": "text", "/v1/chat/completions": "chat"}  # path -> response kind
GET_ROUTES = ("/health", "/v1/models", "/metrics", "/version")
MAX_BODY_BYTES = 1 << 22
MAX_LINE_BYTES = 1 << 12  # a chunk's size line or a trailer line
CLIENT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
CLIENT_TIMEOUT_S = 20.0  # how long a connection may sit idle, or take over a request or a write, before it is closed


def check_body_size(size: int) -> int:
    """`size`, if a body may be that long (else a 413)."""
    if size > MAX_BODY_BYTES:
        raise openai.BadRequest(f"the body is larger than {MAX_BODY_BYTES} bytes",
                                status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    return size


def body_length(values: list[str]) -> int:
    """The body size given by a request's Content-Length header values: one decimal number, no
    larger than MAX_BODY_BYTES (else a 400, or a 413)."""
    if len(values) != 1 or not re.fullmatch(r"[0-9]{1,19}", values[0]):
        raise openai.BadRequest(f"Content-Length must be one decimal number, got {values!r}")
    return check_body_size(int(values[0]))


def client_gone(connection: socket.socket) -> bool:
    """Whether the client has closed `connection`: readable, with nothing to read (a selector, not
    select(), which refuses descriptors from 1024 on)."""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(connection, selectors.EVENT_READ)
            readable = selector.select(timeout=0)
        return bool(readable) and not connection.recv(1, socket.MSG_PEEK)
    except OSError:  # reset, or closed on this side
        return True


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048  # the listen backlog (the standard library's 5 reset clients at 64 at once)

    def __init__(self, address: tuple[str, int], engine: Engine, tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name  # before a bind that
        super().__init__(address, Handler)  # fails (a port in use) calls server_close, which reads the engine
        self.created = int(time.time())  # /v1/models' "created"
        self.engine_thread = threading.Thread(target=engine.run, name="dspark-engine", daemon=True)

    def start_engine(self) -> None:
        self.engine_thread.start()

    def server_close(self) -> None:
        self.engine.shutdown()
        super().server_close()


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT_S  # a stalled or idle client would hold its thread for ever

    # ------------------------------------------------------------------ plumbing

    head_only = False  # answering a HEAD: the headers of a GET's answer, no body

    def _send(self, status: int, body, content_type: str = "application/json", headers: dict | None = None) -> None:
        data = (json.dumps(body) if content_type == "application/json" else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not self.head_only:
            self.wfile.write(data)

    def _error(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
               headers: dict | None = None):
        self._send(status, {"error": {"message": message, "type": kind, "param": param, "code": None}},
                   headers=headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (a malformed request line, a line or headers too long,
        an unknown method) in the JSON shape of every other error; the connection closes."""
        self.close_connection = True
        self._error(code, message or HTTPStatus(code).phrase)

    def handle_expect_100(self) -> bool:
        """A body whose length the server refuses is refused before the client sends it, not after a
        100 Continue."""
        if "Content-Length" in self.headers:
            try:
                body_length(self.headers.get_all("Content-Length"))
            except openai.BadRequest as error:
                self._refuse(error)
                return False
        return super().handle_expect_100()

    def _refuse(self, error: openai.BadRequest) -> None:
        """Answers a request the server will not serve; its body may be unread (no length, or too
        large a one), so the connection closes."""
        self.close_connection = True
        self._send(error.status, error.body())

    def _has_body(self) -> bool:
        return "Transfer-Encoding" in self.headers or self.headers.get("Content-Length", "0") != "0"

    def _read_json(self):
        coding = self.headers.get("Transfer-Encoding")
        if coding is not None:
            if coding.strip().lower() != "chunked":
                raise openai.BadRequest(f"Transfer-Encoding {coding!r} is not supported (only chunked)",
                                        status=HTTPStatus.NOT_IMPLEMENTED)
            raw = self._read_chunked()  # it overrides any Content-Length (RFC 9112 §6.3) ...
            if "Content-Length" in self.headers:  # ... and the connection closes after such a request
                self.close_connection = True
        else:
            lengths = self.headers.get_all("Content-Length")
            if not lengths:
                raise openai.BadRequest("a JSON body with a Content-Length header or chunked encoding is required")
            raw = self.rfile.read(body_length(lengths))
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
            raise openai.BadRequest(f"the body is not valid JSON: {error}") from error

    def _read_chunked(self) -> bytes:
        """A chunked body (RFC 9112 §7.1): hex sizes with optional extensions, each chunk followed by
        CRLF, a zero size, then trailer lines (read and dropped, counted in the body's size) up to an
        empty line."""
        body = bytearray()
        while True:
            line = self.rfile.readline(MAX_LINE_BYTES)
            digits = line.split(b";")[0].strip()
            if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", digits):
                raise openai.BadRequest(f"a malformed chunk size line: {line[:40]!r}")
            size = int(digits, 16)
            if size == 0:
                break
            check_body_size(len(body) + size)
            chunk = self.rfile.read(size)
            if len(chunk) < size or self.rfile.read(2) != b"\r\n":
                raise openai.BadRequest("a chunk is shorter than its size or does not end in CRLF")
            body += chunk
        size = len(body)
        while (line := self.rfile.readline(MAX_LINE_BYTES)).strip():
            size = check_body_size(size + len(line))
        return bytes(body)

    # ------------------------------------------------------------------ routes

    def do_GET(self):
        server, path = self.server, self.path.split("?")[0]
        if path not in GET_ROUTES:
            self._wrong_route(path)
            return
        if self._has_body():  # not read: the connection cannot go on after it
            self.close_connection = True
        if path == "/health":
            alive = server.engine_thread.is_alive()
            self._send(HTTPStatus.OK if alive else HTTPStatus.SERVICE_UNAVAILABLE,
                       {"status": "ok" if alive else "engine stopped"})
        elif path == "/v1/models":
            self._send(HTTPStatus.OK, {"object": "list", "data": [
                {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "dspark",
                 "max_model_len": server.engine.max_model_len}]})
        elif path == "/metrics":
            self._send(HTTPStatus.OK, prometheus_text(server.engine, server.model_name),
                       "text/plain; version=0.0.4")
        elif path == "/version":
            self._send(HTTPStatus.OK, {"version": __version__})

    def do_HEAD(self):
        """A GET's status and headers without its body (health probes send HEAD)."""
        self.head_only = True
        try:
            self.do_GET()
        finally:
            self.head_only = False

    def _wrong_route(self, path: str) -> None:
        """404 for a path not served, 405 (with Allow) for a method the path does not take. A body the
        request has stays unread, so the connection then closes."""
        if self._has_body():
            self.close_connection = True
        allowed = "POST" if path in COMPLETION_ROUTES else "GET, HEAD" if path in GET_ROUTES else None
        if allowed is None:
            self._error(HTTPStatus.NOT_FOUND, f"no route {path}", "not_found_error")
        else:
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {allowed}", headers={"Allow": allowed})

    def _other_method(self):
        self._wrong_route(self.path.split("?")[0])

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other_method

    def do_POST(self):
        server, path = self.server, self.path.split("?")[0]
        if path not in COMPLETION_ROUTES:
            self._wrong_route(path)
            return
        kind = COMPLETION_ROUTES[path]
        try:
            body = self._read_json()
            if kind == "chat":
                prompt, params = openai.parse_chat(body, server.tokenizer, server.engine.max_model_len)
            else:
                prompt, params = openai.parse_completion(body, server.tokenizer)
            openai.check_model(body, server.model_name)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            request = server.engine.submit(prompt, params)
        except openai.BadRequest as error:
            self._refuse(error)
            return
        except ValueError as error:  # the engine's checks: lengths, token ids
            self._error(HTTPStatus.BAD_REQUEST, str(error))
            return
        except EngineStopped as error:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(error), "server_error")
            return
        except TimeoutError:  # the body did not arrive within the timeout
            self.close_connection = True
            self._error(HTTPStatus.REQUEST_TIMEOUT, f"the request body did not arrive within {self.timeout} s")
            return
        except Exception as error:  # noqa: BLE001 - a fault of ours: answered, not a dropped connection
            self.close_connection = True
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(error).__name__}: {error}", "server_error")
            return
        reply = openai.Reply(kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + request.id, server.model_name,
                             include_usage)
        text = openai.TextStream(server.tokenizer, params.stop, request.stop.stop_ids, prompt)
        if body.get("stream"):
            self._stream(reply, request, text, len(prompt))
        else:
            self._complete(reply, request, text, len(prompt))

    def _events(self, request: Request):
        """The request's batches of new tokens until it finishes; while none comes, the request is
        cancelled once its client has gone (closed its side: as uvicorn, a half-close is a leave)."""
        checked = time.monotonic()
        while True:
            if time.monotonic() - checked >= CLIENT_POLL_S:
                checked = time.monotonic()
                request.cancelled = request.cancelled or client_gone(self.connection)
            try:
                event = request.events.get(timeout=CLIENT_POLL_S)
            except queue.Empty:
                continue
            if event is None:
                return
            if isinstance(event, Exception):
                raise event
            yield event

    def _complete(self, reply, request, text, prompt_tokens):
        try:
            for _ in self._events(request):
                pass
        except EngineStopped as error:  # shut down while this request waited: as for a submit then
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(error), "server_error")
            return
        except Exception as error:  # noqa: BLE001 - the engine failed this request
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"generation failed: {error}", "server_error")
            return
        if request.cancelled:  # its client left: nobody to answer
            self.close_connection = True
            return
        try:
            content = text.text(request.result.tokens, finished=True)
            self._send(HTTPStatus.OK, reply.response(content, request.result, prompt_tokens))
        except (BrokenPipeError, ConnectionResetError):  # the client left before its answer
            self.close_connection = True

    def _stream(self, reply, request, text, prompt_tokens):
        def send(payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        self.close_connection = True
        try:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            if reply.kind == "chat":
                send(reply.chunk(None, None, role=True))
            for _ in self._events(request):
                delta = text.delta(request.result.tokens, request.result.finished)
                if delta:
                    send(reply.chunk(delta, None))
            if request.cancelled:  # its client left
                return
            send(reply.chunk(None, request.result.finish_reason))
            if reply.include_usage:
                send(reply.usage_chunk(prompt_tokens, request.result))
            send("[DONE]")
        except OSError:  # the client went away: free its slot
            request.cancelled = True
        except Exception as error:  # noqa: BLE001 - the engine failed this request, or the text did
            request.cancelled = True
            try:
                send({"error": {"message": f"generation failed: {error}", "type": "server_error"}})
                send("[DONE]")  # the stream still ends as streams do (as vLLM's)
            except OSError:
                pass
