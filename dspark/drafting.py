"""Ancestral drafting of one block: position k is drawn from softmax((base_k + bias(d_{k-1})) / T),
where d_{k-1} is the token drawn before it (the anchor for k = 0), and that distribution is stored as
the position's proposal for verification.

Per position: the Markov bias (a cuBLAS GEMM through the head, or, for small batches, the head's
rank-r factor, whose product with W2 the step computes), the step op (the softmax statistics of the
biased logits; ops/gumbel_step.py), the pick op (the two-level Gumbel-max race of ops/gumbel_max.py:
the token, its proposal, the Markov embedding of the token for the next position;
ops/gumbel_pick.py). The biased logits are written out (float32) only when the step computes the
bias itself; otherwise the pick reads the base logits and the bias again. Static shapes and no host
sync: the block compiles with torch.compile(fullgraph=True) and is captured in a CUDA graph.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.markov import VanillaMarkov
from dspark.ops.gumbel_max import bias_in_step, position_logits, step_tiles
from dspark.ops.gumbel_pick import gumbel_pick
from dspark.ops.gumbel_step import gumbel_step, low_rank_bias


def ancestral_draft(logits: Tensor, hidden: Tensor | None, head: VanillaMarkov | None,
                    anchor: Tensor, temperature: Tensor, seed: Tensor, offset: Tensor,
                    slots: Tensor, draft_probs: Tensor, tiles: tuple[int, int] | None = None,
                    fuse_bias: bool | None = None) -> Tensor:
    """Draws a block and writes its proposals; returns the draft tokens [B, K] int64.

    logits [B, K, V] float32 | bfloat16: the drafter's base logits, left as they are (NaN rows are
    padding and draw from the bias alone); hidden [B, K, d]: the drafter's final hidden states (read
    by the gated and rnn heads); head: a Markov head, or None to draw the positions independently;
    anchor [B] int64: the token before position 0; temperature [B] float32 (0 = greedy: the argmax
    chain with one-hot proposals); seed, offset [B] int64: the Philox key and counter of each
    request's draft noise; slots [B] int64: each row's slot in draft_probs [S, K, V] float32.
    tiles: the step's (block_v, block_b): vocabulary tokens and batch rows per program (default:
    gumbel_max.step_tiles). fuse_bias: whether the step computes the Markov bias from the head's
    rank-r factor and W2, or a GEMM through the head writes each bias [B, V] before the step;
    default gumbel_max.bias_in_step(B).
    """
    batch, positions, vocab = logits.shape
    fuse_bias = head is not None and (bias_in_step(batch) if fuse_bias is None else fuse_bias)
    tiles = tiles or step_tiles(batch, low_rank=fuse_bias)
    biased = logits.new_empty((batch, positions, vocab), dtype=torch.float32) if fuse_bias else None
    tokens = logits.new_empty((batch, positions), dtype=torch.int64)

    table = prev = state = bias = w2 = None
    if head is not None:
        table = head.markov_w1.weight
        prev = head.markov_w1(anchor)
        state = head.initial_state(batch)
        w2 = head.markov_w2.weight if fuse_bias else None
    for k in range(positions):
        if head is not None:
            h = None if hidden is None else hidden[:, k]
            bias, state = head.low_rank(prev, h, state) if fuse_bias else head.bias(prev, h, state)
        units = gumbel_step(logits, bias, w2, temperature, k, biased, *tiles)
        source, added = (biased, None) if fuse_bias else (logits, bias)
        prev = gumbel_pick(*units, source, added, temperature, seed, offset, table, k, tokens, slots, draft_probs,
                           tiles[0])
    return tokens


def greedy_draft(logits: Tensor, hidden: Tensor | None, head: VanillaMarkov | None, anchor: Tensor) -> Tensor:
    """The argmax chain: position k takes argmax(base_k + bias(d_{k-1})), smallest id on ties, NaN
    logits counting as 0. These are the tokens ancestral_draft draws for greedy rows (on CUDA up to
    the rounding of the bias, which its kernels may keep in float32); a batch of
    greedy requests needs nothing more (no noise, no proposals: greedy verification reads none).

    logits [B, K, V]; hidden [B, K, d] or None; anchor [B] -> draft tokens [B, K] int64.
    """
    batch, positions, _ = logits.shape
    prev = state = None
    if head is not None:
        prev, state = head.markov_w1(anchor), head.initial_state(batch)
    tokens = []
    for k in range(positions):
        bias = None
        if head is not None:
            v, state = head.low_rank(prev, None if hidden is None else hidden[:, k], state)
            bias = low_rank_bias(v, head.markov_w2.weight)  # as the CPU's step adds it
        token = position_logits(logits, bias, k).argmax(dim=-1)
        if head is not None:
            prev = head.markov_w1(token)
        tokens.append(token)
    return torch.stack(tokens, dim=1)
