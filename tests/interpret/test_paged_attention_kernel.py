"""The paged-attention Triton kernels under TRITON_INTERPRET=1 against the op's torch implementation
(float32: the interpreter's bfloat16 arithmetic is wrong)."""
import pytest
import torch

from dspark.ops.paged_attention import paged_attention_torch
from dspark.ops.paged_attention_kernel import launch_paged_attention

INF = float("inf")


def random_case(lengths, kv_heads, groups, length, head_dim, block_size, window=None, seed=0):
    """A random pool and block table: rows 0 and 1 share their first block, the other blocks are
    distinct, the null block and columns past a row's blocks hold NaN / 0. Verification bounds, or
    with a window (0 for none) the drafter's context bounds."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    needed = [-(-n // block_size) for n in lengths]
    M = max(needed) + 1
    num_blocks = sum(needed) + 2
    k_pool, v_pool = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g) for _ in range(2))
    k_pool[:, 0], v_pool[:, 0] = float("nan"), float("nan")
    physical = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(B, M, dtype=torch.int32)
    for b, n in enumerate(needed):
        table[b, :n] = torch.tensor([physical.pop() for _ in range(n)], dtype=torch.int32)
    table[1, 0] = table[0, 0]
    q = torch.randn(B, kv_heads * groups, length, head_dim, generator=g)
    ends = torch.tensor(lengths)[:, None]
    if window is None:
        hi = ends - length + torch.arange(length) + 1
        lo = torch.zeros_like(hi)
    else:
        positions = ends + torch.arange(length)
        hi = ends.expand(-1, length)
        lo = (positions - window + 1).clamp(min=0) if window else torch.zeros_like(hi)
    return q, k_pool, v_pool, table, lo.contiguous(), hi.int().contiguous()


def check_kernel(case, splits, block_n=16, scale=0.3):
    o, lse = launch_paged_attention(lambda kernel: kernel, *case, scale, splits=splits, block_n=block_n)
    o_ref, lse_ref = paged_attention_torch(*case, scale)
    assert not o.isnan().any()
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    return lse


@pytest.mark.parametrize("splits", [1, 3])
def test_verification_ragged_rows(splits):
    case = random_case([37, 9, 21], kv_heads=2, groups=2, length=3, head_dim=16, block_size=4)
    check_kernel(case, splits)


@pytest.mark.parametrize("block_size, block_n", [(16, 16), (32, 16), (4, 32)])  # tiles within, across blocks
def test_block_sizes_and_grouped_heads(block_size, block_n):
    case = random_case([70, 33], kv_heads=1, groups=3, length=4, head_dim=20, block_size=block_size, seed=1)
    check_kernel(case, splits=2, block_n=block_n)


@pytest.mark.parametrize("window", [0, 3])
def test_drafter_context_with_queries_that_see_nothing(window):
    case = random_case([25, 0, 40], kv_heads=2, groups=1, length=4, head_dim=16, block_size=4, window=window)
    lse = check_kernel(case, splits=5)  # more splits than some rows have tiles
    assert (lse[1] == -INF).all()


def test_many_queries_take_several_row_tiles():
    case = random_case([50, 45], kv_heads=1, groups=2, length=40, head_dim=16, block_size=8, seed=2)
    check_kernel(case, splits=2)
