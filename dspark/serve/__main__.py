"""python -m dspark.serve: the OpenAI-compatible server, on the embedded default model by default.

    python -m dspark.serve                                  # SmolLM2-135M-Instruct + its DSpark drafter
    python -m dspark.serve --port 8000 --max-batch 16 --speculative-config \\
        '{"method": "dspark", "num_speculative_tokens": 5, "rejection_sample_method": "block"}'
    python -m dspark.serve --model path/to/model.gguf --speculative-config '{"model": "path/to/drafter"}'
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64}'

--speculative-config takes vLLM's keys: method ("dspark"), model (a DeepSpec-format drafter
folder, or "none" to serve without speculation), num_speculative_tokens (alias max_draft_len),
rejection_sample_method ("standard" | "block"), draft_sample_method ("probabilistic" | "greedy";
greedy drafts the argmax chain, still lossless), use_rejection_sampling (false = greedy drafts).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dspark.decoder import VERIFY_METHODS, SpeculativeDecoder
from dspark.generate import DTYPES, load_models
from dspark.serve.engine import Engine
from dspark.serve.server import Server

SPEC_KEYS = {"method", "model", "num_speculative_tokens", "max_draft_len", "rejection_sample_method",
             "draft_sample_method", "use_rejection_sampling"}


def speculative_config(text: str | None) -> dict:
    """The parsed --speculative-config; SystemExit naming the bad key or value."""
    config = json.loads(text) if text else {}
    if not isinstance(config, dict):
        raise SystemExit(f"--speculative-config must be a JSON object, got {text!r}")
    unknown = set(config) - SPEC_KEYS
    if unknown:
        raise SystemExit(f"--speculative-config: unknown keys {sorted(unknown)}; known: {sorted(SPEC_KEYS)}")
    if config.get("method", "dspark") != "dspark":
        raise SystemExit(f"--speculative-config: method must be 'dspark', got {config['method']!r}")
    if config.get("rejection_sample_method", "standard") not in VERIFY_METHODS:
        raise SystemExit(f"--speculative-config: rejection_sample_method must be one of {VERIFY_METHODS}")
    if config.get("draft_sample_method", "probabilistic") not in ("probabilistic", "greedy"):
        raise SystemExit("--speculative-config: draft_sample_method must be 'probabilistic' or 'greedy'")
    return config


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: from the model)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    p.add_argument("--speculative-config", default=None, help="JSON, vLLM's keys (see above)")
    p.add_argument("--max-batch", type=int, default=8, help="batch slots: requests decoded together")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + completion tokens per request")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="auto: bfloat16 on CUDA and on CPUs with bfloat16 kernels, else float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    spec = speculative_config(args.speculative_config)
    args.drafter = spec.get("model")  # None: the default model's drafter; "none": no speculation
    target, drafter, tokenizer = load_models(args)
    decoder = SpeculativeDecoder(
        target, drafter, num_speculative_tokens=spec.get("num_speculative_tokens"),
        max_draft_len=spec.get("max_draft_len"),
        rejection_sample_method=spec.get("rejection_sample_method", "standard"),
        use_rejection_sampling=spec.get("use_rejection_sampling", True)
        and spec.get("draft_sample_method", "probabilistic") == "probabilistic",
        tokenizer=tokenizer)
    name = args.served_model_name or (Path(args.model).stem if args.model else "SmolLM2-135M-Instruct")
    server = Server((args.host, args.port), Engine(decoder, args.max_batch, args.max_model_len), tokenizer, name)
    server.start_engine()
    drafting = f"DSpark drafter, K = {decoder.k}" if decoder.drafter is not None else "no speculation"
    print(f"dspark: serving {name} ({drafting}, {next(target.parameters()).dtype}, {args.device}) on "
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
