"""Gumbel-max drafting, one draft position at a time: the step op and the pick op.

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

The step op (one launch per position, tiles of `block_v` tokens x `block_b` rows) reads the
position's logits, base_k (NaN as 0) + bias, and writes per unit of min(block_v, group_size) tokens
the softmax statistics of x and the argmax of x. The bias comes either as it is, [B, V] (a cuBLAS
GEMM through the head before the step: the seed's design), or as its rank-r factor v [B, r] with the
head's W2 [V, r]: then the step computes v W2^T itself, a tile of W2 against all the rows of its row
tile (on tensor cores; a single row on the CUDA cores), so W2 is streamed once per position and the
bias is never written out (drafting does so for small batches: bias_in_step); that step writes the
biased logits in float32, because nothing else could recompute its product bit for bit. The pick op
(one launch per position; per row a race program and a program per chunk of proposal_chunk(...)
tokens, each merging the units into groups and into the row's statistics) runs the two races (the
winning group's logits read again), writes the token and gathers the next Markov embedding, and
writes the position's proposal softmax(x) into `draft_probs`, reading the logits as the step did:
the base logits and the bias, or the biased logits the step wrote, with the same rounding (but for
the last float32 bit of x - max, which the GPU compiler contracts into one FMA, below exp's own
error). So the
seed's float32 biased logits, written by the step and read back by a proposal pass after the block,
are neither written nor read when the bias is given: per token and position the step reads the base
logits and the bias, the pick reads them again (mostly from L2, where the step left them) and writes
the proposal (marked evict_first: the verification reads it only after the target's forward).

On Hopper both kernels are launched eagerly as programmatic dependents of the kernel before them
(programmatic_launch; kept as such in CUDA graphs): each signals at its start that the next may
launch, so the next kernel's programs are placed on the GPU while this one's last programs run,
read what no kernel of the block writes (the step: the base logits; the pick: temperature, seed,
offset, slot) and wait for the kernel before to finish before they read anything else or write.
That takes the launch gap out of the chain of 2K dependent kernels (on the H200 9-11 µs per block
of 7 positions at B = 1, 8, 44 and 88; bench/drafting.py, "no PDL").

Greedy rows (T = 0) take the argmax of the biased logits (smallest id on ties), without noise. NaN
base logits (CUDA-graph padding rows) count as 0, so such a row draws from the bias alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dspark.ops.checks import check_rows
from dspark.ops.fastmath import fast_divide, fast_exp
from dspark.ops.philox import (STREAM_DRAFT, STREAM_DRAFT_GROUP, token_exponentials,
                               token_exponentials_torch)
from dspark.ops.temperature import scaled

GROUP_SIZE = 1024  # tokens per group of the two-level race (part of the draw's definition)
STEP_TILES = (1024, 1)  # default (block_v, block_b) of the step op: one row per program
MIN_DOT = 16  # tensor-core tiles: the low-rank step's row tile and rank chunk are at least this
PROPOSAL_CHUNK = 4096  # vocabulary tokens per proposal program of the pick (proposal_chunk)
BIAS_IN_STEP_MAX_ROWS = 8  # the largest batch whose step computes the Markov bias itself


def bias_in_step(batch: int) -> bool:
    """Whether the step computes the Markov bias of `batch` rows from the head's factor (else a cuBLAS
    GEMM writes it first). On the H200 (bench/drafting.py, docs/performance.md) the step that streams
    W2 itself takes 13% off a block at 8 rows and 18% at 1 (263 against 301 µs, 216 against 263), but
    is 40% and 100% slower at 44 and 88 rows (654 against 467, 1398 against 697: below the copy
    bandwidth with its 128-row tiles), where the GEMM design stays."""
    return batch <= BIAS_IN_STEP_MAX_ROWS


def step_tiles(batch: int, low_rank: bool = False) -> tuple[int, int]:
    """The step's tiles for a batch of `batch` rows. A dense bias or none: STEP_TILES, one warp each
    (on the H200 2-3% faster blocks at B = 44 and 88 than 2048-token tiles with 2 warps, and than
    runs of tiles per program with their loads pipelined; docs/performance.md). A low-rank bias:
    128-token tiles of all rows up to 128, so that W2 is read once per position (64- and 256-token
    tiles were slower on the H200); one row on the CUDA cores, more on tensor cores (at least MIN_DOT
    rows: at B = 1 the CUDA-core product made the H200's block 12 µs faster, 227 -> 215 µs)."""
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
    128 tokens: each program merges 8 times as many unit statistics). On the H200 (whole blocks)
    8,192 against 4,096 tokens: B = 1 229 -> 227 µs, B = 8 271 -> 263; B = 44 / 88 (1,024-token
    units) 466 -> 476, 700 -> 709."""
    return PROPOSAL_CHUNK if unit_size(block_v, group_size) == group_size else 2 * PROPOSAL_CHUNK


def unit_size(block_v: int, group_size: int) -> int:
    """Tokens per unit of the step's outputs: a tile, or a group where a tile holds several."""
    return min(block_v, group_size)


