"""Paged caches for the model tests: every row's blocks scattered over the pool in a random order,
so that a forward that read a row's positions from anywhere but its block table would differ."""
import torch

from dspark.kv_cache import contiguous_block_table


def paged_caches(model, lengths, block_size=4, seed=0):
    """Sets up the model's (a TargetModel's or DSparkDrafter's) caches for rows of `lengths`
    positions, with 3 blocks no row holds -> block table [n, M] int32."""
    num_blocks, table = contiguous_block_table(lengths, block_size)
    model.setup_caches(num_blocks + 3, block_size)
    order = torch.cat([torch.zeros(1, dtype=torch.long),
                       1 + torch.randperm(num_blocks + 2, generator=torch.Generator().manual_seed(seed))])
    return order[table.long()].to(torch.int32)
