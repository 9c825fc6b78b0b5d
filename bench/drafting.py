"""Drafting alone: one block of K ancestral drafts, against a plain torch loop and the variants below.

B x K x V bfloat16 base logits, a rank-r vanilla Markov head in bfloat16, random data. Each variant
runs the whole block; on GPU it is captured in a CUDA graph after warm-up and timed by replays
(CUDA events, median; the L2 cache overwritten before each replay, so that no replay starts on what
the one before left there). Variants, in one process:

- torch loop: per position the bias GEMM, softmax, multinomial and a float32 proposal scatter;
- dspark: ancestral_draft as shipped (per position the step and the pick, which writes the
  position's proposal; the Markov bias by the design gumbel_max.bias_in_step picks for the batch,
  at its default tiles);
- bias in step: ancestral_draft(fuse_bias=True): the step computes the bias from the head's rank-r
  factor, streaming W2 itself; with --tiles, one more such column per step tiling;
- bias GEMM: ancestral_draft(fuse_bias=False): per position a cuBLAS GEMM writes the bias [B, V],
  the step reads it with the base logits, the pick reads both again (no float32 biased logits);
- no PDL: dspark with the step and the pick launched as plain kernels, not as programmatic
  dependents of the kernel before them (programmatic_launch);
- proposal chunk N (with --proposal-chunks): dspark with the pick's proposal programs of N tokens
  (gumbel_max.PROPOSAL_CHUNK), the sweep that chose the shipped size;
- bias GEMMs: the K Markov GEMMs alone, the part of that design's time cuBLAS spends;
- floor: the bytes the design must move, at the bandwidth an elementwise kernel streams in the same
  run (a graph-captured copy_ becomes a memcpy node, which streams slower on the H200): the Markov
  matrix W2 read once per position, the base logits read once, the float32 biased logits written
  and read back once, the float32 proposals written once.

    python -m bench.drafting --out table.md             # H200: B = 1, 8, 44, 88; K = 7; V = 200064
    python -m bench.drafting --tiles 64x16 256x32        # also these step tilings
    python -m bench.drafting --proposal-chunks 2048 8192 # also these proposal chunks
    python -m bench.drafting --smoke                     # CPU, tiny shapes: checks that it runs
    python -m bench.drafting --batches 88 --profile 20   # and the kernels of 20 eager dspark blocks
"""
from __future__ import annotations

import argparse
import contextlib
import datetime

import torch
import triton

from bench.timing import emit_table, median_us, print_profile
from dspark.drafting import ancestral_draft
from dspark.markov import VanillaMarkov
from dspark.ops import gumbel_max, gumbel_pick, gumbel_step


def stream_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of dst = src + 1 over nbytes, counting bytes read and written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (median_us(lambda: torch.add(src, 1.0, out=dst), device) * 1e-6)


def torch_loop(logits, head, anchor, temperature, slots, draft_probs):
    """The baseline: a full sampling pipeline per position."""
    prev, tokens = anchor, []
    for k in range(logits.shape[1]):
        bias = head.markov_w2(head.markov_w1(prev))
        probs = torch.softmax((logits[:, k].float() + bias.float()) / temperature[:, None], dim=-1)
        prev = torch.multinomial(probs, 1).squeeze(1)
        draft_probs[slots, k] = probs
        tokens.append(prev)
    return torch.stack(tokens, dim=1)


@contextlib.contextmanager
def patched(name: str, value, modules=(gumbel_max,)):
    """`name` of the drafting modules set to `value` meanwhile: a variant of the shipped drafting."""
    shipped = [getattr(module, name) for module in modules]
    for module in modules:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, original in zip(modules, shipped):
            setattr(module, name, original)


def bias_gemms(head, prev_embedding, positions):
    for _ in range(positions):
        head.markov_w2(prev_embedding)


def floor_bytes(batch, positions, vocab, rank) -> int:
    markov = positions * vocab * rank * 2
    block = batch * positions * vocab
    return markov + block * (2 + 4 + 4 + 4)


