"""The pick op of Gumbel-max drafting (the draw: gumbel_max.py): the token and its proposal.

One launch per draft position: per row a race program and a program per chunk of
proposal_chunk(...) tokens, each merging the step's units into groups and into the row's
statistics. The race program runs the two races (the winning group's logits read again), writes the
token and gathers the next Markov embedding; the others write the position's proposal softmax(x)
into `draft_probs`, reading the logits as the step did: the base logits and the bias, or the biased
logits the step wrote, with the same rounding (but for the last float32 bit of x - max, which the
GPU compiler contracts into one FMA, below exp's own error). So when the bias is given, no float32
biased logits are written by the step and read back by a proposal pass after the block: per token
and position the step reads the base logits and the bias, the pick reads them again (mostly from L2, where the step left them) and writes the proposal (marked
evict_first: the verification reads it only after the target's forward).
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
from dspark.ops.gumbel_max import (GROUP_SIZE, STEP_TILES, is_power_of_two, launch_options, load_position_logits,
                                   num_units, position_logits, programmatic_launch, proposal_chunk, unit_size)
from dspark.ops.philox import (STREAM_DRAFT, STREAM_DRAFT_GROUP, token_exponentials,
                               token_exponentials_torch)
from dspark.ops.temperature import scaled

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
    y = load_position_logits(logits_ptr, bias_ptr, row, ids, in_vocab, k, logits_row_stride, logits_pos_stride,
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
        x = load_position_logits(logits_ptr, bias_ptr, row, tokens, inside, k, logits_row_stride, logits_pos_stride,
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
    the table's dtype ([B, 0] float32 when table is None). Slots must lie in [0, S): on CUDA they are
    written unchecked (a check of values would sync with the host)."""
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
    if not (is_power_of_two(block_v) and is_power_of_two(group_size) and group_size >= 4) or \
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
