"""python -m dspark.train.probe: training recipes probed one after another on one data set, each to
the same step of a shared schedule.

A probe is `python -m dspark.train` with the shared flags (after `--`), its own flags and
`--stop-at`. The first probe generates the data (seeded, so every probe's data are the same); the
others get the caches copied into their run folders and read them. A probe that has reached its
stop step is not run again, and a cut one resumes, so the same command can be repeated after a
lost machine or split over calls. Prints each probe's held-out estimates: the AL estimate on the
sampled responses (T = 1) and the greedy AL estimate on the greedy ones (T = 0).

    python -m dspark.train.probe --out ~/probes --stop-at 2000 --probe control= \\
        --probe gamma2.5="--decay-gamma 2.5" -- --device cuda --no-rank0-twin --steps 13206 \\
        --argmax-weight 0.3 --kl-weight 0.3 --synthetic-prompts 49152 --responses-per-prompt 2
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dspark.train.resume import CHECKPOINT

CACHES = ("synthetic.jsonl", "sequences.jsonl", "heldout.jsonl")  # what dspark.train generates


def heldout_estimates(run: Path) -> dict[int, tuple[float, float]]:
    """step -> (AL estimate on the sampled responses, greedy AL estimate on the greedy ones)."""
    log = run / "log.jsonl"
    estimates = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a lost machine
            continue
        if "heldout" in row:
            estimates[row["step"]] = (row["heldout"]["sampled"]["drafter"]["al_estimate"],
                                      row["heldout"]["greedy"]["drafter"]["al_greedy_estimate"])
    return estimates


def copy_caches(donor: Path, run: Path) -> None:
    """The donor's data caches into `run`, each whole or not at all."""
    for cache in CACHES:
        if (donor / cache).exists() and not (run / cache).exists():
            shutil.copyfile(donor / cache, run / (cache + ".tmp"))
            os.replace(run / (cache + ".tmp"), run / cache)


def parse_probe(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a probe is NAME=FLAGS (FLAGS may be empty), got {text!r}")
    return name, shlex.split(flags)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m dspark.train.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="one run folder per probe under it")
    p.add_argument("--stop-at", type=int, required=True, help="steps of each probe")
    p.add_argument("--heldout-every", type=int, default=1000)
    p.add_argument("--probe", type=parse_probe, action="append", required=True, help="NAME=FLAGS, in order")
    p.add_argument("shared", nargs=argparse.REMAINDER, help="-- then the flags every probe shares")
    args = p.parse_args(argv)
    names = [name for name, _ in args.probe]
    if len(set(names)) < len(names):
        p.error(f"probe names must differ (each is a run folder), got {names}")
    shared = args.shared[1:] if args.shared[:1] == ["--"] else args.shared
    for name, flags in args.probe:
        run = args.out / name
        if args.stop_at in heldout_estimates(run):
            continue
        donor = next((args.out / n for n, _ in args.probe
                      if args.stop_at in heldout_estimates(args.out / n)), None)
        run.mkdir(parents=True, exist_ok=True)
        if donor is not None:
            copy_caches(donor, run)
        resume = ["--resume"] if (run / CHECKPOINT).exists() else []
        command = [sys.executable, "-m", "dspark.train", "--out", str(run), *shared, *flags, *resume,
                   "--stop-at", str(args.stop_at), "--heldout-every", str(args.heldout_every)]
        print(f"probe {name}: {shlex.join(command)}", flush=True)
        started = time.monotonic()
        subprocess.run(command, check=True)
        print(f"probe {name}: {time.monotonic() - started:.0f} s", flush=True)
        if args.stop_at not in heldout_estimates(run):
            raise SystemExit(f"probe {name} ended before its held-out estimate at step {args.stop_at} "
                             "(a time budget in the shared flags?); run the command again to resume it")

    estimates = {name: heldout_estimates(args.out / name) for name, _ in args.probe}
    steps = sorted({step for rows in estimates.values() for step in rows})
    print("| probe | flags | " + " | ".join(f"step {s}: T = 1 / T = 0" for s in steps) + " |")
    print("|---|---|" + "---|" * len(steps))
    for name, flags in args.probe:
        cells = [" / ".join(f"{x:.2f}" for x in estimates[name][s]) if s in estimates[name] else "—"
                 for s in steps]
        print(f"| {name} | `{shlex.join(flags)}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
