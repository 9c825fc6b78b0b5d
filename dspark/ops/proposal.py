"""The proposal op: after a draft block, writes q_k = softmax(biased_k / T) of every position into the
request's slot of `draft_probs`, the distribution the verifier divides by.

It reads the float32 biased logits and chunk statistics the step op (gumbel_max.py) left, merges the
statistics (M = max_j m_j, S = sum_j s_j exp(m_j - M)) and recomputes x = biased / T with the same
correctly rounded division the draw used, so the stored proposal is exactly the distribution each
token was drawn from. Greedy rows (T = 0) store a one-hot at their drawn token.
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
def _proposal_kernel(biased_ptr, chunk_max_ptr, chunk_sum_ptr, temperature_ptr, tokens_ptr,
                     slots_ptr, probs_ptr, vocab_size, num_positions, num_chunks,
                     probs_slot_stride, probs_pos_stride, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
    row_pos = tl.program_id(0).to(tl.int64)  # row * num_positions + k
    row = row_pos // num_positions
    k = row_pos % num_positions

    chunks = tl.arange(0, BLOCK_C)
    m = tl.load(chunk_max_ptr + row_pos * num_chunks + chunks, mask=chunks < num_chunks,
                other=float("-inf"))
    s = tl.load(chunk_sum_ptr + row_pos * num_chunks + chunks, mask=chunks < num_chunks, other=0.0)
    m_all = tl.max(m, 0)
    inv_sum = 1.0 / tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_all)), 0)

    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab_size
    biased = tl.load(biased_ptr + row_pos * vocab_size + tokens, mask=inside, other=0.0)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    x = tl.div_rn(biased, tl.broadcast_to(tl.where(greedy, 1.0, temperature), biased.shape))
    q = tl.exp(x - m_all) * inv_sum
    q = tl.where(greedy, (tokens == tl.load(tokens_ptr + row_pos)).to(tl.float32), q)
    slot = tl.load(slots_ptr + row)
    tl.store(probs_ptr + slot * probs_slot_stride + k * probs_pos_stride + tokens, q, mask=inside)


def launch_write_proposals(wrap, biased, chunk_max, chunk_sum, temperature, tokens, slots,
                           draft_probs):
    batch, positions, vocab = biased.shape
    chunks = chunk_max.shape[-1]
    wrap(_proposal_kernel)[(batch * positions, triton.cdiv(vocab, BLOCK_SIZE))](
        biased, chunk_max, chunk_sum, temperature, tokens, slots, draft_probs,
        vocab, positions, chunks, draft_probs.stride(0), draft_probs.stride(1),
        BLOCK_C=triton.next_power_of_2(chunks), BLOCK=BLOCK_SIZE, num_warps=8)


def write_proposals_torch(biased: Tensor, chunk_max: Tensor, chunk_sum: Tensor,
                          temperature: Tensor, tokens: Tensor, slots: Tensor,
                          draft_probs: Tensor) -> None:
    """The proposal op in plain torch (the CPU implementation)."""
    m_all = chunk_max.amax(-1, keepdim=True)
    total = torch.where(chunk_max == float("-inf"), 0.0, chunk_sum * torch.exp(chunk_max - m_all))
    inv_sum = 1.0 / total.sum(-1, keepdim=True)
    greedy = (temperature == 0)[:, None, None]
    x = biased / torch.where(greedy, 1.0, temperature[:, None, None])
    q = torch.exp(x - m_all) * inv_sum
    vocab = torch.arange(biased.shape[-1], device=biased.device)
    q = torch.where(greedy, (vocab == tokens[..., None]).float(), q)
    draft_probs.index_copy_(0, slots, q)


@triton_op("dspark::write_proposals", mutates_args=("draft_probs",))
def write_proposals(biased: Tensor, chunk_max: Tensor, chunk_sum: Tensor, temperature: Tensor,
                    tokens: Tensor, slots: Tensor, draft_probs: Tensor) -> None:
    """draft_probs[slots[b], k] = softmax(biased[b, k] / T[b]) for every draft position k.

    biased [B, K, V] float32 and chunk_max, chunk_sum [B, K, C] float32 as the step op wrote them;
    temperature [B] float32 (0 = greedy: one-hot at tokens[b, k]); tokens [B, K] int64 (the drawn
    drafts); slots [B] int64, distinct (padding rows need a slot of their own);
    draft_probs [S, K, V] float32, rows of other slots are left as they are.
    """
    batch, positions, vocab = biased.shape
    if biased.dtype != torch.float32 or not biased.is_contiguous():
        raise ValueError(f"biased must be contiguous float32 [B, K, V], got {biased.dtype}")
    for name, stats in (("chunk_max", chunk_max), ("chunk_sum", chunk_sum)):
        if stats.shape[:2] != (batch, positions) or stats.dim() != 3 or not stats.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{batch}, {positions}, C], "
                             f"got {tuple(stats.shape)}")
    if tokens.shape != (batch, positions) or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be [{batch}, {positions}] int64, got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    check_rows(batch, temperature=(temperature, torch.float32), slots=(slots, torch.int64))
    if (draft_probs.dim() != 3 or draft_probs.shape[1:] != (positions, vocab)
            or draft_probs.dtype != torch.float32 or draft_probs.stride(-1) != 1):
        raise ValueError(f"draft_probs must be float32 [S, {positions}, {vocab}], got "
                         f"{draft_probs.dtype} {tuple(draft_probs.shape)}")
    if biased.device.type == "cpu":
        return write_proposals_torch(biased, chunk_max, chunk_sum, temperature, tokens, slots,
                                     draft_probs)
    launch_write_proposals(wrap_triton, biased, chunk_max, chunk_sum, temperature,
                           tokens.contiguous(), slots, draft_probs)
