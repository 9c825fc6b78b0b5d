"""Offline generation from the command line, streamed to the terminal.

    python -m dspark.generate --chat --prompt "Write a haiku about the sea."
    python -m dspark.generate --model path/to/model.gguf --drafter none --prompt "def fib(n):"
"""
from __future__ import annotations

import argparse
import sys
import time

from dspark.decoder import VERIFY_METHODS, SpeculativeDecoder
from dspark.engine import generate
from dspark.loading import add_model_args, load_models
from dspark.sampling import SamplingParams
from dspark.tokenizer import IncrementalDecoder


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    add_model_args(p)
    p.add_argument("--drafter", default=None,
                   help="DeepSpec-format drafter folder, or 'none' to decode without speculation "
                        "(default: the default model's drafter; none with --model)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None)
    p.add_argument("--rejection-sample-method", choices=VERIFY_METHODS, default="standard")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    if args.system is not None and not args.chat:
        p.error("--system needs --chat (the system message goes into the chat template)")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 0:
        p.error(f"--num-speculative-tokens must be >= 0, got {args.num_speculative_tokens}")
    try:  # before the model loads: a bad value costs no wait
        args.params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                     top_k=0 if args.top_k == -1 else args.top_k, min_p=args.min_p,
                                     seed=args.seed, max_tokens=args.max_tokens)
    except ValueError as error:
        p.error(str(error))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        target, drafter, tokenizer = load_models(args)
    except (OSError, ValueError) as error:  # a model file that is not there, or not one
        raise SystemExit(f"python -m dspark.generate: {error}") from None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        prompt = tokenizer.encode(args.prompt, add_special_tokens=True)  # e.g. Llama 3's BOS
    try:
        decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=args.num_speculative_tokens,
                                     rejection_sample_method=args.rejection_sample_method, tokenizer=tokenizer)
    except ValueError as error:  # -k against the drafter's block size, or -k without a drafter
        raise SystemExit(f"python -m dspark.generate: {error}") from None
    if not prompt:
        raise SystemExit("python -m dspark.generate: the prompt encodes to no tokens")
    stream = IncrementalDecoder(tokenizer, skip_special_tokens=True, prompt=prompt)  # what a server's client is sent

    def show(_, tokens):
        sys.stdout.write("".join(stream.push(token) for token in tokens))
        sys.stdout.flush()

    began = time.perf_counter()
    try:
        result = generate(decoder, [prompt], args.params, on_tokens=show)[0]
    except ValueError as error:  # checked before the first token: the prompt and max_tokens past the model's length
        raise SystemExit(f"python -m dspark.generate: {error}") from None
    seconds = time.perf_counter() - began
    sys.stdout.write(stream.flush() + "\n")
    per_step = (len(result.tokens) - 1) / max(result.num_steps, 1)  # the first token comes from the prefill
    print(f"[{len(result.tokens)} tokens in {seconds:.2f} s ({len(result.tokens) / seconds:.1f} tok/s), "
          f"{result.num_steps} steps, {per_step:.2f} tokens/step, "
          f"accepted per position {result.accepted_per_position}, finish: {result.finish_reason}]",
          file=sys.stderr)


if __name__ == "__main__":
    main()
