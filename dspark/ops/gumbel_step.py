"""The step op of Gumbel-max drafting (the draw: gumbel_max.py): the pass over the vocabulary.

One launch per draft position, tiles of `block_v` tokens x `block_b` rows. It reads the position's
logits, base_k (NaN as 0) + bias, and writes per unit of min(block_v, group_size) tokens the softmax
statistics of x and the argmax of x. The bias comes either as it is, [B, V] (a cuBLAS GEMM through
the head before the step), or as its rank-r factor v [B, r] with the head's W2
[V, r]: then the step computes v W2^T itself, a tile of W2 against all the rows of its row tile (on
tensor cores; a single row on the CUDA cores), so W2 is streamed once per position and the bias is
never written out (drafting does so for small batches: bias_in_step); that step writes the biased
logits in float32, because nothing else could recompute its product bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton
from triton.language.extra.cuda import gdc_launch_dependents

from dspark.ops.checks import check_rows
from dspark.ops.fastmath import fast_exp
from dspark.ops.gumbel_max import (GROUP_SIZE, MIN_DOT, STEP_TILES, is_power_of_two, launch_options,
                                   load_position_logits, num_units, position_logits, programmatic_launch, rank_chunk,
                                   unit_size)
from dspark.ops.temperature import scaled

@triton.jit
def _w2_chunk(w2_ptr, tokens, is_token, r, in_rank, w2_row_stride):
    """W2's ranks r of the tile's tokens: [BLOCK_V, BLOCK_R] (0 outside the vocabulary or the rank)."""
    return tl.load(w2_ptr + tokens.to(tl.int64)[:, None] * w2_row_stride + r[None, :],
                   mask=is_token[:, None] & in_rank[None, :], other=0.0)


@triton.jit
def _low_rank_product(v_ptr, w2_ptr, rows, tokens, is_row, is_token, v_row_stride, w2_row_stride,
                      RANK: tl.constexpr, BLOCK_R: tl.constexpr):
    """v W2^T for a tile, transposed: [BLOCK_V, BLOCK_B] float32. W2's tokens are the dot's M, so
    that Hopper's warpgroup MMA takes row tiles of 16; the rank loop is software-pipelined."""
    acc = tl.zeros([tokens.shape[0], rows.shape[0]], tl.float32)
    for start in tl.range(0, RANK, BLOCK_R, num_stages=3):
        r = start + tl.arange(0, BLOCK_R)
        in_rank = r < RANK
        w2 = _w2_chunk(w2_ptr, tokens, is_token, r, in_rank, w2_row_stride)
        v = tl.load(v_ptr + rows.to(tl.int64)[None, :] * v_row_stride + r[:, None],
                    mask=in_rank[:, None] & is_row[None, :], other=0.0)  # [BLOCK_R, BLOCK_B]
        acc = tl.dot(w2, v, acc, input_precision="ieee")
    return acc


@triton.jit
def _low_rank_row(v_ptr, w2_ptr, tokens, is_token, w2_row_stride, RANK: tl.constexpr, BLOCK_R: tl.constexpr):
    """v W2^T of one row for a tile, on the CUDA cores (a row tile of one: no tensor-core tile to fill):
    [BLOCK_V] float32. v_ptr points at the row's factor; the rank loop is software-pipelined."""
    acc = tl.zeros([tokens.shape[0]], tl.float32)
    for start in tl.range(0, RANK, BLOCK_R, num_stages=3):
        r = start + tl.arange(0, BLOCK_R)
        in_rank = r < RANK
        w2 = _w2_chunk(w2_ptr, tokens, is_token, r, in_rank, w2_row_stride)
        v = tl.load(v_ptr + r, mask=in_rank, other=0.0)  # [BLOCK_R]
        acc += tl.sum(w2.to(tl.float32) * v.to(tl.float32)[None, :], 1)
    return acc


