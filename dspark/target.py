"""The target model: a Llama-family (SmolLM2, Llama 3) or Qwen3 decoder with a static KV cache.

Module names follow HF's, so a checkpoint loads by name once its `model.` prefix is stripped.
One forward serves prefill, decoding and verification: it writes the keys/values of the given
tokens at their (row, position) in the cache, and each query sees the cached keys at positions up
to its own. Shapes are static and nothing branches on tensor values, so the forward compiles with
`torch.compile(fullgraph=True)` and can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.config import TargetConfig
from dspark.layers import DecoderLayer, RMSNorm, Rotary, project_vocab


class KVCache(nn.Module):
    """Keys and values of one layer for `max_batch_size` sequences of up to `max_seq_len` tokens,
    held in buffers so that compiled steps and CUDA graphs update them in place."""

    def __init__(self, max_batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        shape = (max_batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, rows: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # rows: [B] cache rows, or None for rows 0..B-1; positions: [B, T]; k, v: [B, num_kv_heads, T, head_dim]
        index = (torch.arange(positions.shape[0], device=positions.device) if rows is None else rows)[:, None]
        self.k_cache[index, :, positions] = k.transpose(1, 2)
        self.v_cache[index, :, positions] = v.transpose(1, 2)

    def read(self, rows: torch.Tensor | None, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        # rows: [B] or None for rows 0..batch-1 (a view, no copy) -> k, v: [B, num_kv_heads, max_seq_len, head_dim]
        if rows is None:
            return self.k_cache[:batch], self.v_cache[:batch]
        return self.k_cache[rows], self.v_cache[rows]

    def update(self, rows: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Writes these tokens' keys and values, then returns all of their rows' (see read)."""
        self.write(rows, positions, k, v)
        return self.read(rows, positions.shape[0])


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


class TargetLayer(DecoderLayer):
    """A decoder layer with its static KV cache (set by TargetModel.setup_caches)."""

    def __init__(self, config: TargetConfig):
        super().__init__(config)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        # x: [B, T, hidden]; cos, sin: [B, T, head_dim]; mask: see attend; positions: [B, T]
        def attend_cached(q, k, v):
            if self.kv_cache is not None:
                k, v = self.kv_cache.update(rows, positions, k, v)
            return attend(q, k, v, mask)

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
        self.max_seq_len: int | None = None

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocates a KV cache per layer in the model's dtype and device; later forwards write to it."""
        weight = self.embed_tokens.weight
        c = self.config
        for layer in self.layers:
            layer.kv_cache = KVCache(max_batch_size, c.num_key_value_heads, max_seq_len, c.head_dim,
                                     weight.dtype, weight.device)
        self.max_seq_len = max_seq_len

    def drop_caches(self) -> None:
        """Frees the KV caches; forwards are plain causal forwards over the given tokens again."""
        for layer in self.layers:
            layer.kv_cache = None
        self.max_seq_len = None

    def attention_mask(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The mask `attend` takes for tokens at `positions` [B, T]: with caches, each query sees the
        cached keys at positions <= its own; without, None (causal attention over the tokens)."""
        if self.max_seq_len is None:
            return None
        cached = torch.arange(self.max_seq_len, device=positions.device)
        visible = cached[None, None, :] <= positions[:, :, None]
        return grouped_mask(visible, self.config.num_attention_heads // self.config.num_key_value_heads)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None,
                hidden_layer_ids: Sequence[int] = (), logits_at: torch.Tensor | None = None,
                logits_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions: [B, T] long; rows: [B] long cache rows (default 0..B-1);
        logits_at: [B, P] long indices into the T tokens whose logits are wanted (default: all T).

        Without caches this is a causal forward over `tokens`. With caches, the tokens' keys and
        values are written at (rows, positions) and each query sees the cached keys at positions
        <= its own. Returns logits [B, T or P, vocab] in `logits_dtype` (training asks for the
        model's dtype: the product's own precision, half the bytes of float32) and the outputs of
        decoder layers `hidden_layer_ids` (-1 = the embeddings) concatenated: [B, T, len(ids) *
        hidden] in the model's dtype, or None when no ids are asked for.
        """
        for i in hidden_layer_ids:
            if not -1 <= i < len(self.layers):
                raise ValueError(f"hidden layer id {i} is out of range [-1, {len(self.layers) - 1}]")
        mask = self.attention_mask(positions)
        cos, sin = self.rotary(positions)

        x = self.embed_tokens(tokens)
        hidden = {-1: x} if -1 in hidden_layer_ids else {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, positions, rows)
            if i in hidden_layer_ids:
                hidden[i] = x
        if logits_at is not None:  # the vocabulary projection only where it is used
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        logits = project_vocab(self.lm_head, self.norm(x), logits_dtype)
        if not hidden_layer_ids:
            return logits, None
        return logits, torch.cat([hidden[i] for i in hidden_layer_ids], dim=-1)
