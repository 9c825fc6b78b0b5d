"""python -m dspark.serve: the OpenAI-compatible server, on the embedded default model by default.

    python -m dspark.serve                                  # SmolLM2-135M-Instruct + its DSpark drafter
    python -m dspark.serve --port 8000 --max-batch 16 --speculative-config \\
        '{"method": "dspark", "num_speculative_tokens": 5, "rejection_sample_method": "block"}'
    python -m dspark.serve --model path/to/model.gguf --speculative-config '{"model": "path/to/drafter"}'
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64}'

--speculative-config takes vLLM's keys (dspark/compile/options.py). On CUDA the decode step is replayed from
CUDA graphs (one per batch-size bucket and sampling variant, captured at first use); --enforce-eager
turns them off. --compile runs the step through torch.compile; `python -m dspark.compile.warmup`
with the same options compiles it ahead of time into a --compile-cache.
"""
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from dspark.compile.cache import load_compile_cache
from dspark.compile.options import add_model_args, build_decoder, compiled_step_options
from dspark.serve.engine import Engine
from dspark.serve.metrics import IterationLog
from dspark.serve.server import Server


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    add_model_args(p)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile (vLLM's flag)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--compile-cache", type=Path, default=None,
                   help="compiled code from python -m dspark.compile.warmup (implies --compile)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                   help="seconds between the iteration log's lines (rates, running and waiting requests, "
                        "acceptance), written while the engine works")
    p.add_argument("--disable-log-stats", action="store_true", help="no iteration log (vLLM's flag)")
    args = p.parse_args(argv)
    if args.enforce_eager and (args.compile or args.compile_cache):
        p.error("--enforce-eager excludes --compile and --compile-cache")
    if not args.log_stats_interval > 0:
        p.error(f"--log-stats-interval must be > 0, got {args.log_stats_interval}")
    return args


def served_name(model: str | None) -> str:
    """The name clients pass as `model`: the model's folder or file name, less a .gguf suffix (not
    Path.stem's last dot: Qwen2.5-0.5B-Instruct is served as that)."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    name = Path(model).resolve().name
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


def main(argv=None) -> None:
    args = parse_args(argv)
    compile = args.compile or args.compile_cache is not None
    try:
        decoder, tokenizer = build_decoder(args, compile)
    except (OSError, ValueError) as error:
        raise SystemExit(f"python -m dspark.serve: {error}") from None
    if args.compile_cache is not None:
        try:
            load_compile_cache(args.compile_cache, decoder.device, compiled_step_options(args, decoder))
        except (OSError, ValueError) as error:
            raise SystemExit(f"--compile-cache: {error}") from None
    target = decoder.target
    name = args.served_model_name or served_name(args.model)
    cuda_graphs = decoder.device.type == "cuda" and not args.enforce_eager
    engine = Engine(decoder, args.max_batch, args.max_model_len, cuda_graphs=cuda_graphs)
    try:
        server = Server((args.host, args.port), engine, tokenizer, name)
    except OSError as error:  # e.g. the port in use
        raise SystemExit(f"python -m dspark.serve: cannot serve on {args.host}:{args.port}: {error}") from None
    server.start_engine()
    if not args.disable_log_stats:
        threading.Thread(target=IterationLog(engine, args.log_stats_interval).run, name="dspark-stats",
                         daemon=True).start()
    drafting = f"DSpark drafter, K = {decoder.k}" if decoder.drafter is not None else "no speculation"
    mode = ", ".join(["compiled" if compile else "eager"] + ["CUDA graphs"] * cuda_graphs)
    print(f"dspark: serving {name} ({drafting}, {next(target.parameters()).dtype}, {args.device}, {mode}) on "
          f"http://{args.host}:{server.server_address[1]}  (POST /v1/chat/completions, /v1/completions)",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
