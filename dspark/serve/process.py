"""The serving process: the engine's loop, uvicorn serving the app in a thread beside it, and the
shutdown.

The engine's loop runs on the thread that calls Server.run, the one that loaded the models; uvicorn
gets a thread of its own. On the CPU, torch's parallel ops run on an OpenMP team that belongs to the
thread calling them; a second thread computing after the first has one has a team of its own, and
libgomp, finding more of its threads than cores, stops spinning between parallel regions, so each
small GEMM waits for its workers to wake: the same engine stepped 29% slower per step in a thread of
its own than on the loading thread (default pair, one request, two cores). The HTTP thread runs no
parallel op.

On SIGINT or SIGTERM the server stops accepting connections and closes the idle ones, lets the
requests in flight run for up to `shutdown_timeout` seconds, then shuts the engine down: the
requests still running (or waiting) end with an error, a stream's as an error event and [DONE], a
whole answer's as a 503, and their slots are freed. Both threads have ended before run() returns,
and a drained shutdown exits 0 (uvicorn's own raises the signal again after its shutdown, which
would end the process by it). A second SIGINT ends the drain at once.

Connections: uvicorn (h11) with at most `limit_concurrency` connections and requests at once
(503 past it), idle keep-alive connections closed after `timeout_keep_alive` seconds, request heads
over 64 KiB refused, and a request head that has not arrived within HEADER_TIMEOUT_S of the
connection's opening (or of its last answer) closes the connection, which uvicorn alone leaves open
for ever. Bodies: dspark.serve.server (size, time).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import socket
import threading

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from dspark.engine import Engine

HEADER_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 1 << 16
WRITE_GRACE_S = 5.0  # after the engine's shutdown, for the last events to be written before uvicorn cancels
QUIET_PATHS = ("/health", "/metrics")  # probes and scrapers: left out of the access log


class Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request heads."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.head_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a head has arrived
            self.head_deadline.cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.head_deadline.cancel()
        self.head_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)

    def connection_lost(self, exc) -> None:
        self.head_deadline.cancel()
        super().connection_lost(exc)

    def _head_late(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self.timeout_keep_alive_handler()  # closes the connection


class QuietProbes(logging.Filter):
    """Leaves /health and /metrics out of uvicorn's access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.args, tuple) and len(record.args) > 2
                    and str(record.args[2]).split("?")[0] in QUIET_PATHS)


def log_config() -> dict:
    """uvicorn's logging, with the access log's filter and dspark's logger beside uvicorn's."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["filters"] = {"quiet_probes": {"()": QuietProbes}}
    config["handlers"]["access"]["filters"] = ["quiet_probes"]
    config["loggers"]["dspark"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


class Server(uvicorn.Server):
    """Serves `app` (dspark.serve.server.create_app's, over `engine`) on a listening socket."""

    def __init__(self, app: FastAPI, engine: Engine, shutdown_timeout: float = 10.0, limit_concurrency: int = 1024,
                 timeout_keep_alive: float = 5.0, access_log: bool = True):
        super().__init__(uvicorn.Config(
            app, http=Protocol, lifespan="off", log_config=log_config(), access_log=access_log,
            limit_concurrency=limit_concurrency,
            timeout_keep_alive=timeout_keep_alive, h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            timeout_graceful_shutdown=shutdown_timeout + WRITE_GRACE_S))
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.http_error: BaseException | None = None  # what ended uvicorn's thread, if anything did

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serves until SIGINT or SIGTERM (or should_exit): the engine's loop on this thread, uvicorn in
        a thread of its own. If the engine fails, the server answers 503 until it is told to exit,
        then raises the engine's error; if uvicorn's thread ends on an error, run() raises it."""
        http = threading.Thread(target=self._serve_http, args=(sockets,), name="dspark-http")
        with self.capture_signals():
            http.start()
            try:
                self.engine.run()
            finally:
                http.join()
        if self.http_error is not None:
            raise self.http_error

    def _serve_http(self, sockets: list[socket.socket] | None) -> None:
        try:
            super().run(sockets)
        except BaseException as error:  # a thread's SystemExit would vanish: run() raises it
            self.http_error = error
        finally:
            self.engine.shutdown()

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT and SIGTERM start the shutdown and are not raised again after it."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        running = self.engine.num_running() + self.engine.num_waiting()
        logging.getLogger("dspark.serve").info("shutting down: %d requests have %g s to finish", running,
                                               self.shutdown_timeout)
        stop = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.engine.shutdown)
        try:
            await super().shutdown(sockets)
        finally:
            stop.cancel()
