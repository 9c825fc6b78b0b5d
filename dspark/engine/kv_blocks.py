"""The KV cache's blocks: which request holds which block, and the prefix cache over them.

The models keep one pool of `num_blocks` blocks of `block_size` positions per layer (the target's
keys and values and the drafter's injected context share the block ids, so one block table serves
both). This module only does the bookkeeping on the host, as vLLM's block pool does:

- Block 0 is the null block: never handed out. Rows of a batch that no request uses point their
  block tables at it, so the step may write and read there harmlessly.
- A block is held by the requests whose table lists it (`refs`); one shared by a cached prefix is
  held by several. A block no request holds is free.
- Automatic prefix caching: a full block whose positions all hold computed keys is keyed by a hash
  of its tokens and of the key of the block before it (so a key names the whole prefix up to the
  block's end). A new request looks its prompt's full blocks up by key and holds every cached one it
  finds, in order, until the first miss. A freed block keeps its key and its contents until the
  block is handed out again: free blocks are handed out least recently freed first (LRU), so the
  blocks of a conversation's last turn survive the longest.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence

NULL_BLOCK = 0


def block_keys(tokens: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The prefix-cache keys of the full blocks of `tokens`, in order: each the SHA-256 of the key
    before it and the block's token ids (a collision would serve another prefix's keys: a 64-bit
    hash is not enough at scale, as vLLM found)."""
    keys = []
    for begin in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", tokens[begin:begin + block_size]).tobytes()).digest()
        keys.append(parent)
    return keys


class BlockPool:
    """Block ids 1 .. num_blocks - 1, their holders' counts and the prefix cache's keys."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refs = [0] * num_blocks
        self.key_of: dict[int, bytes] = {}  # block -> its key, while its contents are that prefix's
        self.cached: dict[bytes, int] = {}  # key -> block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))  # LRU first

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """The share of the blocks requests hold (the null block left out)."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def blocks_for(self, positions: int) -> int:
        """How many blocks hold `positions` positions."""
        return -(-positions // self.block_size)

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (not held by this call)."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def hold(self, blocks: Sequence[int]) -> None:
        """Holds cached blocks for one more request (a free one leaves the free list)."""
        for block in blocks:
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks for one request, least recently freed first (their old keys evicted);
        raises MemoryError when fewer than n are free (callers check num_free first)."""
        if n > len(self.free):
            raise MemoryError(f"{n} KV blocks asked for, {len(self.free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            key = self.key_of.pop(block, None)
            if key is not None and self.cached.get(key) == block:
                del self.cached[key]
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Lets go of a request's blocks; those no request holds any more become free, last in the
        LRU order (a request's later blocks are released first, so its prefix outlives its tail)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def register(self, block: int, key: bytes) -> None:
        """Keys a block that has just become full of computed positions. A prefix cached already
        under another block keeps that block (this one is never looked up)."""
        if self.enable_prefix_caching and key not in self.cached:
            self.cached[key] = block
            self.key_of[block] = key
