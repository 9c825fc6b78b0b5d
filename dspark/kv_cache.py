"""Paged KV caches: one pool of fixed-size blocks per layer, shared by every request.

A request's keys and values live in the blocks its block table lists: position p in block
`block_table[p // block_size]` at offset `p % block_size` (dspark.ops.paged_attention's layout).
The target's caches and the drafter's context caches have the same number of blocks and one block
table per request, so a block id names the same positions in both. Which blocks a request holds is
the engine's business (dspark.engine.kv_blocks); the models only write where the table says and read
what it lists.

A forward reads the cache one of two ways (`CacheAccess`):
- paged: the `dspark::paged_attention` op reads, per query, the keys at positions [lo, hi) through
  the block table: the decode step's K + 1 verified tokens and the drafter's block, inside CUDA graphs
  (static shapes; the op's CUDA kernel reads only the blocks a row holds);
- gathered: a prompt chunk's queries see positions 0 .. length - 1 (causal by position), gathered
  from the table into a contiguous [B, H_kv, length, D] for SDPA's fused kernels. The host knows
  `length`; a chunk has hundreds of queries, which the decode-shaped op is not built for. On the CPU
  the target's decode step reads this way too (dspark.target.TargetModel.cache_access says why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

import dspark.ops.paged_attention  # noqa: F401  (registers torch.ops.dspark.paged_attention)
from dspark.ops.paged_attention import slot_ids, write_kv

KV_BLOCK_SIZE = 16  # positions per block: vLLM's default; the op's kernel is built for 16 and 32
DEFAULT_KV_CACHE_GIB = 1.0  # the KV cache off CUDA when no size is given


@dataclass
class CacheAccess:
    """Where one forward's tokens write their keys and values, and which keys their queries read."""
    block_table: torch.Tensor  # [B, M] int32
    slots: torch.Tensor | None = None  # [B, T] int64: the tokens' flat slots in the pools (None: reads only)
    lo: torch.Tensor | None = None  # [B, T]: paged reads see positions lo <= p < hi
    hi: torch.Tensor | None = None
    length: int | None = None  # gathered reads: positions 0 .. length - 1, each query up to its own

    @classmethod
    def paged(cls, block_table: torch.Tensor, positions: torch.Tensor, block_size: int, lo: torch.Tensor,
              hi: torch.Tensor) -> CacheAccess:
        return cls(block_table, slot_ids(block_table, positions, block_size), lo=lo, hi=hi)

    @classmethod
    def gathered(cls, block_table: torch.Tensor, positions: torch.Tensor, block_size: int, length: int) -> CacheAccess:
        return cls(block_table, slot_ids(block_table, positions, block_size), length=length)


def contiguous_block_table(lengths: Sequence[int], block_size: int = KV_BLOCK_SIZE) -> tuple[int, torch.Tensor]:
    """Blocks for rows that hold lengths[i] positions each, consecutive and a row's own, after the
    null block -> (the blocks a pool needs, block table [n, max blocks] int32, zeros past a row's own)."""
    blocks = torch.tensor([-(-n // block_size) for n in lengths])
    first = 1 + blocks.cumsum(0) - blocks  # row i's blocks: first[i] .. first[i] + blocks[i] - 1
    column = torch.arange(int(blocks.max()))
    table = torch.where(column < blocks[:, None], first[:, None] + column, 0).to(torch.int32)
    return 1 + int(blocks.sum()), table


def kv_block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """The memory one block takes over every layer of a model (a TargetConfig or DrafterConfig),
    keys and values."""
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * dtype.itemsize


def kv_cache_blocks(target: nn.Module, drafter: nn.Module | None, block_size: int,
                    gpu_memory_utilization: float = 0.9, kv_cache_memory: float | None = None) -> int:
    """How many blocks of the target's KV cache and the drafter's context cache fit the memory they
    may take: `kv_cache_memory` GiB if given (off CUDA, DEFAULT_KV_CACHE_GIB by default), else on
    CUDA what is free of the card's `gpu_memory_utilization` share once the models are loaded."""
    weight = target.embed_tokens.weight
    block_bytes = kv_block_bytes(target.config, block_size, weight.dtype)
    if drafter is not None:
        block_bytes += kv_block_bytes(drafter.config, block_size, weight.dtype)
    if weight.device.type == "cuda" and kv_cache_memory is None:
        free, total = torch.cuda.mem_get_info(weight.device)
        budget = free - (1.0 - gpu_memory_utilization) * total
    else:
        budget = (DEFAULT_KV_CACHE_GIB if kv_cache_memory is None else kv_cache_memory) * 2**30
    return max(int(budget // block_bytes), 0)


class PagedKVCache(nn.Module):
    """One layer's pools, in buffers so that compiled steps and CUDA graphs update them in place."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.block_size = block_size
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.register_buffer("k_pool", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_pool", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, weight: torch.Tensor) -> PagedKVCache:
        """A layer's pools for a model of this config (a TargetConfig or DrafterConfig), in the dtype
        and on the device of its `weight`."""
        return cls(num_blocks, block_size, config.num_key_value_heads, config.head_dim, weight.dtype, weight.device)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [B, T]; k, v: [B, H_kv, T, D]
        write_kv(self.k_pool, self.v_pool, slots.flatten(), k.transpose(1, 2).flatten(0, 1),
                 v.transpose(1, 2).flatten(0, 1))

    def attend(self, q: torch.Tensor, access: CacheAccess, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [B, H, T, D] -> o [B, H, T, D], lse [B, H, T] float32 (see dspark.ops.paged_attention)
        return torch.ops.dspark.paged_attention(q, self.k_pool, self.v_pool, access.block_table, access.lo,
                                                access.hi, scale)

    def gather(self, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # block_table: [B, M] -> k, v [B, H_kv, length, D]: positions 0 .. length - 1, contiguous copies
        blocks = block_table[:, :-(-length // self.block_size)]
        rows, held = blocks.shape
        index = blocks.flatten().long()

        def read(pool: torch.Tensor) -> torch.Tensor:
            # (each block one row of the index_select: on the CPU far faster than pool[:, blocks] or an
            # index_select over the pool's block dim, which copy elementwise)
            kv = pool.flatten(2).index_select(1, index).view(pool.shape[0], rows, held * self.block_size, -1)
            return kv.transpose(0, 1)[:, :, :length].contiguous()
        return read(self.k_pool), read(self.v_pool)
