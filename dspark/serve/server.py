"""The OpenAI-compatible HTTP server: a FastAPI app over an Engine.

    POST /v1/completions, /v1/chat/completions   (stream: server-sent events ending in [DONE])
    GET  /v1/models, /health, /metrics (Prometheus), /version   (and HEAD: their headers)

The engine's loop and the event loop run on two threads (dspark.serve.process runs both); each
engine request hands its events to the event loop (call_soon_threadsafe into the HTTP request's
asyncio.Queue), so a response waits on its queue, never on a poll. A request whose client leaves is
aborted (its slot freed, nothing written, one log line). Before routing, Guard checks the Host (when
bound to loopback), the API key and the content type. Errors are OpenAI's error objects: 400 for a
request the server cannot serve (the message names the parameter), 401 without the API key, 404 for
a wrong path or a model not served here, 405 (with Allow) for a wrong method, 408 for a body that
does not arrive within BODY_TIMEOUT_S, 413 for a body over MAX_BODY_BYTES, 415 for a POST body that
is not application/json, 503 when the engine has stopped (shut down, or failed), 500 for a fault of
the server's own. A stream that fails after it began ends with an error event, then [DONE].
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.middleware.cors import CORSMiddleware

from dspark import __version__
from dspark.serve import openai
from dspark.engine import Engine, EngineStopped, Request as EngineRequest
from dspark.serve.metrics import metrics_registry

MAX_BODY_BYTES = 1 << 22
BODY_TIMEOUT_S = 20.0  # from a request's head to the end of its body
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
CLIENT_CLOSED = 499  # nginx's "client closed request": the status of an answer to a client that has left
log = logging.getLogger("dspark.serve")


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(openai.error_body(message, kind, param, code), status_code=status, headers=headers)


class Guard:
    """ASGI middleware: what a request must pass before it is routed. `hosts` (a server bound to
    loopback): the Host header must name one of them, with or without a port, so that no web page
    reaches the server through a name of its own that resolves to 127.0.0.1 (DNS rebinding). A body
    may hold MAX_BODY_BYTES (413, before it is read when its length is given) and must arrive within
    BODY_TIMEOUT_S (408). On /v1/: the API key as a bearer token if one is set (401), and a POST
    body of Content-Type application/json (415: a page may post a form anywhere, but not JSON
    without the server's consent). CORS preflights (OPTIONS) pass to the CORS middleware inside
    this one when --allowed-origins is given."""

    def __init__(self, app, hosts: tuple[str, ...] | None, api_key: str | None):
        self.app, self.hosts = app, hosts
        self.bearer = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
        await self.app(scope, self.receive_body(receive), send)

    def refusal(self, scope) -> Response | None:
        headers = Headers(scope=scope)
        if self.hosts is not None:
            host = re.sub(r":[0-9]+$", "", headers.get("host", ""))
            if host.lower() not in self.hosts:
                return error_response(400, f"Host {headers.get('host')!r} is not served: a server bound to "
                                      f"loopback answers {', '.join(self.hosts)} only (DNS rebinding)", param="Host")
        if int(headers.get("content-length", 0)) > MAX_BODY_BYTES:  # h11 has checked that it is a number
            return error_response(413, f"the body is larger than {MAX_BODY_BYTES} bytes",
                                  headers={"Connection": "close"})
        if scope["method"] == "OPTIONS" or not scope["path"].startswith("/v1/"):
            return None
        if self.bearer is not None and not secrets.compare_digest(
                headers.get("authorization", "").encode("latin-1"), self.bearer):
            return error_response(401, "a valid API key is required: Authorization: Bearer <key>",
                                  code="invalid_api_key")
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if scope["method"] == "POST" and media != "application/json":
            return error_response(415, f"the body must be application/json, got Content-Type {media or 'none'}",
                                  param="Content-Type")
        return None

    @staticmethod
    def receive_body(receive):
        """`receive`, whose body messages must arrive within BODY_TIMEOUT_S and hold MAX_BODY_BYTES."""
        deadline = asyncio.get_running_loop().time() + BODY_TIMEOUT_S
        size, body_read = 0, False

        async def receive_checked():
            nonlocal size, body_read
            if body_read:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
            size += len(message.get("body", b""))
            if size > MAX_BODY_BYTES:
                raise HTTPException(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
            body_read = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return receive_checked


class Sink:
    """Hands sample `index`'s engine events to `queue` on `loop` (put() runs on the engine's thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
        self.loop, self.queue, self.index = loop, queue, index

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))
        except RuntimeError:  # the loop has closed: nobody waits for this request any more
            pass


