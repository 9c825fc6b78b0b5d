"""What a serving process is built from, shared by `python -m dspark.serve` and
`python -m dspark.compile.warmup` (a warm-up must compile the very step the server runs): the
command-line options that choose the model pair, the batch and the speculation, and the decoder
they make.

--speculative-config takes vLLM's keys: method ("dspark"), model (a DeepSpec-format drafter
folder, or "none" to serve without speculation), num_speculative_tokens (0: no speculation),
rejection_sample_method ("standard" | "block"), draft_sample_method ("probabilistic" | "greedy";
greedy drafts the argmax chain, still lossless), and TensorRT-LLM's: decoding_type ("DSpark", for
method), speculative_model or speculative_model_dir (for model), max_draft_len (for
num_speculative_tokens), use_rejection_sampling (false = greedy drafts). So a TensorRT-LLM DSpark
config, `{"decoding_type": "DSpark", "max_draft_len": 7, "speculative_model": ...,
"use_rejection_sampling": true, "rejection_sample_method": "block"}`, serves as it reads.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark.compile.runner import default_k_choices
from dspark.decoder import VERIFY_METHODS, SpeculativeDecoder
from dspark.loading import add_model_args as add_model_source_args
from dspark.loading import load_models
from dspark.kv_cache import DEFAULT_KV_CACHE_GIB, KV_BLOCK_SIZE

SPEC_KEYS = {"method", "model", "num_speculative_tokens", "rejection_sample_method", "draft_sample_method",
             "use_rejection_sampling"}
TRTLLM_NAMES = {"decoding_type": "method", "speculative_model": "model", "speculative_model_dir": "model",
                "max_draft_len": "num_speculative_tokens"}


def speculative_config(text: str | None) -> dict:
    """The parsed --speculative-config, TensorRT-LLM's names read as vLLM's; SystemExit naming the
    bad key or value."""
    try:
        given = json.loads(text) if text else {}
    except json.JSONDecodeError as error:
        raise SystemExit(f"--speculative-config is not JSON ({error}): {text!r}") from None
    if not isinstance(given, dict):
        raise SystemExit(f"--speculative-config must be a JSON object, got {text!r}")
    unknown = set(given) - SPEC_KEYS - set(TRTLLM_NAMES)
    if unknown:
        raise SystemExit(f"--speculative-config: unknown keys {sorted(unknown)}; known: "
                         f"{sorted(SPEC_KEYS | set(TRTLLM_NAMES))}")
    config, spelled = {}, {}  # vLLM's name -> value, and the key it was given as
    for key, value in given.items():
        if key == "decoding_type" and isinstance(value, str):
            value = value.lower()  # TensorRT-LLM spells it "DSpark"
        name = TRTLLM_NAMES.get(key, key)
        if name in config and config[name] != value:
            raise SystemExit(f"--speculative-config: {key}={given[key]!r} disagrees with "
                             f"{spelled[name]}={given[spelled[name]]!r}")
        config[name], spelled[name] = value, key

    def refuse(name: str, rule: str) -> SystemExit:
        return SystemExit(f"--speculative-config: {spelled[name]} {rule}, got {given[spelled[name]]!r}")

    if config.get("method", "dspark") != "dspark":
        raise refuse("method", "must name DSpark")
    if config.get("rejection_sample_method", "standard") not in VERIFY_METHODS:
        raise refuse("rejection_sample_method", f"must be one of {VERIFY_METHODS}")
    if config.get("draft_sample_method", "probabilistic") not in ("probabilistic", "greedy"):
        raise refuse("draft_sample_method", "must be 'probabilistic' or 'greedy'")
    k = config.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise refuse("num_speculative_tokens", "must be an integer >= 0")
    if not isinstance(config.get("use_rejection_sampling", True), bool):
        raise refuse("use_rejection_sampling", "must be true or false")
    if not isinstance(config.get("model", ""), str):
        raise refuse("model", "must be a folder path or 'none'")
    return config


DEFAULT_MAX_MODEL_LEN = 2048  # prompt + completion tokens per request, unless the model's maximum is smaller


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options that decide the decoder, its static batch and its KV cache (vLLM's names)."""
    add_model_source_args(p)
    p.add_argument("--speculative-config", default=None, help="JSON, vLLM's keys (see above)")
    p.add_argument("--max-num-seqs", "--max-batch", dest="max_num_seqs", type=int, default=8,
                   help="requests running at once: the decode step's batch slots")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"prompt + completion tokens per request (default: {DEFAULT_MAX_MODEL_LEN}, or the "
                        "model's maximum if that is smaller)")
    p.add_argument("--block-size", type=int, default=KV_BLOCK_SIZE, help="positions per KV cache block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA, the share of the card's memory the models and the KV cache may take")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help=f"the KV cache's size in GiB (default: {DEFAULT_KV_CACHE_GIB} off CUDA; on CUDA what "
                        "--gpu-memory-utilization leaves)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="the KV cache's number of blocks, whatever the memory (vLLM's flag)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens per engine step: a longer prompt enters in chunks while the running "
                        "requests decode (default: 2048 on CUDA, 256 on the CPU)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt's prefix that an earlier request computed")