def num_units(vocab_size: int, block_v: int, group_size: int) -> int:
    """Width of the step's outputs: units of unit_size(block_v, group_size) tokens."""
    return triton.cdiv(vocab_size, unit_size(block_v, group_size))


# ---------------------------------------------------------------- step

@triton.jit
def _position_logits(logits_ptr, bias_ptr, rows, tokens, inside, k, logits_row_stride, logits_pos_stride,
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

    biased = _position_logits(logits_ptr, bias_ptr, row64, tokens[None, :], inside, k, logits_row_stride,
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


def step_warps(block_v: int, block_b: int, low_rank: bool) -> int:
    """Warps per step program. Low-rank tiles: 4 up to 4096 tokens per tile, else 8. Others: one per
    1,024 tokens (32 per thread; up to 8), where shuffles and reduction steps take fewer instructions
    per token than with more threads (SASS for sm_90: 26 per token at 1024 x 1 with one warp, 28 at
    2048 x 1 with 2 warps, 39 with 4)."""
    if low_rank:
        return 4 if block_b * block_v <= 4096 else 8
    return min(8, max(1, block_b * block_v // 1024))


def low_rank_bias(v: Tensor, w2: Tensor) -> Tensor:
    """The bias v W2^T from its factor v [B, r] and W2 [V, r], as the head's own GEMM computes it (in
    their dtype), as float32: what the low-rank step adds on the CPU. The CUDA kernel keeps its
    float32 sum unrounded (and sums in another order); on the CPU a float32 product would convert W2
    at every position."""
    return (v @ w2.T).float()


def position_logits(logits: Tensor, bias: Tensor | None, k: int) -> Tensor:
    """Position k's logits [B, V] float32 as the kernels read them: NaN as 0, plus the bias."""
    x = logits[:, k].float()
    x = torch.where(x.isnan(), 0.0, x)
    return x if bias is None else x + bias.float()


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


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


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
    if not all(map(_is_power_of_two, (block_v, block_b, group_size))) or group_size < 4:
        raise ValueError(f"block_v, block_b and group_size (at least 4) must be powers of two, got "
                         f"{block_v}, {block_b}, {group_size}")
    check_rows(batch, temperature=(temperature, torch.float32))


# ---------------------------------------------------------------- pick

@triton.jit
def _pick_kernel(unit_max_ptr, unit_sum_ptr, unit_index_ptr, logits_ptr, bias_ptr, temperature_ptr, seed_ptr,
                 offset_ptr, table_ptr, slots_ptr, tokens_ptr, probs_ptr, rows_ptr, k, group_stream, token_stream,
                 num_positions, num_units, vocab_size, rank, logits_row_stride, logits_pos_stride, bias_row_stride,
                 table_stride, probs_slot_stride, probs_pos_stride, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr,
                 BLOCK_G: tl.constexpr, UNITS_PER_GROUP: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
                 CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Programs per row: 0 runs the two races, writes the token and gathers its Markov row; c >= 1
    writes the proposal of vocabulary chunk c - 1 (CHUNK tokens). Each merges the units into groups
    [BLOCK_G, UNITS_PER_GROUP] and into the row's statistics. PDL: launched as a programmatic
    dependent of the step (waits for it before reading its outputs); the kernel after may launch
    once every program of this one has started."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    # what no kernel of the block writes: read before waiting for the step
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seed_ptr + row)
    offset = tl.load(offset_ptr + row)
    slot = tl.load(slots_ptr + row)
    if PDL:
        gdc_wait()
    # the proposal's logits (none for the race program), read before the statistics are merged so
    # that the two reads overlap
    ids = (chunk - 1) * CHUNK + tl.arange(0, CHUNK)
    in_vocab = (chunk > 0) & (ids < vocab_size)
    y = _position_logits(logits_ptr, bias_ptr, row, ids, in_vocab, k, logits_row_stride, logits_pos_stride,
                         bias_row_stride, HAS_BIAS, "evict_first", False)
    unit = tl.arange(0, BLOCK_G)[:, None] * UNITS_PER_GROUP + tl.arange(0, UNITS_PER_GROUP)[None, :]
    is_unit = unit < num_units
    m_unit = tl.load(unit_max_ptr + row * num_units + unit, mask=is_unit, other=float("-inf"))
    s_unit = tl.load(unit_sum_ptr + row * num_units + unit, mask=is_unit, other=0.0)
    m_group = tl.max(m_unit, 1)
    s_group = tl.sum(tl.where(m_unit == float("-inf"), 0.0, s_unit * tl.exp(m_unit - m_group[:, None])), 1)
    m_all = tl.max(m_group, 0)
    mass = tl.where(m_group == float("-inf"), 0.0, s_group * tl.exp(m_group - m_all))  # S_c / exp(m_all)
    greedy_token = tl.full([], -1, tl.int64)
    if temperature == 0.0:  # greedy rows: the unit of the first maximum, its token
        first = tl.argmax(tl.reshape(m_unit, [BLOCK_G * UNITS_PER_GROUP]), 0, tie_break_left=True)
        greedy_token = tl.load(unit_index_ptr + row * num_units + first)
    inverse = tl.div_rn(1.0, tl.where(temperature == 0.0, 1.0, temperature))

    if chunk == 0:  # the group race, then the token race inside the winning group
        counters = tl.arange(0, BLOCK_G // 4)
        group_noise = token_exponentials(seed, offset, counters, counters * 0 + group_stream)
        group = tl.argmax(fast_divide(mass, group_noise), 0, tie_break_left=True).to(tl.int64)
        tokens = group * GROUP + tl.arange(0, GROUP)
        inside = tokens < vocab_size
        x = _position_logits(logits_ptr, bias_ptr, row, tokens, inside, k, logits_row_stride, logits_pos_stride,
                             bias_row_stride, HAS_BIAS, "", False) * inverse
        x = tl.where(inside, x, float("-inf"))
        p = fast_exp(x - tl.max(x, 0))
        counters = group * (GROUP // 4) + tl.arange(0, GROUP // 4)
        token_noise = token_exponentials(seed, offset, counters, counters * 0 + token_stream)
        drawn = group * GROUP + tl.argmax(fast_divide(p, token_noise), 0, tie_break_left=True)
        token = tl.where(temperature == 0.0, greedy_token, drawn)
        tl.store(tokens_ptr + row * num_positions + k, token)
        if GATHER:
            cols = tl.arange(0, BLOCK_R)
            values = tl.load(table_ptr + token * table_stride + cols, mask=cols < rank)
            tl.store(rows_ptr + row * rank + cols, values, mask=cols < rank)
    else:  # chunk c's proposal: softmax(x) = exp(x - m_all) / sum(mass); one-hot for greedy rows
        q = tl.exp(y * inverse - m_all) * (1.0 / tl.sum(mass, 0))
        q = tl.where(temperature == 0.0, (ids == greedy_token).to(tl.float32), q)
        tl.store(probs_ptr + slot * probs_slot_stride + k * probs_pos_stride + ids, q, mask=in_vocab,
                 eviction_policy="evict_first")


def launch_gumbel_pick(wrap, unit_max, unit_sum, unit_index, logits, bias, temperature, seed, offset, table, k,
                       block_v, group_size, tokens, slots, draft_probs, rows, chunk=None, pdl=False):
    """Runs the pick kernel (`wrap` and `pdl` as launch_step's): per row a race program and a proposal
    program per `chunk` tokens (a power of two; default proposal_chunk)."""
    batch, units = unit_max.shape
    vocab = logits.shape[-1]
    rank = rows.shape[-1]
    units_per_group = group_size // unit_size(block_v, group_size)
    groups = triton.cdiv(units, units_per_group)
    chunk = chunk or proposal_chunk(block_v, group_size)
    wrap(_pick_kernel)[(batch, 1 + triton.cdiv(vocab, chunk))](
        unit_max, unit_sum, unit_index, logits, logits if bias is None else bias, temperature, seed, offset,
        unit_max if table is None else table, slots, tokens, draft_probs, rows, k, STREAM_DRAFT_GROUP + k,
        STREAM_DRAFT + k, tokens.shape[1], units, vocab, rank, logits.stride(0), logits.stride(1),
        0 if bias is None else bias.stride(0), 0 if table is None else table.stride(0), draft_probs.stride(0),
        draft_probs.stride(1), HAS_BIAS=bias is not None, GATHER=table is not None,
        BLOCK_G=max(4, triton.next_power_of_2(groups)), UNITS_PER_GROUP=units_per_group, GROUP=group_size,
        BLOCK_R=triton.next_power_of_2(max(rank, 1)), CHUNK=chunk, PDL=pdl, num_warps=8, **launch_options(pdl))


def gumbel_pick_torch(unit_max: Tensor, unit_sum: Tensor, unit_index: Tensor, logits: Tensor,
                      bias: Tensor | None, temperature: Tensor, seed: Tensor, offset: Tensor,
                      table: Tensor | None, k: int, block_v: int, group_size: int, tokens: Tensor,
                      slots: Tensor, draft_probs: Tensor) -> Tensor:
    """The pick op in plain torch (the CPU implementation)."""
    batch, units = unit_max.shape
    vocab = logits.shape[-1]
    per_group = group_size // unit_size(block_v, group_size)
    groups = triton.cdiv(units, per_group)
    pad = groups * per_group - units
    m_unit = F.pad(unit_max, (0, pad), value=float("-inf")).view(batch, groups, per_group)
    s_unit = F.pad(unit_sum, (0, pad)).view(batch, groups, per_group)
    m_group = m_unit.amax(-1)
    s_group = torch.where(m_unit == float("-inf"), 0.0, s_unit * torch.exp(m_unit - m_group[..., None])).sum(-1)
    m_all = m_group.amax(-1, keepdim=True)
    mass = torch.where(m_group == float("-inf"), 0.0, s_group * torch.exp(m_group - m_all))
    greedy_token = unit_index.gather(1, unit_max.argmax(1, keepdim=True)).squeeze(1)  # first maximum
    x = scaled(position_logits(logits, bias, k), temperature)  # [B, V]

    greedy = (temperature == 0)[:, None]
    q = torch.exp(x - m_all) * (1.0 / mass.sum(-1, keepdim=True))
    q = torch.where(greedy, (torch.arange(vocab, device=x.device) == greedy_token[:, None]).float(), q)
    draft_probs[slots, k] = q

    seed, offset = seed[:, None], offset[:, None]
    group_noise = token_exponentials_torch(seed, offset, groups, STREAM_DRAFT_GROUP + k)
    group = (mass / group_noise).argmax(1, keepdim=True)  # [B, 1]
    width = min(group_size, vocab)  # a vocabulary smaller than a group has one group: no noise past it
    ids = group * group_size + torch.arange(width, device=x.device)
    x = torch.where(ids < vocab, x.gather(1, ids.clamp_max(vocab - 1)), float("-inf"))
    p = torch.exp(x - x.amax(-1, keepdim=True))
    token_noise = token_exponentials_torch(seed, offset, width, STREAM_DRAFT + k, first=group * group_size)
    drawn = group.squeeze(1) * group_size + (p / token_noise).argmax(1)
    token = torch.where(temperature == 0, greedy_token, drawn)
    tokens[:, k] = token
    return unit_max.new_empty((batch, 0)) if table is None else table[token]


@triton_op("dspark::gumbel_pick", mutates_args=("tokens", "draft_probs"))
def gumbel_pick(unit_max: Tensor, unit_sum: Tensor, unit_index: Tensor, logits: Tensor, bias: Tensor | None,
                temperature: Tensor, seed: Tensor, offset: Tensor, table: Tensor | None, k: int, tokens: Tensor,
                slots: Tensor, draft_probs: Tensor, block_v: int = STEP_TILES[0],
                group_size: int = GROUP_SIZE) -> Tensor:
    """Draws position k from a step's outputs (unit_max, unit_sum, unit_index [B, U], the step's
    block_v and group_size) and writes its proposal. The position's logits are read as the step
    read them: logits[:, k] (NaN as 0) + bias, logits [B, K, V] (the step's input, or the biased
    logits it wrote) and bias [B, V] or None; x = those / T.
    The two races of the module docstring for rows with T > 0 (temperature [B] float32; seed,
    offset [B] int64), the argmax for greedy rows, write the token to tokens[:, k] ([B, K] int64);
    draft_probs[slots[b], k] = softmax(x[b]) (one-hot at the token for greedy rows; draft_probs
    [S, K, V] float32, slots [B] int64, distinct; other slots are left as they are). Returns the
    token's row of the Markov embedding table ([V, r], any dtype) for the next position: [B, r] in
    the table's dtype ([B, 0] float32 when table is None)."""
    if unit_max.dim() != 2 or unit_index.dtype != torch.int64 or any(
            t.shape != unit_max.shape or not t.is_contiguous() for t in (unit_max, unit_sum, unit_index)):
        raise ValueError(f"unit_max, unit_sum, unit_index (int64) must be contiguous [B, U], got "
                         f"{[tuple(t.shape) for t in (unit_max, unit_sum, unit_index)]}")
    batch = unit_max.shape[0]
    if logits.dim() != 3 or logits.shape[0] != batch or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [{batch}, K, V] with contiguous rows, got {tuple(logits.shape)}")
    _, positions, vocab = logits.shape
    if bias is not None and (bias.shape != (batch, vocab) or bias.stride(-1) != 1):
        raise ValueError(f"bias must be [{batch}, {vocab}] with contiguous rows, got {tuple(bias.shape)}")
    if tokens.shape != (batch, positions) or tokens.dtype != torch.int64 or not tokens.is_contiguous():
        raise ValueError(f"tokens must be contiguous [{batch}, {positions}] int64, got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    if not 0 <= k < positions:
        raise ValueError(f"draft position k={k} outside 0..{positions - 1}")
    if (draft_probs.dim() != 3 or draft_probs.shape[1:] != (positions, vocab)
            or draft_probs.dtype != torch.float32 or draft_probs.stride(-1) != 1):
        raise ValueError(f"draft_probs must be float32 [S, {positions}, {vocab}], got "
                         f"{draft_probs.dtype} {tuple(draft_probs.shape)}")
    if not (_is_power_of_two(block_v) and _is_power_of_two(group_size) and group_size >= 4) or \
            unit_max.shape[1] != num_units(vocab, block_v, group_size):
        raise ValueError(f"the step's outputs [B, {unit_max.shape[1]}] do not fit block_v={block_v}, "
                         f"group_size={group_size} and V={vocab}")
    if table is not None and (table.dim() != 2 or table.stride(1) != 1):
        raise ValueError(f"table must be [V, r] with contiguous rows, got {tuple(table.shape)}")
    check_rows(batch, temperature=(temperature, torch.float32), seed=(seed, torch.int64),
               offset=(offset, torch.int64), slots=(slots, torch.int64))
    if unit_max.device.type == "cpu":
        return gumbel_pick_torch(unit_max, unit_sum, unit_index, logits, bias, temperature, seed, offset, table, k,
                                 block_v, group_size, tokens, slots, draft_probs)
    rows = (unit_max.new_empty((batch, 0)) if table is None
            else table.new_empty((batch, table.shape[1])))
    launch_gumbel_pick(wrap_triton, unit_max, unit_sum, unit_index, logits, bias, temperature, seed, offset, table,
                       k, block_v, group_size, tokens, slots, draft_probs, rows, pdl=programmatic_launch(logits.device))
    return rows
