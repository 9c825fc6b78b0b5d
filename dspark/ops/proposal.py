"""The proposal op: after a draft block, writes q_k = softmax(biased_k / T) of every position into the
request's slot of `draft_probs`, the distribution the verifier divides by.

It reads the float32 biased logits the step op (gumbel_max.py) left and the softmax statistics of
x = biased * (1 / T) the pick op merged per (row, position), max M and sum S of exp(x - M), and
recomputes x with the same correctly rounded reciprocal of T the draw used: q = exp(x - M) / S is
exactly the distribution each token was drawn from. Greedy rows (T = 0) store a one-hot at their
drawn token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from dspark.ops.checks import check_rows

BLOCK_SIZE = 4096  # vocabulary tokens per proposal program


@triton.jit
def _proposal_kernel(biased_ptr, stat_max_ptr, stat_sum_ptr, temperature_ptr, tokens_ptr, slots_ptr,
                     probs_ptr, vocab_size, num_positions, probs_slot_stride, probs_pos_stride,
                     BLOCK: tl.constexpr):
    row_pos = tl.program_id(0).to(tl.int64)  # row * num_positions + k
    row = row_pos // num_positions
    k = row_pos % num_positions
    m = tl.load(stat_max_ptr + row_pos)
    inv_sum = 1.0 / tl.load(stat_sum_ptr + row_pos)

    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab_size
    biased = tl.load(biased_ptr + row_pos * vocab_size + tokens, mask=inside, other=0.0)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inverse = tl.div_rn(tl.full([], 1.0, tl.float32), tl.where(greedy, 1.0, temperature))
    q = tl.exp(biased * inverse - m) * inv_sum
    q = tl.where(greedy, (tokens == tl.load(tokens_ptr + row_pos)).to(tl.float32), q)
    slot = tl.load(slots_ptr + row)
    tl.store(probs_ptr + slot * probs_slot_stride + k * probs_pos_stride + tokens, q, mask=inside)


def launch_write_proposals(wrap, biased, stat_max, stat_sum, temperature, tokens, slots,
                           draft_probs):
    batch, positions, vocab = biased.shape
    wrap(_proposal_kernel)[(batch * positions, triton.cdiv(vocab, BLOCK_SIZE))](
        biased, stat_max, stat_sum, temperature, tokens, slots, draft_probs, vocab, positions,
        draft_probs.stride(0), draft_probs.stride(1), BLOCK=BLOCK_SIZE, num_warps=8)


def write_proposals_torch(biased: Tensor, stat_max: Tensor, stat_sum: Tensor, temperature: Tensor,
                          tokens: Tensor, slots: Tensor, draft_probs: Tensor) -> None:
    """The proposal op in plain torch (the CPU implementation)."""
    greedy = (temperature == 0)[:, None, None]
    inverse = 1.0 / torch.where(greedy, 1.0, temperature[:, None, None])
    q = torch.exp(biased * inverse - stat_max[..., None]) * (1.0 / stat_sum[..., None])
    vocab = torch.arange(biased.shape[-1], device=biased.device)
    q = torch.where(greedy, (vocab == tokens[..., None]).float(), q)
    draft_probs.index_copy_(0, slots, q)


@triton_op("dspark::write_proposals", mutates_args=("draft_probs",))
def write_proposals(biased: Tensor, stat_max: Tensor, stat_sum: Tensor, temperature: Tensor,
                    tokens: Tensor, slots: Tensor, draft_probs: Tensor) -> None:
    """draft_probs[slots[b], k] = softmax(biased[b, k] / T[b]) for every draft position k.

    biased [B, K, V] float32 as the step op wrote it; stat_max, stat_sum [B, K] float32 as the
    pick op merged them; temperature [B] float32 (0 = greedy: one-hot at tokens[b, k]);
    tokens [B, K] int64 (the drawn drafts); slots [B] int64, distinct (padding rows need a slot of
    their own); draft_probs [S, K, V] float32, rows of other slots are left as they are.
    """
    batch, positions, vocab = biased.shape
    if biased.dtype != torch.float32 or not biased.is_contiguous():
        raise ValueError(f"biased must be contiguous float32 [B, K, V], got {biased.dtype}")
    for name, stats in (("stat_max", stat_max), ("stat_sum", stat_sum)):
        if stats.shape != (batch, positions) or stats.dtype != torch.float32 or not stats.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [{batch}, {positions}], "
                             f"got {stats.dtype} {tuple(stats.shape)}")
    if tokens.shape != (batch, positions) or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be [{batch}, {positions}] int64, got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    check_rows(batch, temperature=(temperature, torch.float32), slots=(slots, torch.int64))
    if (draft_probs.dim() != 3 or draft_probs.shape[1:] != (positions, vocab)
            or draft_probs.dtype != torch.float32 or draft_probs.stride(-1) != 1):
        raise ValueError(f"draft_probs must be float32 [S, {positions}, {vocab}], got "
                         f"{draft_probs.dtype} {tuple(draft_probs.shape)}")
    if biased.device.type == "cpu":
        return write_proposals_torch(biased, stat_max, stat_sum, temperature, tokens, slots,
                                     draft_probs)
    launch_write_proposals(wrap_triton, biased, stat_max, stat_sum, temperature,
                           tokens.contiguous(), slots, draft_probs)
