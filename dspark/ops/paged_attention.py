"""dspark::paged_attention: attention over a paged KV pool, whose cost follows the tokens a request
holds; and the KV write the models make every forward.

The pool of one model layer, shared by every request: k_pool, v_pool [H_kv, num_blocks, block_size, D]
in the model's dtype. Token position p of row b lives in block block_table[b, p // block_size] at
offset p % block_size; it views as [1, H_kv, num_blocks * block_size, D] without a copy, and one head's
block is a contiguous [block_size, D] tile. Block 0 is the null block: no request owns it, CUDA-graph
padding rows (block tables of zeros) write and read there, and what it holds never reaches a row's
output (NaN included).

    paged_attention(q, k_pool, v_pool, block_table, lo, hi, scale) -> (o, lse)

q: [B, H, T, D], H a multiple of H_kv (query head h reads KV head h // (H / H_kv)); block_table:
[B, M] int32; lo, hi: [B, T] int32 or int64, hi <= M * block_size. Query t of row b sees the keys at
positions lo[b, t] <= p < hi[b, t]: the target's verification has lo = 0, hi = position + 1; the
drafter's context hi = the block's start for every query and lo = max(0, position - W + 1) with a
window W, else 0. Returns o [B, H, T, D] in q's dtype and lse [B, H, T] float32, the natural-log
log-sum-exp of the scaled scores; a query that sees no key gets o = 0 and lse = -inf (lse_merge's
empty partial).

On CUDA the Triton kernels of paged_attention_kernel.py read only the blocks of row b that overlap
[min_t lo[b, t], max_t hi[b, t]); on CPU `paged_attention_torch` gathers the whole table it is given
(pass one trimmed to the batch's longest row) and masks. Shapes and dtypes are checked; values are
not (that would be a host sync).
"""
from __future__ import annotations

import torch

from dspark.ops.paged_attention_kernel import launch_paged_attention

INDEX_DTYPES = (torch.int32, torch.int64)


def slot_ids(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_table [B, M], positions [B, T] -> [B, T] int64 flat slots (block * block_size + offset)."""
    blocks = block_table.gather(1, (positions // block_size).long()).long()
    return blocks * block_size + positions % block_size


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Writes keys and values at flat slots, in place. Plain torch: compiles under
    torch.compile(fullgraph=True) and is captured in CUDA graphs. Slots repeated (padding rows in the
    null block) get one of their writes.

    The pools are indexed whole, by (block, offset), not through a flat view of them: torch 2.11's
    Inductor does not write through a view of a graph input in place, and copied each whole pool
    per layer and step instead (on an H100, the SmolLM2-shaped step at B = 1 took 9.6 ms with pools
    for 32 rows of 8k tokens against 1.9 ms with pools for one).

    k_pool, v_pool: [H_kv, num_blocks, block_size, D]; slots: [N] int64; k, v: [N, H_kv, D]
    """
    blocks, offsets = slots // k_pool.shape[2], slots % k_pool.shape[2]
    k_pool[:, blocks, offsets] = k.transpose(0, 1)
    v_pool[:, blocks, offsets] = v.transpose(0, 1)


def paged_attention_torch(q, k_pool, v_pool, block_table, lo, hi, scale: float):
    """The op in plain torch (the CPU implementation), in float32: the table's blocks gathered into
    [H_kv, B, M * block_size, D] and masked per query."""
    B, H, T, D = q.shape
    H_kv = k_pool.shape[0]
    table = block_table.long()
    k = k_pool[:, table].flatten(2, 3).float()  # [H_kv, B, S, D]
    v = v_pool[:, table].flatten(2, 3).float()
    pos = torch.arange(k.shape[2], device=q.device)
    visible = (pos >= lo[..., None]) & (pos < hi[..., None])  # [B, T, S]
    v = torch.where(visible.any(1)[None, :, :, None], v, 0.0)  # keys no query sees may hold anything
    scores = torch.einsum("bkgtd,kbsd->bkgts", q.float().reshape(B, H_kv, H // H_kv, T, D), k) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    o = torch.einsum("bkgts,kbsd->bkgtd", probs, v)
    return o.reshape(B, H, T, D).to(q.dtype), lse.view(B, H, T)


def _check(q, k_pool, v_pool, block_table, lo, hi) -> None:
    def fail(message: str):
        raise ValueError(f"paged_attention: {message}")

    if q.dim() != 4:
        fail(f"q must be [B, H, T, D], got {tuple(q.shape)}")
    B, H, T, D = q.shape
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        fail(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dim() != 4 or pool.shape[-1] != D:
            fail(f"{name} must be [H_kv, num_blocks, block_size, D = {D}], got {tuple(pool.shape)}")
        if pool.dtype != q.dtype:
            fail(f"{name} is {pool.dtype} but q is {q.dtype}")
        if not pool.is_contiguous():
            fail(f"{name} must be contiguous (strides {pool.stride()})")
    if v_pool.shape != k_pool.shape:
        fail(f"v_pool {tuple(v_pool.shape)} and k_pool {tuple(k_pool.shape)} differ")
    if H % k_pool.shape[0] != 0:
        fail(f"q's {H} heads are not a multiple of k_pool's {k_pool.shape[0]} KV heads")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype not in INDEX_DTYPES:
        fail(f"block_table must be [B = {B}, M] int32, got {block_table.dtype} {tuple(block_table.shape)}")
    for name, bound in (("lo", lo), ("hi", hi)):
        if bound.shape != (B, T) or bound.dtype not in INDEX_DTYPES:
            fail(f"{name} must be [B, T] = {(B, T)} int32 or int64, got {bound.dtype} {tuple(bound.shape)}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("block_table", block_table), ("lo", lo), ("hi", hi)):
        if t.device != q.device:
            fail(f"{name} is on {t.device} but q is on {q.device}")


@torch.library.triton_op("dspark::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                    lo: torch.Tensor, hi: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, T, D], pools [H_kv, num_blocks, block_size, D], block_table [B, M], lo, hi [B, T]
    -> (o [B, H, T, D] in q's dtype, lse [B, H, T] float32). See the module's docstring."""
    _check(q, k_pool, v_pool, block_table, lo, hi)
    if q.device.type == "cpu":
        return paged_attention_torch(q, k_pool, v_pool, block_table, lo, hi, scale)
    return launch_paged_attention(torch.library.wrap_triton, q, k_pool, v_pool, block_table.contiguous(),
                                  lo.contiguous(), hi.contiguous(), scale)
