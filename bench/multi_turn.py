"""Multi-turn conversations with automatic prefix caching on and off, in one process: per turn, the
prompt tokens the engine computes and the time to first token.

`--conversations` synthetic conversations of `--turns` turns run side by side: each turn's prompt is
the conversation so far (every earlier user message and the replies the engine gave, as token ids)
and a new user message (a held-out prompt), in the chat template, as an agent replays its history.
With prefix caching the engine finds the history's full blocks cached and computes only the rest.

    python -m bench.multi_turn [--conversations 2] [--turns 8] [--reply 64] [--out table.md]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import time

import torch

from bench.clients import serve_clients
from bench.models import default_pair_decoder
from bench.timing import emit_table
from dspark import SamplingParams
from dspark.data import heldout_prompts
from dspark.engine import Engine


def turn_tokens(tokenizer, message: str, first: bool) -> list[int]:
    """A user message and the assistant's header, in the chat template; the first turn's with the
    template's opening (its system turn)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                        tokenize=True)
    if first:
        return ids
    opening = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=True)
    opening = opening[:next(i for i, (a, b) in enumerate(zip(opening, ids)) if a != b)]
    return tokenizer.encode("\n") + ids[len(opening):]  # the newline that closes the assistant's turn


def converse(engine: Engine, tokenizer, messages: list[str], reply: int, records: list) -> None:
    """One conversation: each turn submits the whole history and waits for the reply; appends
    (turn, prompt tokens, computed tokens, seconds to first token) to `records`."""
    history: list[int] = []
    for turn, message in enumerate(messages):
        prompt = history + turn_tokens(tokenizer, message, first=not history)
        began = time.perf_counter()
        request = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True))
        first = None
        while (event := request.events.get()) is not None:
            first = first or time.perf_counter()
        records.append((turn, len(prompt), len(prompt) - request.num_cached, first - began))
        history = prompt + request.result.tokens + tokenizer.encode("<|im_end|>")


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--reply", type=int, default=64, help="tokens per assistant reply")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    decoder, tokenizer, device, dtype = default_pair_decoder()
    texts = [p.text for p in heldout_prompts()]
    results = {}
    for caching in (True, False):
        engine = Engine(decoder, max_num_seqs=args.conversations, max_model_len=8192, enable_prefix_caching=caching)
        records: list = []
        serve_clients(engine, [functools.partial(converse, engine, tokenizer, texts[c * args.turns:(c + 1) * args.turns],
                                                 args.reply, records) for c in range(args.conversations)])
        results[caching] = records
    lines = [f"{datetime.date.today()}, {torch.cuda.get_device_name() if device == 'cuda' else platform.machine() + ' CPU'}, "
             f"torch {torch.__version__}, {str(dtype).split('.')[-1]}; the default pair (K = 7), {args.conversations} "
             f"conversations side by side, {args.reply}-token replies; per turn, the mean over the conversations", "",
             "| turn | prompt tokens | computed, caching on | computed, off | first token s, on | first token s, off |",
             "|---|---|---|---|---|---|"]
    for turn in range(args.turns):
        on = [r for r in results[True] if r[0] == turn]
        off = [r for r in results[False] if r[0] == turn]
        mean = lambda rows, i: statistics.mean(r[i] for r in rows)  # noqa: E731
        lines.append(f"| {turn + 1} | {mean(on, 1):.0f} | {mean(on, 2):.0f} | {mean(off, 2):.0f} | "
                     f"{mean(on, 3):.2f} | {mean(off, 3):.2f} |")
    total = {c: sum(r[2] for r in results[c]) for c in results}
    lines.append(f"| all | {sum(r[1] for r in results[True])} | {total[True]} | {total[False]} | "
                 f"{statistics.mean(r[3] for r in results[True]):.2f} | {statistics.mean(r[3] for r in results[False]):.2f} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