@triton.jit
def _step_kernel(logits_ptr, bias_ptr, w2_ptr, temperature_ptr, biased_ptr, unit_max_ptr, unit_sum_ptr,
                 unit_index_ptr, k, batch, vocab_size, num_positions, logits_row_stride, logits_pos_stride,
                 bias_row_stride, w2_row_stride, BIAS: tl.constexpr, WRITE: tl.constexpr, RANK: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, UNIT: tl.constexpr,
                 PDL: tl.constexpr):
    """One program per (row tile, vocabulary tile). BIAS: 0 none, 1 dense [B, V], 2 the factor [B, r]
    times W2 [V, r] transposed (float32 accumulation: tl.dot, or on the CUDA cores for row tiles of
    one). WRITE: store the biased logits.
    Odd positions take the vocabulary tiles in reverse launch order: a position starts on the tiles
    (of W2) the position before read last, which are still in L2. PDL: launched as a programmatic
    dependent of the kernel before (the pick, or the bias GEMM): the base logits are read before
    waiting for it, and the pick after this step may launch once every tile of it has started."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    tile = tl.program_id(1)
    if k % 2 == 1:
        tile = tl.num_programs(1) - 1 - tile
    tokens = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    is_row = rows < batch
    is_token = tokens < vocab_size
    inside = is_row[:, None] & is_token[None, :]
    row64 = rows.to(tl.int64)[:, None]

    biased = load_position_logits(logits_ptr, bias_ptr, row64, tokens[None, :], inside, k, logits_row_stride,
                              logits_pos_stride, bias_row_stride, BIAS == 1, "", PDL)
    if BIAS == 2 and BLOCK_B == 1:
        v_ptr = bias_ptr + tl.program_id(0).to(tl.int64) * bias_row_stride
        biased += _low_rank_row(v_ptr, w2_ptr, tokens, is_token, w2_row_stride, RANK, BLOCK_R)[None, :]
    elif BIAS == 2:
        biased += tl.trans(_low_rank_product(bias_ptr, w2_ptr, rows, tokens, is_row, is_token, bias_row_stride,
                                             w2_row_stride, RANK, BLOCK_R))
    if WRITE:
        tl.store(biased_ptr + (row64 * num_positions + k) * vocab_size + tokens[None, :], biased, mask=inside)

    temperature = tl.load(temperature_ptr + rows, mask=is_row, other=1.0)
    inverse = tl.div_rn(tl.full([BLOCK_B], 1.0, tl.float32), tl.where(temperature == 0.0, 1.0, temperature))
    x = tl.where(inside, biased * inverse[:, None], float("-inf"))  # the pick scales the same way
    UNITS: tl.constexpr = BLOCK_V // UNIT
    x = tl.reshape(x, [BLOCK_B, UNITS, UNIT])
    m, index = tl.max(x, 2, return_indices=True, return_indices_tie_break_left=True)
    p = fast_exp(x - tl.where(m == float("-inf"), 0.0, m)[:, :, None])  # flushed below 2^-126: no effect

    units = tile * UNITS + tl.arange(0, UNITS)
    out = rows[:, None] * tl.cdiv(vocab_size, UNIT) + units[None, :]
    is_unit = is_row[:, None] & (units * UNIT < vocab_size)[None, :]
    tl.store(unit_max_ptr + out, m, mask=is_unit)
    tl.store(unit_sum_ptr + out, tl.sum(p, 2), mask=is_unit)
    tl.store(unit_index_ptr + out, units[None, :] * UNIT + index, mask=is_unit)


def launch_step(wrap, logits, bias, w2, temperature, k, biased, block_v, block_b, group_size, unit_max,
                unit_sum, unit_index, pdl=False):
    """Runs the step kernel; `wrap` is torch.library.wrap_triton inside the ops (identity in
    interpreter tests). bias: [B, V], or [B, r] with w2 [V, r], or None; biased: [B, K, V] or None.
    pdl: launch it as a programmatic dependent of the kernel before (programmatic_launch)."""
    batch, positions, vocab = logits.shape
    rank = 0 if w2 is None else w2.shape[1]
    wrap(_step_kernel)[(triton.cdiv(batch, block_b), triton.cdiv(vocab, block_v))](
        logits, logits if bias is None else bias, logits if w2 is None else w2, temperature,
        unit_max if biased is None else biased, unit_max, unit_sum, unit_index, k, batch, vocab, positions,
        logits.stride(0), logits.stride(1), 0 if bias is None else bias.stride(0),
        0 if w2 is None else w2.stride(0), BIAS=0 if bias is None else 1 if w2 is None else 2,
        WRITE=biased is not None, RANK=rank, BLOCK_R=rank_chunk(rank), BLOCK_B=block_b, BLOCK_V=block_v,
        UNIT=unit_size(block_v, group_size), PDL=pdl, num_warps=step_warps(block_v, block_b, w2 is not None),
        **launch_options(pdl))


def step_warps(block_v: int, block_b: int, low_rank: bool) -> int:
    """Warps per step program. Low-rank tiles: 4 up to 4096 tokens per tile, else 8. Others: one per
    1,024 tokens (32 per thread; up to 8), where shuffles and reduction steps take fewer instructions
    per token than with more threads (`python -m bench.step_sass` counts them per tiling)."""
    if low_rank:
        return 4 if block_b * block_v <= 4096 else 8
    return min(8, max(1, block_b * block_v // 1024))


def low_rank_bias(v: Tensor, w2: Tensor) -> Tensor:
    """The bias v W2^T from its factor v [B, r] and W2 [V, r], as the head's own GEMM computes it (in
    their dtype), as float32: what the low-rank step adds on the CPU. The CUDA kernel keeps its
    float32 sum unrounded (and sums in another order); on the CPU a float32 product would convert W2
    at every position."""
    return (v @ w2.T).float()


def step_torch(logits: Tensor, bias: Tensor | None, temperature: Tensor, k: int, biased: Tensor | None,
               block_v: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The step in plain torch (the CPU implementation; the same function as the kernel), for a
    bias [B, V] or None."""
    batch, _, vocab = logits.shape
    unit = unit_size(block_v, group_size)
    units = triton.cdiv(vocab, unit)
    row = position_logits(logits, bias, k)
    if biased is not None:
        biased[:, k] = row
    x = F.pad(scaled(row, temperature), (0, units * unit - vocab), value=float("-inf")).view(batch, units, unit)
    m, index = x.max(-1)  # the first maximum: ties go to the smallest id
    p = torch.exp(x - torch.where(m == float("-inf"), 0.0, m)[..., None])
    return m, p.sum(-1), index + unit * torch.arange(units, device=logits.device)