def run(batches, positions, vocab, rank, tiles, chunks, device, profile=0) -> tuple[list[dict], float]:
    """Per batch size: µs of each variant (keys in table order) and the floor; with `profile`, the
    kernels of that many eager dspark blocks at the last batch size are printed."""
    torch.manual_seed(0)
    head = VanillaMarkov(vocab, rank).to(device, torch.bfloat16)
    bandwidth = stream_bandwidth(device, 2**30 if device.type == "cuda" else 2**24)
    rows = []
    for batch in batches:
        logits = torch.randn(batch, positions, vocab, device=device, dtype=torch.bfloat16)
        anchor = torch.randint(0, vocab, (batch,), device=device)
        temperature = torch.rand(batch, device=device) + 0.5
        seed = torch.randint(0, 2**62, (batch,), device=device)
        offset = torch.randint(0, 2**40, (batch,), device=device)
        slots = torch.randperm(batch, device=device)
        draft_probs = torch.empty(batch, positions, vocab, device=device)
        prev_embedding = head.markov_w1(anchor)

        def block(**kwargs):
            return ancestral_draft(logits, None, head, anchor, temperature, seed, offset, slots,
                                   draft_probs, **kwargs)

        def dspark(variant=contextlib.nullcontext(), **kwargs):
            with variant:
                return median_us(lambda: block(**kwargs), device, flush_l2=True)

        with torch.inference_mode():
            row = {
                "B": batch,
                "torch loop": median_us(lambda: torch_loop(logits, head, anchor, temperature, slots,
                                                           draft_probs), device, flush_l2=True),
                "dspark": dspark(),
                "bias in step": dspark(fuse_bias=True),
                **{f"bias in step {v}x{b}": dspark(tiles=(v, b), fuse_bias=True) for v, b in tiles},
                "bias GEMM": dspark(fuse_bias=False),
                "no PDL": dspark(patched("programmatic_launch", lambda device: False, (gumbel_step, gumbel_pick))),
                **{f"proposal chunk {c}": dspark(patched("PROPOSAL_CHUNK", c)) for c in chunks},
                "bias GEMMs": median_us(lambda: bias_gemms(head, prev_embedding, positions), device,
                                        flush_l2=True),
                "floor": 1e6 * floor_bytes(batch, positions, vocab, rank) / bandwidth,
            }
        rows.append(row)
    if profile:
        with torch.inference_mode():
            print(f"dspark at B = {batches[-1]}, eager:")
            print_profile([block] * profile, device, unit="block")
    return rows, bandwidth


def table(rows) -> str:
    """µs of every variant and the floor, then each drafting variant's fraction of the floor."""
    timed = [name for name in rows[0] if name != "B"]
    drafting = [name for name in timed if name not in ("bias GEMMs", "floor")]
    lines = ["| B | " + " | ".join(f"{name} µs" for name in timed) + " | "
             + " | ".join(f"{name} / floor" for name in drafting) + " |",
             "|---" * (1 + len(timed) + len(drafting)) + "|"]
    for r in rows:
        lines.append(f"| {r['B']} | " + " | ".join(f"{r[name]:.0f}" for name in timed) + " | "
                     + " | ".join(f"{r[name] / r['floor']:.2f}" for name in drafting) + " |")
    return "\n".join(lines)


def tile_pair(text: str) -> tuple[int, int]:
    block_v, block_b = text.lower().split("x")
    return int(block_v), int(block_b)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 44, 88])
    parser.add_argument("--positions", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=200064)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--tiles", type=tile_pair, nargs="*", default=[], metavar="VxB",
                        help="also time the bias-in-step variant with these step tiles (block_v, block_b)")
    parser.add_argument("--proposal-chunks", type=int, nargs="*", default=[], metavar="N",
                        help="also time dspark with gumbel_max.PROPOSAL_CHUNK = N (shipped: "
                             f"{gumbel_max.PROPOSAL_CHUNK}; twice that after the low-rank step)")
    parser.add_argument("--profile", type=int, default=0, metavar="BLOCKS",
                        help="also profile this many eager dspark blocks at the last batch size")
    parser.add_argument("--out", help="also write the table as markdown here")
    args = parser.parse_args()
    if args.smoke:
        device, batches, positions, vocab, rank = torch.device("cpu"), [1, 4], 3, 3000, 16
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device; use --smoke for a CPU check")
        device, batches, positions, vocab, rank = (torch.device("cuda"), args.batches,
                                                   args.positions, args.vocab, args.rank)
    rows, bandwidth = run(batches, positions, vocab, rank, args.tiles, args.proposal_chunks, device, args.profile)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = (f"Drafting alone: B x {positions} x {vocab} bfloat16 logits, rank-{rank} vanilla "
              f"Markov head, µs per block (median{', CUDA graph' if device.type == 'cuda' else ''})."
              f"\n\n{name}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{datetime.date.today()}; streaming bandwidth {bandwidth / 1e12:.2f} TB/s.\n")
    emit_table([header, table(rows)], args.out)


if __name__ == "__main__":
    main()
