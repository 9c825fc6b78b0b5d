"""Gumbel-max drafting, one draft position at a time: the step op and the pick op.

Draft position k is drawn from softmax(x) with x = (base_k + bias) / T, as
argmax_v (x_v + g_v), where g_v = gumbel(seed, offset, v, STREAM_DRAFT + k) is keyed by the global
token id. The vocabulary is cut into chunks (one Triton program each); the step op returns every
chunk's winner and the pick op reduces them. Since the noise of a token never depends on its chunk,
the drawn token does not depend on the chunking, and ties go to the smallest token id.

The step op also keeps what the proposal op (proposal.py) needs afterwards: the biased float32
logits and per-chunk softmax statistics of x (max m_j and sum_j exp(x - m_j)), which it merges
whatever the number of chunks.

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
from dspark.ops.philox import STREAM_DRAFT, gumbel, gumbel_torch

CHUNK_SIZE = 1024  # vocabulary tokens per step program (a power of two)


def num_chunks(vocab_size: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Width of the chunk-statistics buffers for `chunk_size`-token chunks."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    return triton.cdiv(vocab_size, chunk_size)


# ---------------------------------------------------------------- step

@triton.jit
def _step_kernel(logits_ptr, bias_ptr, temperature_ptr, seed_ptr, offset_ptr,
                 biased_ptr, chunk_max_ptr, chunk_sum_ptr, best_ptr, index_ptr,
                 k, philox_stream, vocab_size, num_positions, num_chunks, logits_row_stride,
                 logits_pos_stride, HAS_BIAS: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    tokens = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = tokens < vocab_size

    base = tl.load(logits_ptr + row * logits_row_stride + k * logits_pos_stride + tokens,
                   mask=inside, other=0.0).to(tl.float32)
    biased = tl.where(base != base, 0.0, base)  # NaN padding rows draw from the bias alone
    if HAS_BIAS:
        biased += tl.load(bias_ptr + row * vocab_size + tokens, mask=inside, other=0.0).to(tl.float32)
    tl.store(biased_ptr + (row * num_positions + k) * vocab_size + tokens, biased, mask=inside)

    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    scale = tl.broadcast_to(tl.where(greedy, 1.0, temperature), biased.shape)
    x = tl.where(inside, tl.div_rn(biased, scale), float("-inf"))  # proposal.py divides the same way
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0)
    stat = (row * num_positions + k) * num_chunks + chunk
    tl.store(chunk_max_ptr + stat, m)
    tl.store(chunk_sum_ptr + stat, s)

    streams = tokens * 0 + philox_stream  # a tensor where Triton specializes the int to a constexpr
    noise = gumbel(tl.load(seed_ptr + row), tl.load(offset_ptr + row), tokens, streams)
    score = tl.where(inside, tl.where(greedy, biased, x + noise), float("-inf"))
    best, index = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(index_ptr + row * num_chunks + chunk, chunk * CHUNK + index)


def launch_gumbel_step(wrap, logits, bias, temperature, seed, offset, k, biased, chunk_max,
                       chunk_sum, chunk_size, best, index):
    batch, positions, vocab = logits.shape
    chunks = chunk_max.shape[-1]
    wrap(_step_kernel)[(batch, chunks)](
        logits, logits if bias is None else bias, temperature, seed, offset,
        biased, chunk_max, chunk_sum, best, index,
        k, STREAM_DRAFT + k, vocab, positions, chunks, logits.stride(0), logits.stride(1),
        HAS_BIAS=bias is not None, CHUNK=chunk_size, num_warps=4)


def gumbel_step_torch(logits: Tensor, bias: Tensor | None, temperature: Tensor, seed: Tensor,
                      offset: Tensor, k: int, biased: Tensor, chunk_max: Tensor, chunk_sum: Tensor,
                      chunk_size: int) -> tuple[Tensor, Tensor]:
    """The step op in plain torch (the CPU implementation; the same function as the kernel)."""
    batch, _, vocab = logits.shape
    chunks = chunk_max.shape[-1]
    base = logits[:, k].float()
    row = torch.where(base.isnan(), 0.0, base)
    if bias is not None:
        row = row + bias.float()
    biased[:, k] = row

    greedy = (temperature == 0)[:, None]
    x = row / torch.where(greedy, 1.0, temperature[:, None])
    tokens = torch.arange(vocab, device=logits.device)
    noise = gumbel_torch(seed[:, None], offset[:, None], tokens, STREAM_DRAFT + k)
    score = torch.where(greedy, row, x + noise)

    def by_chunk(t: Tensor) -> Tensor:  # [B, V] -> [B, C, chunk], padded with -inf
        padded = F.pad(t, (0, chunks * chunk_size - vocab), value=float("-inf"))
        return padded.view(batch, chunks, chunk_size)

    x = by_chunk(x)
    m = x.amax(-1)
    chunk_max[:, k] = m
    chunk_sum[:, k] = torch.exp(x - torch.where(m == float("-inf"), 0.0, m)[..., None]).sum(-1)
    best, index = by_chunk(score).max(-1)  # the first maximum: ties go to the smallest id
    return best, index + chunk_size * torch.arange(chunks, device=logits.device)


@triton_op("dspark::gumbel_step", mutates_args=("biased", "chunk_max", "chunk_sum"))
def gumbel_step(logits: Tensor, bias: Tensor | None, temperature: Tensor, seed: Tensor,
                offset: Tensor, k: int, biased: Tensor, chunk_max: Tensor, chunk_sum: Tensor,
                chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """Gumbel-max step of draft position k.

    logits [B, K, V] float32 | bfloat16, read as they are; bias [B, V] any float dtype, or None
    (no Markov head); temperature [B] float32 (0 = greedy row); seed, offset [B] int64.
    Writes biased[:, k] = logits[:, k] + bias ([B, K, V] float32) and chunk_max[:, k],
    chunk_sum[:, k] ([B, K, C] float32: softmax statistics of biased / T per chunk of chunk_size
    tokens, a power of two; C = num_chunks(V, chunk_size)).
    Returns each chunk's best score [B, C] float32 and its token id [B, C] int64.
    """
    _check_step(logits, bias, temperature, seed, offset, k, biased, chunk_max, chunk_sum,
                chunk_size)
    if logits.device.type == "cpu":
        return gumbel_step_torch(logits, bias, temperature, seed, offset, k, biased, chunk_max,
                                 chunk_sum, chunk_size)
    batch, chunks = logits.shape[0], chunk_max.shape[-1]
    best = logits.new_empty((batch, chunks), dtype=torch.float32)
    index = logits.new_empty((batch, chunks), dtype=torch.int64)
    launch_gumbel_step(wrap_triton, logits, bias, temperature, seed, offset, k, biased, chunk_max,
                       chunk_sum, chunk_size, best, index)
    return best, index


def _check_step(logits, bias, temperature, seed, offset, k, biased, chunk_max, chunk_sum, chunk_size):
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, K, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    batch, positions, vocab = logits.shape
    if not 0 <= k < positions:
        raise ValueError(f"draft position k={k} outside 0..{positions - 1}")
    if bias is not None and (bias.shape != (batch, vocab) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{batch}, {vocab}], got {tuple(bias.shape)}")
    if biased.shape != logits.shape or biased.dtype != torch.float32 or not biased.is_contiguous():
        raise ValueError(f"biased must be contiguous float32 {tuple(logits.shape)}, "
                         f"got {biased.dtype} {tuple(biased.shape)}")
    chunks = num_chunks(vocab, chunk_size)
    for name, stats in (("chunk_max", chunk_max), ("chunk_sum", chunk_sum)):
        if (stats.shape != (batch, positions, chunks) or stats.dtype != torch.float32
                or not stats.is_contiguous()):
            raise ValueError(f"{name} must be contiguous float32 [{batch}, {positions}, {chunks}] "
                             f"(chunks of {chunk_size}), got {stats.dtype} {tuple(stats.shape)}")
    check_rows(batch, temperature=(temperature, torch.float32), seed=(seed, torch.int64),
                offset=(offset, torch.int64))


# ---------------------------------------------------------------- pick

@triton.jit
def _pick_kernel(best_ptr, index_ptr, table_ptr, token_ptr, rows_ptr, num_chunks, rank,
                 table_stride, GATHER: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    best = tl.load(best_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                   other=float("-inf"))
    winner = tl.argmax(best, 0, tie_break_left=True)
    token = tl.load(index_ptr + row * num_chunks + winner)
    tl.store(token_ptr + row, token)
    if GATHER:
        cols = tl.arange(0, BLOCK_R)
        values = tl.load(table_ptr + token * table_stride + cols, mask=cols < rank)
        tl.store(rows_ptr + row * rank + cols, values, mask=cols < rank)


def launch_gumbel_pick(wrap, best, index, table, token, rows):
    batch, chunks = best.shape
    rank = rows.shape[-1]
    wrap(_pick_kernel)[(batch,)](
        best, index, best if table is None else table, token, rows, chunks, rank,
        0 if table is None else table.stride(0), GATHER=table is not None,
        BLOCK_C=triton.next_power_of_2(chunks), BLOCK_R=triton.next_power_of_2(max(rank, 1)))


def gumbel_pick_torch(best: Tensor, index: Tensor, table: Tensor | None) -> tuple[Tensor, Tensor]:
    """The pick op in plain torch (the CPU implementation)."""
    token = index.gather(1, best.argmax(1, keepdim=True)).squeeze(1)  # first maximum
    if table is None:
        return token, best.new_empty((best.shape[0], 0))
    return token, table[token]


@triton_op("dspark::gumbel_pick", mutates_args=())
def gumbel_pick(best: Tensor, index: Tensor, table: Tensor | None) -> tuple[Tensor, Tensor]:
    """Reduces the step op's chunk winners (best [B, C] float32, index [B, C] int64) to the drawn
    token [B] int64 and gathers its row of the Markov embedding table ([V, r], any dtype) for the
    next position: [B, r] in the table's dtype ([B, 0] float32 when table is None)."""
    if best.dim() != 2 or index.shape != best.shape or index.dtype != torch.int64:
        raise ValueError(f"best [B, C] and index [B, C] int64 expected, got {tuple(best.shape)} "
                         f"and {index.dtype} {tuple(index.shape)}")
    if table is not None and (table.dim() != 2 or table.stride(1) != 1):
        raise ValueError(f"table must be [V, r] with contiguous rows, got {tuple(table.shape)}")
    if best.device.type == "cpu":
        return gumbel_pick_torch(best, index, table)
    batch = best.shape[0]
    token = index.new_empty(batch)
    rows = (best.new_empty((batch, 0)) if table is None
            else table.new_empty((batch, table.shape[1])))
    launch_gumbel_pick(wrap_triton, best.contiguous(), index.contiguous(), table, token, rows)
    return token, rows