@triton_op("dspark::gumbel_step", mutates_args=("biased",))
def gumbel_step(logits: Tensor, bias: Tensor | None, w2: Tensor | None, temperature: Tensor, k: int,
                biased: Tensor | None, block_v: int = STEP_TILES[0], block_b: int = STEP_TILES[1],
                group_size: int = GROUP_SIZE) -> tuple[Tensor, Tensor, Tensor]:
    """Step of draft position k: the pass over the vocabulary.

    logits [B, K, V] float32 | bfloat16, read as they are; bias: the Markov bias [B, V] (any float
    dtype), or, with w2 [V, r] (the head's W2), its factor v [B, r] in w2's dtype (bias = v W2^T,
    computed in the step; block_b 1 or at least MIN_DOT), or None (no Markov head); temperature [B]
    float32 (0 = greedy row). The position's logits are logits[:, k] (NaN as 0) + bias, in float32.
    biased [B, K, V] float32 or None: if given, biased[:, k] = those logits (the pick then reads them
    there: needed with w2, whose product the pick cannot recompute). block_v (a power of two) and
    block_b (a power of two) tile the vocabulary and the batch; group_size (a power of two) is the
    draw's group (module docstring).
    Returns per (row, unit of unit_size(block_v, group_size) tokens), each [B, U] with
    U = num_units(V, block_v, group_size): the softmax statistics of x = logits / T, its max and sum
    of exp(x - max) (float32), and the token id of its max (int64, the smallest on ties).
    """
    _check_step(logits, temperature, k, biased, block_v, block_b, group_size)
    _check_bias(logits, bias, w2, block_b)
    if w2 is not None and biased is None:
        raise ValueError("with w2 the step must write the biased logits: give biased")
    if logits.device.type == "cpu":
        dense = None if bias is None else bias if w2 is None else low_rank_bias(bias, w2)
        return step_torch(logits, dense, temperature, k, biased, block_v, group_size)
    shape = (logits.shape[0], num_units(logits.shape[-1], block_v, group_size))
    unit_max, unit_sum = (logits.new_empty(shape, dtype=torch.float32) for _ in range(2))
    unit_index = logits.new_empty(shape, dtype=torch.int64)
    launch_step(wrap_triton, logits, bias, w2, temperature, k, biased, block_v, block_b, group_size, unit_max,
                unit_sum, unit_index, programmatic_launch(logits.device))
    return unit_max, unit_sum, unit_index


def _check_bias(logits, bias, w2, block_b):
    batch, _, vocab = logits.shape
    if w2 is None:
        if bias is not None and (bias.shape != (batch, vocab) or bias.stride(-1) != 1):
            raise ValueError(f"bias must be [{batch}, {vocab}] with contiguous rows, got {tuple(bias.shape)}")
        return
    if w2.dim() != 2 or w2.shape[0] != vocab or w2.stride(-1) != 1:
        raise ValueError(f"w2 must be [{vocab}, r] with contiguous rows, got {tuple(w2.shape)}")
    if bias is None or bias.shape != (batch, w2.shape[1]) or bias.dtype != w2.dtype or bias.stride(-1) != 1:
        raise ValueError(f"with w2, bias must be the factor [{batch}, {w2.shape[1]}] {w2.dtype} with contiguous "
                         f"rows, got {None if bias is None else (tuple(bias.shape), bias.dtype)}")
    if 1 < block_b < MIN_DOT:
        raise ValueError(f"the low-rank step needs block_b = 1 or >= {MIN_DOT} (a tensor-core tile), got {block_b}")


def _check_step(logits, temperature, k, biased, block_v, block_b, group_size):
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, K, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    batch, positions, _ = logits.shape
    if not 0 <= k < positions:
        raise ValueError(f"draft position k={k} outside 0..{positions - 1}")
    if biased is not None and (biased.shape != logits.shape or biased.dtype != torch.float32
                               or not biased.is_contiguous()):
        raise ValueError(f"biased must be contiguous float32 {tuple(logits.shape)}, "
                         f"got {biased.dtype} {tuple(biased.shape)}")
    if not all(map(is_power_of_two, (block_v, block_b, group_size))) or group_size < 4:
        raise ValueError(f"block_v, block_b and group_size (at least 4) must be powers of two, got "
                         f"{block_v}, {block_b}, {group_size}")
    check_rows(batch, temperature=(temperature, torch.float32))
