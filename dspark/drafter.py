"""The DSpark drafter: a few Qwen3-style layers that draft a block of K tokens in one parallel forward.

Module and tensor names follow DeepSpec's `Qwen3DSparkModel`, so its checkpoints load by name.

- Context features. The target's chosen layer outputs, concatenated, are fused once into
  H_ctx = hidden_norm(fc(features)). Every layer projects the same H_ctx with its own k_proj / v_proj
  (+ k_norm, RoPE at the tokens' absolute positions), without its input_layernorm ("KV injection").
  These keys and values are computed once per context token and kept in a per-layer cache.
- The block. Inputs [anchor, mask x (K-1)] at positions start .. start+K-1; slot k predicts the token
  at start+k+1 (the anchor is the first prediction slot). Queries come only from the block. A block
  sees its own keys in both directions and the context strictly before `start`: the anchor's own
  target features only arrive with the next verification.
- Optional two-sided sliding window W (flash-attention's non-causal window (W-1, W-1)): the query at
  position p sees keys at positions p-W+1 .. p+W-1 among those above.

At inference the block attention is two partial attentions over disjoint key sets, the context (read
from the paged context cache by `dspark::paged_attention`, only the positions a query sees: with a
window, the W-1 before the block) and the block's own keys, joined with dspark::lse_merge. Training
(`forward_train`) runs many blocks per sequence through one SDPA with DeepSpec's block mask.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import dspark.ops.lse_merge  # noqa: F401  (registers torch.ops.dspark.lse_merge)
from dspark.config import DrafterConfig
from dspark.kv_cache import CacheAccess, PagedKVCache
from dspark.layers import DecoderLayer, RMSNorm, Rotary, project_vocab
from dspark.markov import build_markov_head
from dspark.ops.paged_attention import slot_ids


def context_visible(key_pos: torch.Tensor, query_pos: torch.Tensor, block_start: torch.Tensor,
                    window: int | None) -> torch.Tensor:
    """Which context keys each block query sees: positions in [0, block start), and within the
    window of the query if there is one.

    key_pos: [B or 1, S]; query_pos, block_start: [B, T] (or broadcastable) -> [B, T, S] bool
    """
    key_pos, query_pos = key_pos[:, None, :], query_pos[..., None]
    visible = (key_pos >= 0) & (key_pos < block_start[..., None])
    if window is not None:
        visible = visible & (query_pos - key_pos < window)
    return visible


def block_visible(block_size: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which keys of its own block a block query sees: all of them, or those within the window."""
    if window is None:
        return None
    offset = torch.arange(block_size, device=device)
    return ((offset[:, None] - offset[None, :]).abs() < window)[None]


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over the visible keys, and its natural-log log-sum-exp. A query that
    sees no key gets o = 0 and lse = -inf. Query heads sharing a KV head are folded into extra rows.

    q: [B, H, T, D]; k, v: [B, H_kv, S, D]; visible: [B or 1, T, S] bool or None (all)
    -> o [B, H, T, D] in v's dtype, lse [B, H, T] float32
    """
    batch, num_heads, length, head_dim = q.shape
    num_kv_heads, keys = k.shape[1], k.shape[2]
    groups = num_heads // num_kv_heads
    q = q.reshape(batch, num_kv_heads, groups * length, head_dim)
    scores = (q @ k.transpose(-1, -2)).float().view(batch, num_kv_heads, groups, length, keys) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    o = probs.to(v.dtype).view(batch, num_kv_heads, groups * length, keys) @ v
    return o.view(batch, num_heads, length, head_dim), lse.view(batch, num_heads, length)


def merged_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context: PagedKVCache,
                           access: CacheAccess, block_visible: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Inference attention of one block: over the cached context keys its queries see (`access`)
    and over the block's own keys, merged by log-sum-exp.

    q: [B, H, K, D]; k, v: [B, H_kv, K, D] (the block's); block_visible: [1, K, K] or None -> [B, H, K, D]
    """
    batch, num_heads, length, head_dim = q.shape
    o_ctx, lse_ctx = context.attend(q, access, scale)
    o_blk, lse_blk = partial_attention(q, k, v, block_visible, scale)

    def tokens_first(x: torch.Tensor) -> torch.Tensor:  # [B, H, K, ...] -> [B*K, H, ...]
        return x.transpose(1, 2).reshape(batch * length, num_heads, *x.shape[3:])

    o, _ = torch.ops.dspark.lse_merge(tokens_first(o_ctx), tokens_first(lse_ctx),
                                      tokens_first(o_blk), tokens_first(lse_blk))
    return o.view(batch, length, num_heads, head_dim).transpose(1, 2)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context_k: torch.Tensor,
                     context_v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Training attention: one SDPA over [context | all blocks] with a boolean mask.

    q: [B, H, T, D]; k, v: [B, H_kv, T, D]; context_k, context_v: [B, H_kv, S, D];
    visible: [B, T, S + T] -> [B, H, T, D]
    """
    keys, values = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None], scale=scale,
                                          enable_gqa=True)


class DrafterLayer(DecoderLayer):
    """A Qwen3 decoder layer whose queries attend over the block's keys and the injected
    context's (which `attend` brings, from the context cache or computed)."""

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        self.context_cache: PagedKVCache | None = None


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k ; W1[x_{k-1}]])), or sigmoid(proj(h_k)) without the Markov input: the
    chance that draft k survives verification given that all drafts before it did (DeepSpec's
    AcceptRatePredictor). Returns the logit."""

    def __init__(self, hidden_size: int, markov_rank: int):
        super().__init__()
        self.markov_rank = markov_rank
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        # hidden: [B, K, hidden]; prev_embedding: [B, K, markov_rank] or None -> [B, K]
        if self.markov_rank:
            if prev_embedding is None:
                raise ValueError("this confidence head reads [hidden ; markov_w1[prev]]: pass prev_embedding")
            hidden = torch.cat([hidden, prev_embedding], dim=-1)
        return self.proj(hidden).squeeze(-1)


class DSparkDrafter(nn.Module):
    """DSpark drafter. `embed_tokens` / `lm_head` are the target's when given (shared, not copied);
    otherwise the drafter makes its own, for a checkpoint to fill."""

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Embedding | None = None,
                 lm_head: nn.Linear | None = None):
        super().__init__()
        if config.sliding_window is not None and config.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {config.sliding_window}")
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.shared_modules = {name for name, m in (("embed_tokens", embed_tokens), ("lm_head", lm_head))
                               if m is not None}
        self.embed_tokens = nn.Embedding(config.vocab_size, d) if embed_tokens is None else embed_tokens
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False) if lm_head is None else lm_head
        self.markov_head = build_markov_head(config)
        markov_input = config.markov_rank if config.confidence_head_with_markov else 0  # rank 0: no head
        self.confidence_head = ConfidenceHead(d, markov_input) if config.enable_confidence_head else None
        self.rotary = Rotary(config)
        self.scale = config.head_dim ** -0.5
        self.kv_block_size: int | None = None  # the context caches' block size, while they are set up

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def setup_caches(self, num_blocks: int, block_size: int) -> None:
        """Allocates each layer's paged context cache (the target's block count and size: the
        request's one block table serves both) in the drafter's dtype and device."""
        for layer in self.layers:
            layer.context_cache = PagedKVCache.for_model(self.config, num_blocks, block_size, self.fc.weight)
        self.kv_block_size = block_size

    def drop_caches(self) -> None:
        """Frees the context caches (drafting needs setup_caches again)."""
        for layer in self.layers:
            layer.context_cache = None
        self.kv_block_size = None

    def _check_caches(self) -> None:
        if self.kv_block_size is None:
            raise RuntimeError("the drafter has no context cache: call setup_caches first")

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        # features: [B, T, m * hidden] target layer outputs -> H_ctx [B, T, hidden]
        return self.hidden_norm(self.fc(features))

    def append_context(self, features: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor) -> None:
        """Writes the context keys/values of every layer for these tokens at their positions.

        features: [B, T, m * hidden]; positions: [B, T]; block_table: [B, M] the rows' blocks.
        Positions at or after a later block's `start` are masked out of that block, so a caller may
        write a fixed-width chunk of which only a prefix is verified; those slots get rewritten.
        """
        self._check_caches()
        context = self.fuse_context(features)
        cos, sin = self.rotary(positions)
        slots = slot_ids(block_table, positions, self.kv_block_size)
        for layer in self.layers:
            k, v = layer.self_attn.keys_values(context, cos, sin)
            layer.context_cache.write(slots, k, v)

    def forward_block(self, anchor: torch.Tensor, start: torch.Tensor,
                      block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts one block per row: inputs [anchor, mask x (K-1)] at positions start .. start+K-1
        over the cached context at positions < start (with a window W, only those within W-1 of the
        query: positions >= query - W + 1).

        anchor, start: [B] long; block_table: [B, M] the rows' blocks
        -> base logits [B, K, vocab] float32 (slot k predicts the token at start+k+1) and the
        final-norm hidden states [B, K, hidden] that the Markov and confidence heads read.
        """
        self._check_caches()
        c, K = self.config, self.block_size
        batch, device = anchor.shape[0], anchor.device
        tokens = torch.cat([anchor[:, None], anchor.new_full((batch, K - 1), c.mask_token_id)], dim=1)
        positions = start[:, None] + torch.arange(K, device=device)
        cos, sin = self.rotary(positions)
        hi = start[:, None].expand(batch, K)
        lo = torch.zeros_like(positions) if c.sliding_window is None else (positions - c.sliding_window + 1).clamp_min(0)
        access = CacheAccess(block_table, lo=lo, hi=hi)  # reads only
        visible_in_block = block_visible(K, c.sliding_window, device)

        x = self.embed_tokens(tokens)
        for layer in self.layers:
            attend = partial(merged_block_attention, context=layer.context_cache, access=access,
                             block_visible=visible_in_block, scale=self.scale)
            x = layer(x, cos, sin, attend)
        hidden = self.norm(x)
        return project_vocab(self.lm_head, hidden), hidden

    def forward_train(self, features: torch.Tensor, tokens: torch.Tensor,
                      anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts N blocks per sequence in one forward, for training: block n is
        [tokens[anchors[n]], mask x (K-1)] at positions anchors[n] .. anchors[n]+K-1, and sees the
        context before its anchor and its own slots, never another block (DeepSpec's block mask).

        features: [B, S, m * hidden] target features of positions 0..S-1; tokens: [B, S];
        anchors: [B, N] positions in [0, S) -> logits [B, N, K, vocab] in the compute dtype (bfloat16
        under autocast: the loss upcasts them where it reads them, so no float32 copy is made),
        hidden [B, N, K, hidden]
        """
        c, K = self.config, self.block_size
        (batch, length), num_blocks, device = tokens.shape, anchors.shape[1], tokens.device
        context = self.fuse_context(features)
        context_pos = torch.arange(length, device=device).expand(batch, length)
        context_cos, context_sin = self.rotary(context_pos)

        block_tokens = tokens.new_full((batch, num_blocks, K), c.mask_token_id)
        block_tokens[:, :, 0] = tokens.gather(1, anchors)
        offsets = torch.arange(K, device=device)
        positions = (anchors[..., None] + offsets).flatten(1)  # [B, N*K]
        cos, sin = self.rotary(positions)

        block_start = anchors.repeat_interleave(K, dim=1)
        to_context = context_visible(context_pos, positions, block_start, c.sliding_window)
        block_id = torch.arange(num_blocks, device=device).repeat_interleave(K)
        to_blocks = (block_id[:, None] == block_id[None, :])[None]  # [1, N*K, N*K]
        if c.sliding_window is not None:
            to_blocks = to_blocks & block_visible(K, c.sliding_window, device).repeat(1, num_blocks, num_blocks)
        visible = torch.cat([to_context, to_blocks.expand(batch, -1, -1)], dim=-1)

        x = self.embed_tokens(block_tokens.flatten(1))
        for layer in self.layers:
            context_k, context_v = layer.self_attn.keys_values(context, context_cos, context_sin)
            attend = partial(masked_attention, context_k=context_k, context_v=context_v, visible=visible,
                             scale=self.scale)
            x = layer(x, cos, sin, attend)
        hidden = self.norm(x).view(batch, num_blocks, K, -1)
        return self.lm_head(hidden), hidden

    def teacher_forced_bias(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """The Markov head's bias of forward_train's blocks, each slot's from the true token before
        it: prev [B, N, K] tokens, hidden [B, N, K, d] -> [B, N, K, V]; None without a head (rank 0)."""
        if self.markov_head is None:
            return None
        return self.markov_head(prev.flatten(0, 1), hidden.flatten(0, 1)).unflatten(0, prev.shape[:2])

    def confidence(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None = None) -> torch.Tensor:
        """Confidence logits [B, K] from hidden [B, K, hidden] and, for a head trained with the Markov
        input, prev_embedding [B, K, rank] = markov_w1[token before each slot]."""
        if self.confidence_head is None:
            raise RuntimeError("this drafter has no confidence head (enable_confidence_head is false)")
        return self.confidence_head(hidden, prev_embedding)
