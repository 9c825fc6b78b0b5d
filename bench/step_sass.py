"""The drafting step kernel's machine code for the H200 (sm_90), compiled on any machine: SASS
instructions per tile and per token, registers, spills.

At large batches the step is bound by instruction issue (Nsight Compute; docs/performance.md), so
its SASS instruction count per token is the figure a change to its arithmetic moves; this counts it
without a GPU. Triton compiles the kernel as a launch at V = 200064 would (pointers and the
vocabulary's multiples of 16 specialized as divisible by 16), with a bfloat16 bias [B, V] (--tiles)
or with a rank-256 bfloat16 factor and W2 (the bias product in the step, --low-rank-tiles), then
its bundled ptxas and cuobjdump give the SASS. Static counts: every
instruction once, the division's slow paths included (Nsight Compute counted 113 executed
instructions per token at 1024-token tiles where this counts 126 for the same commit).

    python -m bench.step_sass                     # the default tilings
    python -m bench.step_sass --tiles 4096x1 2048x2 --low-rank-tiles 128x1 128x16
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton

from bench.timing import emit_table
from dspark.ops.aot import LaunchRecorder
from dspark.ops.gumbel_max import GROUP_SIZE, STEP_TILES, num_units, step_tiles
from dspark.ops.gumbel_step import launch_step
from drafting import tile_pair

RANK = 256  # the drafting benchmark's Markov rank
VOCAB = 200064


def sass(block_v: int, block_b: int, low_rank: bool) -> tuple[str, dict, int]:
    """The step kernel's SASS, resource usage and warps at tiles (block_v, block_b) for sm_90, as
    launch_step launches it for a batch of block_b rows of bfloat16 logits: with a rank-256 factor
    and W2 (low_rank: the bias product in the step), else with a bias [B, V]."""

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    units = num_units(VOCAB, block_v, GROUP_SIZE)
    recorder = LaunchRecorder()
    launch_step(recorder, meta(block_b, 7, VOCAB), meta(block_b, RANK if low_rank else VOCAB),
                meta(VOCAB, RANK) if low_rank else None, meta(block_b, dtype=torch.float32), 3,
                meta(block_b, 7, VOCAB, dtype=torch.float32) if low_rank else None, block_v, block_b, GROUP_SIZE,
                meta(block_b, units, dtype=torch.float32), meta(block_b, units, dtype=torch.float32),
                meta(block_b, units, dtype=torch.int64))
    kernel, warps = recorder.compile_all()[0], recorder.launches[0][3]
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "step.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
    return text, {key: int(value) for key, value in re.findall(r"(REG|STACK):(\d+)", usage)}, warps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", type=tile_pair, nargs="*", default=sorted({STEP_TILES, step_tiles(88)}),
                        metavar="VxB", help="step tilings (block_v, block_b) with a dense bias")
    parser.add_argument("--low-rank-tiles", type=tile_pair, nargs="*",
                        default=sorted({step_tiles(b, low_rank=True) for b in (1, 8, 88)}), metavar="VxB",
                        help="step tilings with the bias product in the step")
    parser.add_argument("--out", help="also write the table as markdown here")
    args = parser.parse_args()
    rows = []
    for low_rank, tilings in ((False, args.tiles), (True, args.low_rank_tiles)):
        for block_v, block_b in tilings:
            text, usage, warps = sass(block_v, block_b, low_rank)
            count = len(re.findall(r"/\*[0-9a-f]{4,5}\*/\s+\S", text))
            tokens = block_v * block_b
            threads = 32 * warps
            rows.append(f"| {block_v} x {block_b} | {'low-rank' if low_rank else 'dense'} | {threads} | {count} "
                        f"| {count * threads / tokens:.0f} | {usage['REG']} | {usage['STACK']} |")
    header = f"Step kernel SASS for sm_90 (static counts, per thread), triton {triton.__version__}.\n"
    emit_table([header, "| tile (V x B) | bias | threads | instructions | per token | registers | stack bytes |",
                "|---|---|---|---|---|---|---|", *rows], args.out)


if __name__ == "__main__":
    main()
