"""python -m dspark.serve: the OpenAI-compatible server, on the embedded default model by default.

    python -m dspark.serve                                  # SmolLM2-135M-Instruct + its DSpark drafter
    python -m dspark.serve --port 8000 --max-num-seqs 16 --speculative-config \\
        '{"method": "dspark", "num_speculative_tokens": 5, "rejection_sample_method": "block"}'
    python -m dspark.serve --model path/to/model.gguf --speculative-config '{"model": "path/to/drafter"}'
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64}'

--speculative-config takes vLLM's keys (dspark/compile/options.py). On CUDA the decode step runs
through torch.compile and is replayed from CUDA graphs (one per batch-size bucket, sampling variant
and number of drafts verified, captured at first use); --enforce-eager turns both off, --no-compile
the first. `python -m dspark.compile.warmup` with the same options compiles the step ahead of time
into a --compile-cache, so that the server's first requests do not wait for the compiler.
The options are checked, and the port bound, before the model loads. docs/serving.md is the
server's reference.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import resource
import socket
import sys
import threading
from pathlib import Path

import torch

from dspark.compile.cache import load_compile_cache
from dspark.compile.options import (add_model_args, build_decoder, check_engine_args, compiled_step_options,
                                    engine_options, k_choices, speculative_config)
from dspark.engine import Engine
from dspark.serve.metrics import IterationLog
from dspark.serve.process import Server
from dspark.serve.server import LOOPBACK_NAMES, create_app

PROG = "python -m dspark.serve"


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError
    return value


port.__name__ = "port (0-65535)"  # argparse's "invalid port (0-65535) value: '70000'"


def origins(text: str) -> list[str]:
    """A JSON list of origins (vLLM's form) or one origin."""
    value = json.loads(text) if text.startswith("[") else [text]
    if not all(isinstance(o, str) for o in value):
        raise ValueError
    return value


origins.__name__ = "origins (a JSON list of strings, or one origin)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=8000, help="0: a free port, printed at start")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model's folder or file name, less .gguf)")
    p.add_argument("--api-key", default=None,
                   help="the key /v1/ requests must send as a bearer token (default: $DSPARK_API_KEY, else none)")
    p.add_argument("--allowed-origins", type=origins, default=None,
                   help="origins whose web pages may call the server (CORS), e.g. '[\"http://localhost:3000\"]' "
                        "(default: none, and no CORS headers)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGINT or SIGTERM, seconds the requests in flight have to finish before they are "
                        "ended with an error")
    p.add_argument("--limit-concurrency", type=int, default=1024,
                   help="connections and requests at once (uvicorn's flag; 503 past it)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection is kept (uvicorn's flag)")
    add_model_args(p)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile (vLLM's flag)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decode step (default: on CUDA, unless --enforce-eager)")
    p.add_argument("--compile-cache", type=Path, default=None,
                   help="compiled code from python -m dspark.compile.warmup (implies --compile)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                   help="seconds between the iteration log's lines (rates, running and waiting requests, "
                        "acceptance), written while the engine works")
    p.add_argument("--disable-log-stats", action="store_true", help="no iteration log (vLLM's flag)")
    p.add_argument("--disable-access-log", action="store_true", help="no line per request (uvicorn's flag)")
    args = p.parse_args(argv)
    try:
        check_engine_args(args)
    except ValueError as error:
        p.error(str(error))
    for name, value, low in [("--limit-concurrency", args.limit_concurrency, 1),
                             ("--shutdown-timeout", args.shutdown_timeout, 0),
                             ("--timeout-keep-alive", args.timeout_keep_alive, 0)]:
        if value is not None and not value >= low:
            p.error(f"{name} must be >= {low}, got {value}")
    if args.enforce_eager and (args.compile or args.compile_cache):
        p.error("--enforce-eager excludes --compile and --compile-cache")
    if args.compile is False and args.compile_cache is not None:
        p.error("--no-compile excludes --compile-cache")
    if not args.log_stats_interval > 0:
        p.error(f"--log-stats-interval must be > 0, got {args.log_stats_interval}")
    speculative_config(args.speculative_config)  # exits naming a bad key or value
    args.api_key = args.api_key or os.environ.get("DSPARK_API_KEY") or None
    return args


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each option's default where its help does not tell it."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def served_name(model: str | None) -> str:
    """The name clients pass as `model`: the model's folder or file name, less a .gguf suffix (not
    Path.stem's last dot: Qwen2.5-0.5B-Instruct is served as that)."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    name = Path(model).resolve().name
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        return False


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (a port in use is told at once; clients that
    connect meanwhile wait in the backlog)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as error:  # in use, not this machine's address, or a port below 1024
        raise SystemExit(f"{PROG}: cannot serve on {host}:{port}: {error.strerror or error}") from None


def raise_open_files_limit() -> None:
    """Every connection holds a file descriptor: the soft limit is raised to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def compiles(args: argparse.Namespace) -> bool:
    """Whether the server compiles its step: as --compile says, with a --compile-cache, else on CUDA
    unless --enforce-eager (python -m bench.step_modes: the compiled step is the fastest at one row;
    docs/performance.md has where it is not)."""
    if args.compile is not None or args.compile_cache is not None:
        return args.compile is not False
    return torch.device(args.device).type == "cuda" and not args.enforce_eager


def main(argv=None) -> None:
    args = parse_args(argv)
    sock = listen(args.host, args.port)
    raise_open_files_limit()
    compile = compiles(args)
    print(f"dspark: loading {args.model or 'the default model pair'} ...", file=sys.stderr, flush=True)
    try:
        decoder, _ = build_decoder(args, compile)
        if args.compile_cache is not None:
            try:
                load_compile_cache(args.compile_cache, decoder.device, compiled_step_options(args, decoder))
            except (OSError, ValueError) as error:
                raise SystemExit(f"--compile-cache: {error}") from None
    except (OSError, ValueError) as error:
        raise SystemExit(f"{PROG}: {error}") from None
    except KeyboardInterrupt:
        raise SystemExit(f"{PROG}: interrupted while loading") from None
    name = args.served_model_name or served_name(args.model)
    cuda_graphs = decoder.device.type == "cuda" and not args.enforce_eager
    try:
        engine = Engine(decoder, **engine_options(args), cuda_graphs=cuda_graphs, k_choices=k_choices(args, decoder))
    except ValueError as error:  # a KV cache too small for --max-model-len
        raise SystemExit(f"{PROG}: {error}") from None
    loopback = is_loopback(args.host)
    app = create_app(engine, name, args.max_model_len, api_key=args.api_key,
                     allowed_origins=args.allowed_origins,
                     hosts=tuple(dict.fromkeys([*LOOPBACK_NAMES, args.host])) if loopback else None)
    server = Server(app, engine, args.shutdown_timeout, args.limit_concurrency, args.timeout_keep_alive,
                    access_log=not args.disable_access_log)
    stop_log = threading.Event()
    if not args.disable_log_stats:
        threading.Thread(target=IterationLog(engine, args.log_stats_interval).run, args=(stop_log,),
                         name="dspark-stats", daemon=True).start()
    choices = engine.speculation.choices
    drafting = "no speculation" if decoder.drafter is None else f"DSpark drafter, K = {decoder.k}" + (
        "" if len(choices) == 1 else f" at most, chosen per step among {choices}")
    mode = ", ".join(["compiled" if compile else "eager"] + ["CUDA graphs"] * cuda_graphs)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"dspark: KV cache of {engine.capacity} tokens ({engine.pool.num_blocks - 1} blocks of {args.block_size}): "
          f"{engine.full_length_requests} requests of --max-model-len {args.max_model_len} at once",
          file=sys.stderr, flush=True)
    print(f"dspark: serving {name} ({drafting}, {next(decoder.target.parameters()).dtype}, {args.device}, {mode}) "
          f"on http://{host}:{sock.getsockname()[1]}  (POST /v1/chat/completions, /v1/completions)"
          + ("" if loopback or args.api_key else "; reachable from other machines without --api-key"),
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        stop_log.set()


if __name__ == "__main__":
    main()
