"""dspark::lse_merge: join two partial attention results computed over disjoint key sets.

Given (o1, lse1) over key set A and (o2, lse2) over key set B (natural-log log-sum-exp, FA2/FA3's
convention), the attention over A ∪ B is

    m = max(lse1, lse2);  w1 = exp(lse1 - m);  w2 = exp(lse2 - m)
    o = (w1 o1 + w2 o2) / (w1 + w2);  lse = m + log(w1 + w2)

The drafter builds its non-causal block attention this way: windowed attention over the context plus
dense attention over the block's own keys. An empty partial has lse = -inf (+inf, FA2's marker for an
empty sequence, counts as empty too) and its o is ignored, whatever it holds. Two empty partials give
o = 0 and lse = -inf, never NaN. The weights are either both 0 or sum to at least 1 (the larger one
is exp(0)), so dividing by max(w1 + w2, 1) is exact and needs no special case.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lse_merge_kernel(o1_ptr, lse1_ptr, o2_ptr, lse2_ptr, o_ptr, lse_ptr, H, D,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: all H heads x D dims of it. Everything is contiguous [N, H, D] / [N, H].
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < H
    hd_ok = h_ok[:, None] & (d < D)[None, :]
    hd = n * H * D + h[:, None] * D + d[None, :]

    lse1 = tl.load(lse1_ptr + n * H + h, mask=h_ok, other=float("-inf")).to(tl.float32)
    lse2 = tl.load(lse2_ptr + n * H + h, mask=h_ok, other=float("-inf")).to(tl.float32)
    lse1 = tl.where(lse1 == float("inf"), float("-inf"), lse1)
    lse2 = tl.where(lse2 == float("inf"), float("-inf"), lse2)
    m = tl.maximum(lse1, lse2)
    m = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(lse1 - m)
    w2 = tl.exp(lse2 - m)
    total = w1 + w2
    inv = 1.0 / tl.maximum(total, 1.0)

    o1 = tl.load(o1_ptr + hd, mask=hd_ok, other=0.0).to(tl.float32)
    o2 = tl.load(o2_ptr + hd, mask=hd_ok, other=0.0).to(tl.float32)
    o = (tl.where(w1[:, None] > 0, o1 * (w1 * inv)[:, None], 0.0)
         + tl.where(w2[:, None] > 0, o2 * (w2 * inv)[:, None], 0.0))
    tl.store(o_ptr + hd, o.to(o_ptr.dtype.element_ty), mask=hd_ok)
    lse = tl.where(total > 0, m + tl.log(tl.maximum(total, 1.0)), float("-inf"))
    tl.store(lse_ptr + n * H + h, lse, mask=h_ok)


def launch_lse_merge(wrap, o1, lse1, o2, lse2, o, lse):
    """Launches the kernel through `wrap` (torch.library.wrap_triton, or identity in interpreter
    tests). o1, o2, o: contiguous [N, H, D]; lse1, lse2: contiguous [N, H]; lse: float32 [N, H]."""
    N, H, D = o1.shape
    wrap(_lse_merge_kernel)[(N,)](o1, lse1, o2, lse2, o, lse, H, D,
                                  BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D))


def lse_merge_torch(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """The same merge in plain torch (the CPU implementation)."""
    lse1 = lse1.float().masked_fill(lse1 == float("inf"), float("-inf"))
    lse2 = lse2.float().masked_fill(lse2 == float("inf"), float("-inf"))
    m = torch.maximum(lse1, lse2)
    m = m.masked_fill(m == float("-inf"), 0.0)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    inv = 1.0 / total.clamp_min(1.0)
    o = (torch.where(w1[..., None] > 0, o1.float() * (w1 * inv)[..., None], 0.0)
         + torch.where(w2[..., None] > 0, o2.float() * (w2 * inv)[..., None], 0.0))
    lse = torch.where(total > 0, m + torch.log(total.clamp_min(1.0)), float("-inf"))
    return o.to(o1.dtype), lse


def _check(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> None:
    if o1.dim() != 3 or o1.shape != o2.shape:
        raise ValueError(f"lse_merge: o1 {tuple(o1.shape)} and o2 {tuple(o2.shape)} must both be [N, H, D]")
    if lse1.shape != o1.shape[:2] or lse2.shape != o1.shape[:2]:
        raise ValueError(f"lse_merge: lse1 {tuple(lse1.shape)} and lse2 {tuple(lse2.shape)} must be "
                         f"[N, H] = {tuple(o1.shape[:2])}")
    if o1.dtype != o2.dtype:
        raise ValueError(f"lse_merge: o1 is {o1.dtype} but o2 is {o2.dtype}")


@torch.library.triton_op("dspark::lse_merge", mutates_args=())
def lse_merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
              lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o1 [N, H, D], lse1 [N, H]) + (o2, lse2) -> (o [N, H, D] in o1's dtype, lse [N, H] float32)."""
    _check(o1, lse1, o2, lse2)
    if o1.device.type == "cpu":
        return lse_merge_torch(o1, lse1, o2, lse2)
    o = torch.empty(o1.shape, dtype=o1.dtype, device=o1.device)
    lse = torch.empty(lse1.shape, dtype=torch.float32, device=o1.device)
    launch_lse_merge(torch.library.wrap_triton, o1.contiguous(), lse1.contiguous(), o2.contiguous(),
                     lse2.contiguous(), o, lse)
    return o, lse
