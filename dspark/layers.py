"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, the attention projections
(with Qwen3's per-head q/k norm), the SwiGLU MLP, the pre-norm decoder layer and the vocabulary
projection."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark.config import TargetConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]; normalise in float32 like HF, return in x's dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


# On CPU, torch's float32 GEMM takes a slow path for 2..7 rows (python -m bench.decode_cpu): pad to 8.
MIN_CPU_GEMM_ROWS = 8


def project_vocab(lm_head: nn.Linear, hidden: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """lm_head(hidden) in `dtype`: hidden [..., d] -> logits [..., V]. On CPU a product of 2..7 rows
    is padded to MIN_CPU_GEMM_ROWS rows (the extra rows are dropped)."""
    rows = hidden.shape[:-1].numel()
    if hidden.device.type == "cpu" and 1 < rows < MIN_CPU_GEMM_ROWS:
        flat = F.pad(hidden.reshape(rows, -1), (0, 0, 0, MIN_CPU_GEMM_ROWS - rows))
        return lm_head(flat)[:rows].view(*hidden.shape[:-1], -1).to(dtype)
    return lm_head(hidden).to(dtype)


def rope_inv_freq(config: TargetConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with Llama 3's frequency-dependent scaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if config.rope_type == "default":
        return inv_freq.float()
    scaling = config.rope_scaling  # llama3's (the config refuses other types)
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


class Rotary(nn.Module):
    """RoPE angles for positions. The frequencies stay float32 whatever the model is cast to:
    bfloat16 angles position * inv_freq are off by whole radians at long positions."""

    def __init__(self, config: TargetConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def reset(self, device: torch.device | str) -> None:
        """Recomputes the frequencies on `device` (after a model was built on the meta device)."""
        self.inv_freq = rope_inv_freq(self.config).to(device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.reset(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] int -> cos, sin: [B, T, head_dim] float32 (HF's half-split layout)
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos, sin: [B, T, D]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def packed_in_checkpoints(module: nn.Module, packed: str, parts: dict[str, int]) -> None:
    """Makes the Linear `module.<packed>`, whose output rows stack those of `parts` (name -> rows, in
    order), save and load as the separate Linears that HF checkpoints name (`q_proj.weight`, ...):
    state_dict() splits its weight and bias into views, load_state_dict() concatenates the parts."""
    names, rows = list(parts), list(parts.values())

    def split(module, state, prefix, local_metadata) -> None:
        for kind in ("weight", "bias"):
            key = f"{prefix}{packed}.{kind}"
            if key in state:
                for name, part in zip(names, state.pop(key).split(rows)):
                    state[f"{prefix}{name}.{kind}"] = part

    def join(module, state, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in names]
            present = [key in state for key in keys]
            if all(present):
                state[f"{prefix}{packed}.{kind}"] = torch.cat([state.pop(key) for key in keys])
            elif any(present):  # the packed tensor is missing too: name the parts that are
                missing_keys.extend(key for key, here in zip(keys, present) if not here)

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(join)


class AttentionProjections(nn.Module):
    """q/k/v/o projections, Qwen3's per-head q_norm / k_norm, and RoPE. The attention itself
    (which keys a query sees) belongs to the target and the drafter.

    q, k and v come from one GEMM over a packed weight (qkv_proj, vLLM's QKVParallelLinear): a
    decode step is a few rows, where each GEMM costs a launch more than its bytes. Checkpoints keep
    HF's q_proj / k_proj / v_proj (packed_in_checkpoints)."""

    def __init__(self, config: TargetConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size, self.kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else nn.Identity()
        packed_in_checkpoints(self, "qkv_proj", {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size})

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, hidden] -> q [B, num_heads, T, head_dim], k, v [B, num_kv_heads, T, head_dim]
        q, kv = self.qkv_proj(x).split([self.q_size, 2 * self.kv_size], dim=-1)
        q = apply_rope(self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))).transpose(1, 2), cos, sin)
        return (q, *self._rotated_keys_values(kv, cos, sin))

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, hidden] -> k, v: [B, num_kv_heads, T, head_dim], from the packed weight's k / v rows alone
        bias = self.qkv_proj.bias[self.q_size:] if self.qkv_proj.bias is not None else None
        return self._rotated_keys_values(F.linear(x, self.qkv_proj.weight[self.q_size:], bias), cos, sin)

    def _rotated_keys_values(self, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # kv: [B, T, 2 * num_kv_heads * head_dim] -> k (normed, rotated), v: [B, num_kv_heads, T, head_dim]
        k, v = kv.unflatten(-1, (2 * self.num_kv_heads, self.head_dim)).transpose(1, 2).chunk(2, dim=1)
        return apply_rope(self.k_norm(k), cos, sin), v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        # attn: [B, num_heads, T, head_dim] -> [B, T, hidden]
        return self.o_proj(attn.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    """The gated MLP, its gate and up projections one GEMM over a packed weight (gate_up_proj,
    vLLM's MergedColumnParallelLinear); checkpoints keep HF's gate_proj / up_proj."""

    def __init__(self, config: TargetConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        packed_in_checkpoints(self, "gate_up_proj", {"gate_proj": size, "up_proj": size})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer with HF's module names. Which keys a query sees belongs to the
    caller: `attend(q [B, H, T, D], k, v [B, H_kv, T, D]) -> [B, H, T, D]` gets this layer's own
    queries, keys and values and brings the rest (a KV cache, the drafter's injected context)."""

    def __init__(self, config: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = AttentionProjections(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        # x: [B, T, hidden]; cos, sin: [B, T, head_dim]
        h = self.input_layernorm(x)
        q, k, v = self.self_attn(h, cos, sin)
        x = x + self.self_attn.output(attend(q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))
