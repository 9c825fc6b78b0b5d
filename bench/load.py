"""Loading the default model and its tokenizer from its .gguf file, in one process: dspark's
`load_gguf` parses the file once for both; the baseline (`load_target` and `Tokenizer.from_gguf`
apart, as the loaders ran before) parses it twice. The gguf package's reader spends most of a parse
on SmolLM2's tokenizer metadata (100 k strings). The variants take turns; wall seconds, float32, CPU.

    python -m bench.load [--rounds 3] [--out table.md]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from bench.timing import emit_table
from dspark.loading import default_gguf_path, load_gguf, load_target
from dspark.tokenizer import Tokenizer


def parsed_twice(path):
    return load_target(path), Tokenizer.from_gguf(path)


VARIANTS = {"model and tokenizer apart (two parses)": parsed_twice, "load_gguf (one parse, dspark)": load_gguf}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    path = default_gguf_path()
    seconds = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, load in VARIANTS.items():
            began = time.perf_counter()
            load(path)
            seconds[name].append(time.perf_counter() - began)
    lines = [f"loading {path.name}, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"{datetime.date.today()}: {args.rounds} rounds", "",
             "| loader | seconds (median) | slowest |", "|---|---|---|"]
    lines += [f"| {name} | {statistics.median(s):.2f} | {max(s):.2f} |" for name, s in seconds.items()]
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
