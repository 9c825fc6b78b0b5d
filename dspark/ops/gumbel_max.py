"""Gumbel-max drafting, one draft position at a time: the step op and the pick op.

Draft position k is drawn from softmax(x), x = (base_k + bias) * (1 / T) with one correctly rounded
reciprocal per row, by the exponential race argmax_v exp(x_v) / e_v: e_v ~ Exp(1) is the exponential
of token v's Philox word in stream STREAM_DRAFT + k (philox.py). That is Gumbel-max,
argmax_v x_v - log(e_v), without a second log per token. The vocabulary is cut into tiles of
`block_v` tokens (and the batch into tiles of `block_b` rows). Per (row, tile) the step computes the
softmax statistics of x, the tile's max m and s = sum_v exp(x_v - m), and runs the race with the
exp(x_v - m) it has computed for s; the tile's winner carries the score
m + log(max_v exp(x_v - m) / e_v), so that tiles compare. The noise of a token depends only on
(seed, offset, position, token id): the draw does not depend on the tiling, but for float32
rounding of near ties (a ratio is rounded relative to its tile's max). Ties go to the smallest id.

The Markov bias is a cuBLAS GEMM through the head before the step (the seed's design); the step
adds it, writes the biased float32 logits (for the proposal op) and returns every tile's winner and
statistics. The pick op reduces them to the token, merges the statistics into one (max, sum) per
(row, position) and gathers the next Markov embedding.

Greedy rows (T = 0) take the argmax of the biased logits, without noise. NaN base logits (CUDA-graph
padding rows) count as 0, so such a row draws from the bias alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from dspark.ops.checks import check_rows
from dspark.ops.fastmath import fast_divide, fast_exp
from dspark.ops.philox import STREAM_DRAFT, token_exponentials, token_exponentials_torch

STEP_TILES = (1024, 1)  # default (block_v, block_b) of the step op: one row per program


def step_tiles(batch: int) -> tuple[int, int]:
    """The step's tiles for a batch of `batch` rows: 2048-token tiles from 8 rows on, where the
    fewer tiles per row take 4-6% off a block at B = 44 and 88 (and 2% more at B = 1;
    bench/drafting.py --tiles on the H200, docs/performance.md). Both tilings are checked on the
    H200 by the `gpu` tests at SmolLM2's vocabulary and 80 rows."""
    return STEP_TILES if batch < 8 else (2048, 1)


def num_chunks(vocab_size: int, block_v: int) -> int:
    """Number of vocabulary tiles of `block_v` tokens: the width of the step's outputs."""
    return triton.cdiv(vocab_size, block_v)


# ---------------------------------------------------------------- step