async def client_left(request: Request) -> None:
    """Returns once the client has gone (its body read, uvicorn's next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def failure(error: Exception) -> tuple[int, dict]:
    """The status and error object of a request the engine ended with `error`."""
    if isinstance(error, EngineStopped):
        return 503, openai.error_body(f"{error}: the server is shutting down or has failed", "server_error", code=503)
    return 500, openai.error_body(f"generation failed: {type(error).__name__}: {error}", "server_error", code=500)


class Generation:
    """One HTTP request's engine requests (n samples of one prompt), their texts as they grow and, when
    asked for, their tokens' log-probabilities (`logprobs`); `echo`: the text before each sample's
    (completions' echo), whose tokens (`prompt`) get their log-probabilities too."""

    def __init__(self, reply: openai.Reply, requests: list[EngineRequest], texts: list[openai.TextStream],
                 events: asyncio.Queue, logprobs: openai.Logprobs | None = None, echo: str = "",
                 prompt: list[int] = ()):
        self.reply, self.requests, self.texts, self.events = reply, requests, texts, events
        self.logprobs, self.echo, self.prompt = logprobs, echo, prompt
        self.tokens = [[] for _ in requests]
        self.reported = [0] * len(requests)  # tokens whose log-probabilities the stream has sent
        self.offsets = [len(echo)] * len(requests)  # completions' text_offset of the next token

    async def next(self) -> tuple[int, str, bool]:
        """(sample, its new text, whether it has finished) at its next event; raises the engine's error."""
        index, event = await self.events.get()
        if isinstance(event, Exception):
            raise event
        if event is not None:
            self.tokens[index] += event
        text = self.requests[index].result.text
        return index, self.texts[index].delta(text, finished=event is None), event is None

    def echoed(self, result) -> tuple[list[int], list]:
        """The prompt's tokens and log-probabilities, when echo gives them."""
        if self.echo and result.prompt_logprobs is not None:
            return list(self.prompt), result.prompt_logprobs
        return [], []

    def all_logprobs(self, index: int) -> dict | None:
        """Sample `index`'s log-probabilities, echoed prompt first, for a whole answer."""
        if self.logprobs is None:
            return None
        result = self.requests[index].result
        tokens, entries = self.echoed(result)
        return self.logprobs.of(tokens + self.tokens[index], entries + result.logprobs[:len(self.tokens[index])])

    def new_logprobs(self, index: int) -> dict | None:
        """The log-probabilities of sample `index`'s tokens the stream has not sent yet."""
        if self.logprobs is None:
            return None
        sent, held = self.reported[index], len(self.tokens[index])
        result = self.requests[index].result
        part = self.logprobs.of(self.tokens[index][sent:held], result.logprobs[sent:held], self.offsets[index])
        self.reported[index] = held
        if "text_offset" in part:
            self.offsets[index] += sum(map(len, part["tokens"]))
        return part

    def abort(self, why: str | None) -> None:
        """Frees the slots of the samples still running; `why`: logged, in one line."""
        running = [r for r in self.requests if not r.result.finished]
        for request in running:
            request.cancelled = True
        if why and running:
            log.info("%s %s after %d tokens: aborted", self.reply.id, why, sum(map(len, self.tokens)))

    async def whole(self, http: Request) -> Response:
        left, finished = asyncio.ensure_future(client_left(http)), 0
        try:
            while finished < len(self.requests):
                event = asyncio.ensure_future(self.next())
                await asyncio.wait({left, event}, return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    event.cancel()
                    self.abort("client left")
                    return Response(status_code=CLIENT_CLOSED)
                finished += event.result()[2]
        except Exception as error:  # noqa: BLE001 - the engine ended it: shut down or failed
            self.abort(None)
            status, body = failure(error)
            return JSONResponse(body, status_code=status)
        finally:
            left.cancel()
        answer = self.reply.response([self.echo + r.result.text for r in self.requests], [r.result for r in self.requests],
                                     [self.all_logprobs(i) for i in range(len(self.requests))])
        return Response(answer.model_dump_json(), media_type="application/json")

    async def stream(self):
        """The server-sent events: for a chat, an opening chunk per sample; for an echo, the prompt's
        text per sample (at the sample's first event); each sample's text as it grows (with its new tokens' log-probabilities when
        asked for) and its finish reason; the usage chunk if asked for; [DONE]. An engine error ends
        the stream with an error event, then [DONE]."""
        reply, done = self.reply, False
        try:
            if reply.kind == "chat":
                for index in range(len(self.requests)):
                    yield format_sse_event(data_str=reply.chunk(index, None, role=True))
            finished, echoed = 0, [not self.echo] * len(self.requests)
            while finished < len(self.requests):
                index, delta, end = await self.next()
                if not echoed[index]:  # at its first event: its prompt's log-probabilities are in by then
                    tokens, entries = self.echoed(self.requests[index].result)
                    prompt = None if self.logprobs is None else self.logprobs.of(tokens, entries)
                    yield format_sse_event(data_str=reply.chunk(index, self.echo, logprobs=prompt))
                    echoed[index] = True
                logprobs = self.new_logprobs(index) if len(self.tokens[index]) > self.reported[index] else None
                if delta or logprobs:
                    yield format_sse_event(data_str=reply.chunk(index, delta, logprobs=logprobs))
                if end:
                    finished += 1
                    yield format_sse_event(data_str=reply.chunk(index, None, self.requests[index].result.finish_reason))
            if reply.include_usage:
                yield format_sse_event(data_str=reply.usage_chunk([r.result for r in self.requests]))
            done = True
        except Exception as error:  # noqa: BLE001 - the engine ended it: shut down or failed
            done = True
            yield format_sse_event(data_str=json.dumps(failure(error)[1]))
        finally:
            self.abort(None if done else "client left")
        yield format_sse_event(data_str="[DONE]")


def create_app(engine: Engine, model_name: str, max_model_len: int, api_key: str | None = None,
               allowed_origins: list[str] | None = None, hosts: tuple[str, ...] | None = LOOPBACK_NAMES) -> FastAPI:
    """The app over `engine`, whose loop the caller runs (dspark.serve.process.Server). It encodes
    prompts with the engine's decoder's tokenizer, with which the engine builds the answers' text.
    `hosts`: the Host names served (None: any, for a server not bound to loopback)."""
    tokenizer = engine.decoder.tokenizer
    if tokenizer is None:
        raise ValueError("the server needs the decoder's tokenizer: SpeculativeDecoder(..., tokenizer=...)")
    app = FastAPI(title="dspark", version=__version__, docs_url=None, redoc_url=None)
    registry, created = metrics_registry(engine, model_name), int(time.time())
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Guard, hosts=hosts, api_key=api_key)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        message = {404: f"no route {request.url.path}",
                   405: f"{request.url.path} takes {(error.headers or {}).get('Allow')}"}.get(error.status_code,
                                                                                          error.detail)
        return error_response(error.status_code, message, headers=error.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, error: ClientDisconnect) -> Response:
        log.info("%s %s: the client left before its body arrived", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(openai.BadRequest)
    async def bad_request(request: Request, error: openai.BadRequest) -> Response:
        return JSONResponse(error.body(), status_code=error.status)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not engine.stopped.is_set():
            return {"status": "ok"}
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "dspark", "max_model_len": max_model_len}]}

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version():
        return {"version": __version__}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def generate(http: Request, shape: type[openai.SamplingRequest], kind: str) -> Response:
        body = await read_body(http, shape)
        openai.check_model(body.model, model_name)
        prompt = await asyncio.to_thread(body.prompt_ids, tokenizer)
        params = body.sampling_params(openai.DEFAULT_COMPLETION_TOKENS if kind == "text"
                                      else max(1, max_model_len - len(prompt)))
        loop, events, requests = asyncio.get_running_loop(), asyncio.Queue(), []
        try:
            for index, sample in enumerate(openai.sample_params(params, body.n or 1)):
                requests.append(engine.submit(prompt, sample, events=Sink(loop, events, index)))
        except (ValueError, EngineStopped) as error:  # the engine's checks: lengths, token ids; or stopped
            for request in requests:
                request.cancelled = True
            if isinstance(error, EngineStopped):
                return JSONResponse(failure(error)[1], status_code=503)
            raise openai.BadRequest(str(error)) from error
        reply = openai.Reply(kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + requests[0].id, model_name,
                             len(prompt), body.include_usage)
        texts = [openai.TextStream(params.stop) for _ in requests]
        logprobs = None if params.logprobs is None else openai.Logprobs(tokenizer, kind)
        generation = Generation(reply, requests, texts, events, logprobs, body.echo_text(tokenizer, prompt), prompt)
        if body.stream:
            return EventSourceResponse(generation.stream(), headers={"Cache-Control": "no-cache"})
        return await generation.whole(http)

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await generate(http, openai.CompletionRequest, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        return await generate(http, openai.ChatCompletionRequest, "chat")

    return app


async def read_body(http: Request, shape: type[openai.SamplingRequest]) -> openai.SamplingRequest:
    try:
        body = json.loads(await http.body())
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise openai.BadRequest(f"the body is not valid JSON: {error}") from None
    return validated(body, shape)


def validated(body, shape: type[openai.SamplingRequest]) -> openai.SamplingRequest:
    """The parsed JSON `body` as `shape`; BadRequest naming the first field that is wrong (of its errors,
    the first that is not a type mismatch, if any: a union's other members mismatch)."""
    if not isinstance(body, dict):
        raise openai.BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    try:
        return shape.model_validate(body)
    except ValidationError as error:
        errors = [e for e in error.errors() if e["loc"][0] == error.errors()[0]["loc"][0]]
        first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])  # not a union's other member
        path, param = body_path(body, first["loc"]), str(first["loc"][0])
        if first["type"] == "extra_forbidden":
            raise openai.BadRequest(f"unknown parameter {path!r}", param) from None
        got = "" if first["type"] == "missing" else f", got {first['input']!r:.80}"
        raise openai.BadRequest(f"{path}: {first['msg']}{got}", param) from None


def body_path(body: dict, loc: tuple) -> str:
    """Where an error of pydantic's is in the body, as messages[0].content (loc less its union-member tags)."""
    path, value = str(loc[0]), body.get(loc[0])
    for item in loc[1:]:
        if isinstance(value, dict) and item in value:
            path, value = f"{path}.{item}", value[item]
        elif isinstance(value, list) and isinstance(item, int) and item < len(value):
            path, value = f"{path}[{item}]", value[item]
    return path
