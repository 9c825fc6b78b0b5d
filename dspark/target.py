"""The target model: a Llama-family (SmolLM2, Llama 3) or Qwen3 decoder over a paged KV cache.

Module names follow HF's, so a checkpoint loads by name once its `model.` prefix is stripped.
One forward serves prefill chunks, decoding and verification: it writes the keys/values of the given
tokens where their request's block table says (dspark.kv_cache), and each query sees the cached keys
at positions up to its own. The decode step's shapes are static and nothing branches on tensor
values, so it compiles with `torch.compile(fullgraph=True)` and can be captured in a CUDA graph.
Without caches the forward is a plain causal forward over the given tokens (training, tests).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.config import TargetConfig
from dspark.kv_cache import CacheAccess, PagedKVCache
from dspark.layers import DecoderLayer, RMSNorm, Rotary, project_vocab


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention with grouped-query heads: the query heads that share a KV head run as extra query
    rows of that head, so K and V are used as they are (no repeated copies). `mask=None` is causal
    attention over the same T tokens (no mask to build: the fused kernels skip the masked blocks).

    q: [B, H, T, D]; k, v: [B, H_kv, S, D]; mask: [B or 1, 1, H / H_kv * T, S] bool (True = visible,
    rows ordered (group, t), as `grouped_mask` builds it) or None -> [B, H, T, D]
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    batch, num_heads, length, head_dim = q.shape
    q = q.reshape(batch, k.shape[1], -1, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(batch, num_heads, length, head_dim)


def grouped_mask(visible: torch.Tensor, groups: int) -> torch.Tensor:
    # visible: [B or 1, T, S] bool -> [B or 1, 1, groups * T, S], the mask `attend` takes
    return visible[:, None, None].expand(-1, 1, groups, -1, -1).flatten(2, 3)


def attend_gathered(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, positions: torch.Tensor,
                    length: int) -> torch.Tensor:
    """Attention of queries at `positions` over positions 0 .. length - 1 of their rows' blocks, each
    query up to its own, gathered contiguous for SDPA's fused kernels.
    q: [B, H, T, D]; block_table: [B, M]; positions: [B, T] -> [B, H, T, D]"""
    keys, values = cache.gather(block_table, length)  # [B, H_kv, S, D]
    keys.nan_to_num_(0.0, 0.0, 0.0), values.nan_to_num_(0.0, 0.0, 0.0)  # the unseen may hold NaN (the null block)
    visible = torch.arange(length, device=positions.device) <= positions[..., None]  # [B, T, S]
    return attend(q, keys, values, grouped_mask(visible, q.shape[1] // keys.shape[1]))


class TargetLayer(DecoderLayer):
    """A decoder layer with its paged KV cache (set by TargetModel.setup_caches)."""

    def __init__(self, config: TargetConfig):
        super().__init__(config)
        self.kv_cache: PagedKVCache | None = None
        self.scale = config.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                access: CacheAccess | None) -> torch.Tensor:
        # x: [B, T, hidden]; cos, sin: [B, T, head_dim]; positions: [B, T]
        def attend_cached(q, k, v):
            if access is None:
                return attend(q, k, v, None)
            self.kv_cache.write(access.slots, k, v)
            if access.length is None:
                return self.kv_cache.attend(q, access, self.scale)[0]
            return attend_gathered(q, self.kv_cache, access.block_table, positions, access.length)

        return super().forward(x, cos, sin, attend_cached)


class TargetModel(nn.Module):
    """The model being served. `forward` returns float32 logits and, on request, the raw outputs
    of chosen decoder layers (the drafter's context features)."""

    def __init__(self, config: TargetConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config)
        self.kv_block_size: int | None = None  # the caches' block size, while they are set up

    def setup_caches(self, num_blocks: int, block_size: int) -> None:
        """Allocates a paged KV cache per layer (num_blocks blocks of block_size positions) in the
        model's dtype and device; forwards given a block table write to it and read from it."""
        for layer in self.layers:
            layer.kv_cache = PagedKVCache.for_model(self.config, num_blocks, block_size, self.embed_tokens.weight)
        self.kv_block_size = block_size

    def drop_caches(self) -> None:
        """Frees the KV caches; forwards are plain causal forwards over the given tokens again."""
        for layer in self.layers:
            layer.kv_cache = None
        self.kv_block_size = None

    def cache_access(self, block_table: torch.Tensor, positions: torch.Tensor, length: int | None) -> CacheAccess:
        """How tokens at `positions` [B, T] use the cache: each query sees the positions up to its
        own, read through the paged op (length None) or gathered (a prefill chunk; `length` = the
        positions its rows hold, this chunk's included). On the CPU the decode step's reads are
        gathered too, over the table's width: SDPA's fused CPU kernel, with no log-sum-exp to return
        (the target uses none), is faster there than the op's plain-torch implementation
        (bench.attention, run on a CPU)."""
        if length is None and block_table.device.type == "cpu":
            length = block_table.shape[1] * self.kv_block_size
        if length is not None:
            return CacheAccess.gathered(block_table, positions, self.kv_block_size, length)
        return CacheAccess.paged(block_table, positions, self.kv_block_size, torch.zeros_like(positions), positions + 1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor | None = None,
                length: int | None = None, hidden_layer_ids: Sequence[int] = (), logits_at: torch.Tensor | None = None,
                logits_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions: [B, T] long; block_table: [B, M] int32, the rows' blocks;
        length: for a prefill chunk, the positions its rows hold (see cache_access);
        logits_at: [B, P] long indices into the T tokens whose logits are wanted (default: all T).

        Without a block table this is a causal forward over `tokens`. With one, the tokens' keys and
        values are written at their positions in the cache and each query sees the cached keys at
        positions <= its own. Returns logits [B, T or P, vocab] in `logits_dtype` (training asks for the
        model's dtype: the product's own precision, half the bytes of float32) and the outputs of
        decoder layers `hidden_layer_ids` (-1 = the embeddings) concatenated: [B, T, len(ids) *
        hidden] in the model's dtype, or None when no ids are asked for.
        """
        for i in hidden_layer_ids:
            if not -1 <= i < len(self.layers):
                raise ValueError(f"hidden layer id {i} is out of range [-1, {len(self.layers) - 1}]")
        access = None if block_table is None else self.cache_access(block_table, positions, length)
        cos, sin = self.rotary(positions)

        x = self.embed_tokens(tokens)
        hidden = {-1: x} if -1 in hidden_layer_ids else {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, access)
            if i in hidden_layer_ids:
                hidden[i] = x
        if logits_at is not None:  # the vocabulary projection only where it is used
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        logits = project_vocab(self.lm_head, self.norm(x), logits_dtype)
        if not hidden_layer_ids:
            return logits, None
        return logits, torch.cat([hidden[i] for i in hidden_layer_ids], dim=-1)