def check_engine_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first engine option out of its range (before any model loads)."""
    for name, value, low in [("--max-num-seqs", args.max_num_seqs, 1), ("--max-model-len", args.max_model_len, 1),
                             ("--block-size", args.block_size, 1), ("--kv-cache-memory", args.kv_cache_memory, 1e-9),
                             ("--num-gpu-blocks-override", args.num_gpu_blocks_override, 2),
                             ("--max-num-batched-tokens", args.max_num_batched_tokens, 1)]:
        if value is not None and not value >= low:
            raise ValueError(f"{name} must be {'> 0' if low < 1 else f'>= {low}'}, got {value}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")


def engine_options(args: argparse.Namespace) -> dict:
    """The Engine's keyword arguments the options give (the server adds its CUDA-graph choice)."""
    return {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len, "block_size": args.block_size,
            "num_blocks": args.num_gpu_blocks_override, "gpu_memory_utilization": args.gpu_memory_utilization,
            "kv_cache_memory": args.kv_cache_memory, "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": args.enable_prefix_caching}


def build_decoder(args: argparse.Namespace, compile: bool):
    """The decoder the options describe -> (decoder, tokenizer); `compile`: torch.compile its
    step. Sets args.max_model_len where it was left to the default. A ValueError or OSError names
    the option (or file) that is wrong."""
    check_engine_args(args)
    spec = speculative_config(args.speculative_config)
    # None: the default model's drafter (none with --model); "none" (or K = 0): none
    args.drafter = "none" if spec.get("num_speculative_tokens") == 0 else spec.get("model")
    target, drafter, tokenizer = load_models(args)
    longest = target.config.max_position_embeddings
    if args.max_model_len is None:
        args.max_model_len = min(DEFAULT_MAX_MODEL_LEN, longest)
    if not 1 <= args.max_model_len <= longest:
        raise ValueError(f"--max-model-len must be in [1, {longest}] for this model, got {args.max_model_len}")
    decoder = SpeculativeDecoder(
        target, drafter, num_speculative_tokens=spec.get("num_speculative_tokens"),
        rejection_sample_method=spec.get("rejection_sample_method", "standard"),
        use_rejection_sampling=spec.get("use_rejection_sampling", True)
        and spec.get("draft_sample_method", "probabilistic") == "probabilistic",
        tokenizer=tokenizer, compile=compile)
    return decoder, tokenizer


def k_choices(args: argparse.Namespace, decoder: SpeculativeDecoder) -> list[int] | None:
    """The drafts a step may verify: chosen per step among default_k_choices, unless
    --speculative-config gives num_speculative_tokens (then None: every step verifies that many)."""
    fixed = "num_speculative_tokens" in speculative_config(args.speculative_config) or decoder.drafter is None
    return None if fixed else default_k_choices(decoder.k)


def compiled_step_options(args: argparse.Namespace, decoder: SpeculativeDecoder) -> dict:
    """What build_decoder's compiled step and its static batch are specialized to, as a compile
    cache records it (dspark.compile.cache): a warm-up's cache fits only a server with these."""
    def resolved(path: str | None) -> str | None:  # ./m and m alike
        return path if path in (None, "none") else str(Path(path).resolve())

    return {"model": resolved(args.model) or "default", "drafter": resolved(args.drafter),
            "dtype": str(next(decoder.target.parameters()).dtype).removeprefix("torch."),
            "num_speculative_tokens": decoder.k,
            "rejection_sample_method": "block" if decoder.block_verify else "standard",
            "greedy_drafts": decoder.greedy_drafts, "k_choices": k_choices(args, decoder),
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len, "block_size": args.block_size,
            "num_blocks": args.num_gpu_blocks_override, "kv_cache_memory": args.kv_cache_memory,
            "gpu_memory_utilization": args.gpu_memory_utilization}
