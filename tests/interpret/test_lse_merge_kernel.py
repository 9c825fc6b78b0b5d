"""The lse_merge Triton kernel under TRITON_INTERPRET=1 against the torch implementation."""
import pytest
import torch

from dspark.ops.lse_merge import launch_lse_merge, lse_merge_torch

INF = float("inf")


def run_kernel(o1, lse1, o2, lse2):
    o = torch.empty_like(o1)
    lse = torch.empty(lse1.shape, dtype=torch.float32)
    launch_lse_merge(lambda kernel: kernel, o1, lse1, o2, lse2, o, lse)
    return o, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim", [(3, 20), (4, 16)])  # non-powers of two are masked
def test_kernel_matches_torch(dtype, heads, head_dim):
    g = torch.Generator().manual_seed(heads)
    n = 6
    o1, o2 = (torch.randn(n, heads, head_dim, generator=g).to(dtype) for _ in range(2))
    lse1, lse2 = (torch.randn(n, heads, generator=g) * 4 for _ in range(2))
    lse1[0], lse2[0] = -INF, -INF  # both empty
    o1[0, 0] = float("nan")  # ignored: its partial is empty
    lse2[1] = -INF
    lse1[2, 0] = INF  # FA2's empty marker
    lse2[3] = lse1[3]  # equal weights

    o, lse = run_kernel(o1, lse1, o2, lse2)
    o_ref, lse_ref = lse_merge_torch(o1, lse1, o2, lse2)
    assert not o.isnan().any()
    # float32 math agrees to rounding; the interpreter's bfloat16 store may differ by one ulp
    tol = {} if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o, o_ref, **tol)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and (lse[0] == -INF).all()
