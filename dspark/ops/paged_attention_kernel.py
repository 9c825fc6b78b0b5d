"""The CUDA path of dspark::paged_attention (paged_attention.py): a decode/verify-shaped Triton kernel
over the paged KV pool, its split-KV merge, and the tiling policy.

Grid (row b, KV head x row tile, split). A program takes the query rows that share its KV head, the
T * (H / H_kv) pairs (t, g) ordered t-major, up to MAX_ROWS of them as one tile (padded to a power of
two, at least 16 for tl.dot), and runs an online softmax over keys in tiles of `block_n` positions. It
reads the lo / hi bounds of its rows, takes the tiles that overlap [min lo, max hi) (the positions the
rows can see: nothing of the row's table beyond them is read, and no key outside them is loaded), and
of these the share of its split: the tiles are divided evenly among the splits at run time, so the
grid depends only on shapes (CUDA graphs) while the work follows each row's actual context. Each key
position finds its block in the row's block table, so a tile may span several blocks or part of one.

With one split the program writes o and lse itself; with several it writes float32 partials, which a
second kernel merges by log-sum-exp (flash-decoding). Scores are taken in base 2 (scale * log2(e));
lse is returned in natural log. A row that sees no key gets o = 0, lse = -inf. float32 inputs use
IEEE float32 products (not TF32).
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

MAX_ROWS = 64  # query rows (t, g) per program; more rows take more row tiles
BLOCK_N = 64  # key positions per iteration
MIN_SPLIT_TOKENS = 256  # the pool's maximum context per split, at least
MAX_SPLITS = 64


if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def _loop_bound(x):
        # The interpreter holds a scalar as a 1-element numpy array, which numpy >= 2.4 does not
        # convert to an int: a loop bound computed at run time is handed over as a Python int.
        return int(x.handle.data.item())
else:
    @triton.jit
    def _loop_bound(x):
        return x


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lo_ptr, hi_ptr, o_ptr, lse_ptr,
                            stride_qb, stride_qh, stride_qt, stride_qd,
                            H, T, M, num_pool_blocks, num_splits, qk_scale, G: tl.constexpr, D: tl.constexpr,
                            ROW_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // ROW_TILES
    split = tl.program_id(2)

    r = (tl.program_id(1) % ROW_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
    t, g = r // G, r % G
    is_row = r < G * T
    h = kv_head * G + g
    d = tl.arange(0, BLOCK_D)
    is_d = d < D

    # The keys each row sees, [lo, hi) clipped to the table, and the tiles this split reads.
    lo = tl.maximum(tl.load(lo_ptr + b * T + t, mask=is_row, other=0).to(tl.int32), 0)
    hi = tl.minimum(tl.load(hi_ptr + b * T + t, mask=is_row, other=0).to(tl.int32), M * BLOCK_SIZE)
    sees = is_row & (lo < hi)
    start = tl.min(tl.where(sees, lo, M * BLOCK_SIZE), axis=0)
    end = tl.max(tl.where(sees, hi, 0), axis=0)
    first_tile = start // BLOCK_N
    num_tiles = tl.maximum(tl.cdiv(end, BLOCK_N) - first_tile, 0)
    per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = first_tile + split * per_split
    tile_end = tl.minimum(tile_begin + per_split, first_tile + num_tiles)

    q_offset = b.to(tl.int64) * stride_qb + h * stride_qh + t * stride_qt
    q = tl.load(q_ptr + q_offset[:, None] + d[None, :] * stride_qd, mask=is_row[:, None] & is_d[None, :],
                other=0.0)
    table_row = table_ptr + b.to(tl.int64) * M
    head_blocks = kv_head.to(tl.int64) * num_pool_blocks

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for tile in range(_loop_bound(tile_begin), _loop_bound(tile_end)):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        is_key = (pos >= start) & (pos < end)
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=is_key, other=0).to(tl.int64)
        kv_offset = ((head_blocks + block) * BLOCK_SIZE + pos % BLOCK_SIZE) * D
        kv_mask = is_key[:, None] & is_d[None, :]
        k = tl.load(k_ptr + kv_offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        # [BLOCK_R, BLOCK_N], base 2; float32 whatever type qk_scale arrives as (Inductor passes a float64)
        s = (_dot(q, tl.trans(k), IEEE) * qk_scale).to(tl.float32)
        visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    seen = l_i > 0
    l_i = tl.where(seen, l_i, 1.0)
    o = acc / l_i[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_i)) * 0.6931471805599453, float("-inf"))  # natural log
    out = ((split * tl.num_programs(0) + b).to(tl.int64) * H + h) * T + t  # [S, B, H, T] row
    tl.store(o_ptr + out[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=is_row[:, None] & is_d[None, :])
    tl.store(lse_ptr + out, lse, mask=is_row)


@triton.jit
def _merge_splits_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, N, num_splits, D: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per output row n of N = B * H * T: the partials [S, N, D], [S, N] -> [N, D], [N].
    n = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    is_s = s < num_splits
    lse = tl.load(lse_part_ptr + s * N + n, mask=is_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for empty splits
    total = tl.sum(w, axis=0)
    seen = total > 0
    total = tl.where(seen, total, 1.0)
    parts = tl.load(o_part_ptr + (s[:, None] * N + n) * D + d[None, :],
                    mask=is_s[:, None] & (d < D)[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0) / total
    tl.store(o_ptr + n * D + d, o.to(o_ptr.dtype.element_ty), mask=d < D)
    tl.store(lse_ptr + n, tl.where(seen, m_safe + tl.log(total), float("-inf")))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def row_tile(groups: int, length: int) -> tuple[int, int]:
    """(rows per program, row tiles) for T = length queries of `groups` heads per KV head."""
    rows = groups * length
    block_r = min(MAX_ROWS, max(16, triton.next_power_of_2(rows)))
    return block_r, triton.cdiv(rows, block_r)


def num_splits(programs: int, max_context: int, sm_count: int) -> int:
    """Splits of each row's keys: enough programs for about two per SM, none of them given less
    than MIN_SPLIT_TOKENS of the pool's maximum context, at most MAX_SPLITS. `programs` is the grid
    without splits (rows x KV heads x row tiles); `max_context` is the block table's width in tokens,
    fixed for a captured graph, so the split count is too."""
    fill = triton.cdiv(2 * sm_count, programs)
    return max(1, min(fill, triton.cdiv(max_context, MIN_SPLIT_TOKENS), MAX_SPLITS))


def launch_paged_attention(wrap, q, k_pool, v_pool, block_table, lo, hi, scale: float,
                           splits: int | None = None, block_n: int = BLOCK_N):
    """Launches the kernels through `wrap` (torch.library.wrap_triton, or identity in interpreter
    tests) and returns (o [B, H, T, D] in q's dtype, lse [B, H, T] float32). q: [B, H, T, D], any
    strides; k_pool, v_pool: contiguous [H_kv, num_blocks, block_size, D]; block_table:
    contiguous [B, M]; lo, hi: contiguous [B, T]. splits: the split count (default: num_splits)."""
    B, H, T, D = q.shape
    H_kv, pool_blocks, block_size, _ = k_pool.shape
    G = H // H_kv
    block_r, row_tiles = row_tile(G, T)
    if splits is None:
        splits = num_splits(B * H_kv * row_tiles, block_table.shape[1] * block_size, _sm_count(q.device.index))
    o = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if splits == 1:
        o_part, lse_part = o, lse
    else:
        o_part = torch.empty((splits, B, H, T, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((splits, B, H, T), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    wrap(_paged_attention_kernel)[(B, H_kv * row_tiles, splits)](
        q, k_pool, v_pool, block_table, lo, hi, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        H, T, block_table.shape[1], pool_blocks, splits, scale * math.log2(math.e), G=G, D=D,
        ROW_TILES=row_tiles, BLOCK_SIZE=block_size, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32, num_warps=4 if block_r * block_d <= 32 * 128 else 8)
    if splits > 1:
        wrap(_merge_splits_kernel)[(B * H * T,)](o_part, lse_part, o, lse, B * H * T, splits, D=D,
                                                 BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return o, lse
