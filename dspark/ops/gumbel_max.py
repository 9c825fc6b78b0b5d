"""Gumbel-max drafting, one draft position at a time: the draw both ops implement (the step op in
gumbel_step.py, the pick op in gumbel_pick.py), its tiling policy and what their kernels share.

Draft position k is drawn from softmax(x), x = (base_k + bias) * (1 / T) with one correctly rounded
reciprocal per row, in two exponential races (Gumbel-max on two levels). The vocabulary is cut into
groups of `group_size` tokens (GROUP_SIZE, a constant of the draw, not of the kernels' tiling):
1. the group race: group c wins with probability S_c / sum S, S_c = sum_{v in c} exp(x_v), as
   argmax_c (m_c + log s_c - log E_c), where m_c, s_c are the group's softmax statistics (max and
   sum of exp(x_v - m_c)) and E_c ~ Exp(1) is the exponential of group c's Philox word in stream
   STREAM_DRAFT_GROUP + k (philox.py; group c takes the word of "token" c);
2. the token race inside the winning group: argmax_v exp(x_v - m_c) / e_v, e_v ~ Exp(1) token v's
   word in stream STREAM_DRAFT + k.
Together they draw v with probability exp(x_v) / sum exp(x): exactly softmax(x), as one race over the
vocabulary would, but the per-token noise is computed for one group per row, not for the whole
vocabulary, so the step that streams the vocabulary is bound by its bytes, not by Philox rounds. The
noise depends only on (seed, offset, position, token or group id): the draw does not depend on the
kernels' tiles, but for float32 rounding of near ties (group sums are summed in tile order).

The step writes per (row, unit of min(block_v, group_size) tokens) the softmax statistics and the
argmax of x; the pick merges the units into groups, runs the two races and writes the position's
proposal softmax(x).

On Hopper both kernels are launched eagerly as programmatic dependents of the kernel before them
(programmatic_launch; kept as such in CUDA graphs): each signals at its start that the next may
launch, so the next kernel's programs are placed on the GPU while this one's last programs run,
read what no kernel of the block writes (the step: the base logits; the pick: temperature, seed,
offset, slot) and wait for the kernel before to finish before they read anything else or write.
That takes the launch gaps out of the chain of 2K dependent kernels (`python -m bench.drafting`,
the "no PDL" column).

Greedy rows (T = 0) take the argmax of the biased logits (smallest id on ties), without noise. NaN
base logits (CUDA-graph padding rows) count as 0, so such a row draws from the bias alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_wait

GROUP_SIZE = 1024  # tokens per group of the two-level race (part of the draw's definition)
STEP_TILES = (1024, 1)  # default (block_v, block_b) of the step op: one row per program
MIN_DOT = 16  # tensor-core tiles: the low-rank step's row tile and rank chunk are at least this
PROPOSAL_CHUNK = 4096  # vocabulary tokens per proposal program of the pick (proposal_chunk)
BIAS_IN_STEP_MAX_ROWS = 8  # the largest batch whose step computes the Markov bias itself


def bias_in_step(batch: int) -> bool:
    """Whether the step computes the Markov bias of `batch` rows from the head's factor (else a cuBLAS
    GEMM writes it first). Up to BIAS_IN_STEP_MAX_ROWS rows the step that streams W2 itself makes the
    block faster; at larger batches its 128-row tiles run below the copy bandwidth and the GEMM wins
    (`python -m bench.drafting`, the "bias in step" and "bias GEMM" columns)."""
    return batch <= BIAS_IN_STEP_MAX_ROWS


def step_tiles(batch: int, low_rank: bool = False) -> tuple[int, int]:
    """The step's tiles for a batch of `batch` rows. A dense bias or none: STEP_TILES, one warp each.
    A low-rank bias: 128-token tiles of all rows up to 128, so that W2 is read once per position;
    one row on the CUDA cores, more on tensor cores (at least MIN_DOT rows). Each choice is the
    fastest block of those `python -m bench.drafting --tiles ...` compares."""
    if low_rank:
        return 128, 1 if batch == 1 else min(128, max(MIN_DOT, triton.next_power_of_2(batch)))
    return STEP_TILES


def rank_chunk(rank: int) -> int:
    """Ranks per iteration of the low-rank step's loop: the rank up to 64, at least MIN_DOT (masked
    beyond it)."""
    return max(MIN_DOT, min(64, triton.next_power_of_2(max(rank, 1))))


def proposal_chunk(block_v: int, group_size: int) -> int:
    """Vocabulary tokens per proposal program of the pick after a step of `block_v`-token tiles:
    PROPOSAL_CHUNK, twice that where the step's units are smaller than a group (the low-rank step's
    128 tokens: each program merges 8 times as many unit statistics). The larger chunk makes small
    batches' blocks faster and large ones' slower (`python -m bench.drafting --proposal-chunks`)."""
    return PROPOSAL_CHUNK if unit_size(block_v, group_size) == group_size else 2 * PROPOSAL_CHUNK


def unit_size(block_v: int, group_size: int) -> int:
    """Tokens per unit of the step's outputs: a tile, or a group where a tile holds several."""
    return min(block_v, group_size)


def num_units(vocab_size: int, block_v: int, group_size: int) -> int:
    """Width of the step's outputs: units of unit_size(block_v, group_size) tokens."""
    return triton.cdiv(vocab_size, unit_size(block_v, group_size))


@triton.jit
def load_position_logits(logits_ptr, bias_ptr, rows, tokens, inside, k, logits_row_stride, logits_pos_stride,
                     bias_row_stride, HAS_BIAS: tl.constexpr, POLICY: tl.constexpr, WAIT: tl.constexpr):
    """Position k's logits as float32 at (rows, tokens) (int64 offsets that broadcast together): the
    given logits, NaN (padding rows) read as 0, plus the bias [B, V] if HAS_BIAS; read with the cache
    eviction POLICY. WAIT: between the two reads, wait for the kernels before this one to finish (a
    programmatic dependent launch), which may write the bias but not the given logits."""
    x = tl.load(logits_ptr + rows * logits_row_stride + k * logits_pos_stride + tokens, mask=inside,
                other=0.0, eviction_policy=POLICY).to(tl.float32)
    if WAIT:
        gdc_wait()
    x = tl.where(x != x, 0.0, x)
    if HAS_BIAS:
        x += tl.load(bias_ptr + rows * bias_row_stride + tokens, mask=inside, other=0.0,
                     eviction_policy=POLICY).to(tl.float32)
    return x


def programmatic_launch(device: torch.device) -> bool:
    """Whether the ops launch their kernels on `device` as programmatic dependents of the kernel
    before (Hopper's programmatic dependent launch, also between the nodes of a CUDA graph): a
    kernel's programs then start while the one before finishes and wait for it only where they read
    what it wrote. Off where torch.compile traces the ops (Inductor launches user kernels without
    launch attributes; the kernels are then compiled without the waits)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and not torch.compiler.is_compiling())


def launch_options(pdl: bool) -> dict:
    """The Triton launch options of a kernel launched as a programmatic dependent (or not)."""
    return {"launch_pdl": True} if pdl else {}


def position_logits(logits: Tensor, bias: Tensor | None, k: int) -> Tensor:
    """Position k's logits [B, V] float32 as the kernels read them: NaN as 0, plus the bias."""
    x = logits[:, k].float()
    x = torch.where(x.isnan(), 0.0, x)
    return x if bias is None else x + bias.float()


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0