@triton.jit
def _step_kernel(logits_ptr, bias_ptr, temperature_ptr, seed_ptr, offset_ptr, biased_ptr, best_ptr,
                 index_ptr, chunk_max_ptr, chunk_sum_ptr, k, philox_stream, batch, vocab_size,
                 num_positions, logits_row_stride, logits_pos_stride, HAS_BIAS: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per (row tile, vocabulary tile)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    tile = tl.program_id(1)
    tokens = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    is_row = rows < batch
    inside = is_row[:, None] & (tokens < vocab_size)[None, :]
    row64 = rows.to(tl.int64)[:, None]

    base = tl.load(logits_ptr + row64 * logits_row_stride + k * logits_pos_stride + tokens[None, :],
                   mask=inside, other=0.0).to(tl.float32)
    biased = tl.where(base != base, 0.0, base)  # NaN padding rows draw from the bias alone
    if HAS_BIAS:
        biased += tl.load(bias_ptr + row64 * vocab_size + tokens[None, :], mask=inside,
                          other=0.0).to(tl.float32)
    tl.store(biased_ptr + (row64 * num_positions + k) * vocab_size + tokens[None, :], biased,
             mask=inside)

    temperature = tl.load(temperature_ptr + rows, mask=is_row, other=1.0)
    greedy = temperature == 0.0
    inverse = tl.div_rn(tl.full([BLOCK_B], 1.0, tl.float32), tl.where(greedy, 1.0, temperature))
    x = tl.where(inside, biased * inverse[:, None], float("-inf"))  # proposal.py scales the same way
    m = tl.max(x, 1)
    p = fast_exp(x - tl.where(m == float("-inf"), 0.0, m)[:, None])  # flushed below 2^-126: no effect

    counters = tile * (BLOCK_V // 4) + tl.arange(0, BLOCK_V // 4)
    streams = counters * 0 + philox_stream  # a tensor where Triton specializes the int to a constexpr
    seed = tl.load(seed_ptr + rows, mask=is_row, other=0)[:, None]
    offset = tl.load(offset_ptr + rows, mask=is_row, other=0)[:, None]
    e = token_exponentials(seed, offset, counters[None, :], streams[None, :])
    score = tl.where(greedy[:, None], x, fast_divide(p, e))  # x: biased or -inf for greedy rows
    best, index = tl.max(score, 1, return_indices=True, return_indices_tie_break_left=True)
    best = tl.where(greedy, best, m + tl.log(tl.where(greedy, 1.0, best)))

    out = rows * tl.num_programs(1) + tile
    tl.store(best_ptr + out, best, mask=is_row)
    tl.store(index_ptr + out, tile * BLOCK_V + index, mask=is_row)
    tl.store(chunk_max_ptr + out, m, mask=is_row)
    tl.store(chunk_sum_ptr + out, tl.sum(p, 1), mask=is_row)


def launch_step(wrap, logits, bias, temperature, seed, offset, k, biased, block_v, block_b, best,
                index, chunk_max, chunk_sum):
    """Runs the step kernel; `wrap` is torch.library.wrap_triton inside the ops (identity in
    interpreter tests). bias: [B, V] or None."""
    batch, positions, vocab = logits.shape
    wrap(_step_kernel)[(triton.cdiv(batch, block_b), num_chunks(vocab, block_v))](
        logits, logits if bias is None else bias, temperature, seed, offset, biased, best, index,
        chunk_max, chunk_sum, k, STREAM_DRAFT + k, batch, vocab, positions, logits.stride(0),
        logits.stride(1), HAS_BIAS=bias is not None, BLOCK_B=block_b, BLOCK_V=block_v,
        num_warps=step_warps(block_v, block_b))


def step_warps(block_v: int, block_b: int) -> int:
    """Warps per step program: 4 up to 4096 tokens per tile, else 8."""
    return 4 if block_b * block_v <= 4096 else 8


def step_torch(logits: Tensor, bias: Tensor | None, temperature: Tensor, seed: Tensor,
               offset: Tensor, k: int, biased: Tensor, block_v: int) -> tuple[Tensor, ...]:
    """The step in plain torch (the CPU implementation; the same function as the kernel), for a
    bias [B, V] float32 or None."""
    batch, _, vocab = logits.shape
    chunks = num_chunks(vocab, block_v)
    base = logits[:, k].float()
    row = torch.where(base.isnan(), 0.0, base)
    if bias is not None:
        row = row + bias
    biased[:, k] = row

    def by_chunk(t: Tensor, fill: float) -> Tensor:  # [B, V] -> [B, C, block_v], padded with fill
        return F.pad(t, (0, chunks * block_v - vocab), value=fill).view(batch, chunks, block_v)

    greedy = temperature == 0
    inverse = 1.0 / torch.where(greedy, 1.0, temperature)
    x = by_chunk(row * inverse[:, None], float("-inf"))
    m = x.amax(-1)
    p = torch.exp(x - torch.where(m == float("-inf"), 0.0, m)[..., None])
    e = by_chunk(token_exponentials_torch(seed[:, None], offset[:, None], vocab, STREAM_DRAFT + k), 1.0)
    score = torch.where(greedy[:, None, None], by_chunk(row, float("-inf")), p / e)
    best, index = score.max(-1)  # the first maximum: ties go to the smallest id
    best = torch.where(greedy[:, None], best, m + torch.log(torch.where(greedy[:, None], 1.0, best)))
    return best, index + block_v * torch.arange(chunks, device=logits.device), m, p.sum(-1)


@triton_op("dspark::gumbel_step", mutates_args=("biased",))
def gumbel_step(logits: Tensor, bias: Tensor | None, temperature: Tensor, seed: Tensor,
                offset: Tensor, k: int, biased: Tensor, block_v: int = STEP_TILES[0],
                block_b: int = STEP_TILES[1]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gumbel-max step of draft position k.

    logits [B, K, V] float32 | bfloat16, read as they are; bias [B, V] any float dtype, or None
    (no Markov head); temperature [B] float32 (0 = greedy row); seed, offset [B] int64.
    Writes biased[:, k] = logits[:, k] + bias ([B, K, V] float32). block_v (a power of two, at
    least 4) and block_b (a power of two) tile the vocabulary and the batch.
    Returns per (row, vocabulary tile), each [B, C] with C = num_chunks(V, block_v): the winner's
    score (float32) and token id (int64), and the tile's softmax statistics of x = biased / T, its
    max and sum of exp(x - max) (float32).
    """
    _check_step(logits, temperature, seed, offset, k, biased, block_v, block_b)
    if bias is not None and (bias.shape != (logits.shape[0], logits.shape[-1])
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{logits.shape[0]}, {logits.shape[-1]}], "
                         f"got {tuple(bias.shape)}")
    if logits.device.type == "cpu":
        return step_torch(logits, None if bias is None else bias.float(), temperature, seed, offset,
                          k, biased, block_v)
    shape = (logits.shape[0], num_chunks(logits.shape[-1], block_v))
    best, chunk_max, chunk_sum = (logits.new_empty(shape, dtype=torch.float32) for _ in range(3))
    index = logits.new_empty(shape, dtype=torch.int64)
    launch_step(wrap_triton, logits, bias, temperature, seed, offset, k, biased, block_v, block_b,
                best, index, chunk_max, chunk_sum)
    return best, index, chunk_max, chunk_sum


def _check_step(logits, temperature, seed, offset, k, biased, block_v, block_b):
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, K, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    batch, positions, _ = logits.shape
    if not 0 <= k < positions:
        raise ValueError(f"draft position k={k} outside 0..{positions - 1}")
    if biased.shape != logits.shape or biased.dtype != torch.float32 or not biased.is_contiguous():
        raise ValueError(f"biased must be contiguous float32 {tuple(logits.shape)}, "
                         f"got {biased.dtype} {tuple(biased.shape)}")
    if block_v < 4 or block_v & (block_v - 1) or block_b < 1 or block_b & (block_b - 1):
        raise ValueError(f"block_v (at least 4) and block_b must be powers of two, got {block_v}, "
                         f"{block_b}")
    check_rows(batch, temperature=(temperature, torch.float32), seed=(seed, torch.int64),
               offset=(offset, torch.int64))


# ---------------------------------------------------------------- pick

@triton.jit
def _pick_kernel(best_ptr, index_ptr, chunk_max_ptr, chunk_sum_ptr, table_ptr, tokens_ptr,
                 stat_max_ptr, stat_sum_ptr, rows_ptr, k, num_positions, num_chunks, rank,
                 table_stride, GATHER: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = row * num_chunks + tl.arange(0, BLOCK_C)
    is_chunk = tl.arange(0, BLOCK_C) < num_chunks
    best = tl.load(best_ptr + chunks, mask=is_chunk, other=float("-inf"))
    token = tl.load(index_ptr + row * num_chunks + tl.argmax(best, 0, tie_break_left=True))
    tl.store(tokens_ptr + row * num_positions + k, token)

    m = tl.load(chunk_max_ptr + chunks, mask=is_chunk, other=float("-inf"))
    s = tl.load(chunk_sum_ptr + chunks, mask=is_chunk, other=0.0)
    m_all = tl.max(m, 0)
    tl.store(stat_max_ptr + row * num_positions + k, m_all)
    tl.store(stat_sum_ptr + row * num_positions + k,
             tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_all)), 0))
    if GATHER:
        cols = tl.arange(0, BLOCK_R)
        values = tl.load(table_ptr + token * table_stride + cols, mask=cols < rank)
        tl.store(rows_ptr + row * rank + cols, values, mask=cols < rank)


def launch_gumbel_pick(wrap, best, index, chunk_max, chunk_sum, table, k, tokens, stat_max,
                       stat_sum, rows):
    batch, chunks = best.shape
    rank = rows.shape[-1]
    wrap(_pick_kernel)[(batch,)](
        best, index, chunk_max, chunk_sum, best if table is None else table, tokens, stat_max,
        stat_sum, rows, k, tokens.shape[1], chunks, rank, 0 if table is None else table.stride(0),
        GATHER=table is not None, BLOCK_C=triton.next_power_of_2(chunks),
        BLOCK_R=triton.next_power_of_2(max(rank, 1)))


def gumbel_pick_torch(best: Tensor, index: Tensor, chunk_max: Tensor, chunk_sum: Tensor,
                      table: Tensor | None, k: int, tokens: Tensor, stat_max: Tensor,
                      stat_sum: Tensor) -> Tensor:
    """The pick op in plain torch (the CPU implementation)."""
    token = index.gather(1, best.argmax(1, keepdim=True)).squeeze(1)  # first maximum
    tokens[:, k] = token
    m_all = chunk_max.amax(1, keepdim=True)
    stat_max[:, k] = m_all.squeeze(1)
    stat_sum[:, k] = torch.where(chunk_max == float("-inf"), 0.0,
                                 chunk_sum * torch.exp(chunk_max - m_all)).sum(1)
    return best.new_empty((best.shape[0], 0)) if table is None else table[token]


@triton_op("dspark::gumbel_pick", mutates_args=("tokens", "stat_max", "stat_sum"))
def gumbel_pick(best: Tensor, index: Tensor, chunk_max: Tensor, chunk_sum: Tensor,
                table: Tensor | None, k: int, tokens: Tensor, stat_max: Tensor,
                stat_sum: Tensor) -> Tensor:
    """Reduces a step's per-tile outputs (best, index, chunk_max, chunk_sum [B, C]) for position k:
    writes the drawn token to tokens[:, k] ([B, K] int64) and the merged softmax statistics of the
    position, max M and sum of exp(x - M), to stat_max[:, k] and stat_sum[:, k] ([B, K] float32).
    Returns the token's row of the Markov embedding table ([V, r], any dtype) for the next position:
    [B, r] in the table's dtype ([B, 0] float32 when table is None)."""
    if best.dim() != 2 or index.dtype != torch.int64 or any(
            t.shape != best.shape or not t.is_contiguous() for t in (best, index, chunk_max, chunk_sum)):
        raise ValueError(f"best, index (int64), chunk_max, chunk_sum must be contiguous [B, C], got "
                         f"{[tuple(t.shape) for t in (best, index, chunk_max, chunk_sum)]}")
    batch = best.shape[0]
    if tokens.dim() != 2 or tokens.shape[0] != batch or tokens.dtype != torch.int64 or any(
            t.shape != tokens.shape or not t.is_contiguous() for t in (tokens, stat_max, stat_sum)):
        raise ValueError(f"tokens (int64), stat_max, stat_sum must be contiguous [{batch}, K]")
    if not 0 <= k < tokens.shape[1]:
        raise ValueError(f"draft position k={k} outside 0..{tokens.shape[1] - 1}")
    if table is not None and (table.dim() != 2 or table.stride(1) != 1):
        raise ValueError(f"table must be [V, r] with contiguous rows, got {tuple(table.shape)}")
    if best.device.type == "cpu":
        return gumbel_pick_torch(best, index, chunk_max, chunk_sum, table, k, tokens, stat_max,
                                 stat_sum)
    rows = (best.new_empty((batch, 0)) if table is None
            else table.new_empty((batch, table.shape[1])))
    launch_gumbel_pick(wrap_triton, best, index, chunk_max, chunk_sum, table, k, tokens, stat_max,
                       stat_sum, rows)
    return rows
