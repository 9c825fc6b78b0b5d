"""dspark::lse_merge on CPU: the op (opcheck, compile) and what it computes."""
import pytest
import torch

import dspark.ops.lse_merge  # noqa: F401

merge = torch.ops.dspark.lse_merge
INF = float("inf")


def partial(q, k, v):
    # q: [N, H, D]; k, v: [N, S, H, D] -> attention over these keys and its log-sum-exp
    scores = torch.einsum("nhd,nshd->nhs", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("nhs,nshd->nhd", scores.softmax(-1), v), scores.logsumexp(-1)


def random_inputs(n=5, h=3, d=20, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    o1, o2 = (torch.randn(n, h, d, generator=g).to(dtype) for _ in range(2))
    lse1, lse2 = (torch.randn(n, h, generator=g) * 3 for _ in range(2))
    return o1, lse1, o2, lse2


def test_equals_attention_over_the_union_of_key_sets():
    g = torch.Generator().manual_seed(1)
    n, h, d, s1, s2 = 6, 4, 16, 7, 3
    q = torch.randn(n, h, d, generator=g)
    k1, v1 = (torch.randn(n, s1, h, d, generator=g) for _ in range(2))
    k2, v2 = (torch.randn(n, s2, h, d, generator=g) for _ in range(2))
    o, lse = merge(*partial(q, k1, v1), *partial(q, k2, v2))
    o_all, lse_all = partial(q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1))
    torch.testing.assert_close(o, o_all)
    torch.testing.assert_close(lse, lse_all)


def test_is_symmetric_and_returns_the_input_dtype():
    o1, lse1, o2, lse2 = random_inputs(dtype=torch.bfloat16)
    o, lse = merge(o1, lse1, o2, lse2)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    o_swapped, lse_swapped = merge(o2, lse2, o1, lse1)
    torch.testing.assert_close(o, o_swapped)
    torch.testing.assert_close(lse, lse_swapped)


def test_two_empty_partials_give_zeros_not_nan():
    o1, _, o2, _ = random_inputs()
    o1[0, 0] = float("nan")  # an empty partial's output is ignored, whatever it holds
    empty = torch.full((5, 3), -INF)
    o, lse = merge(o1, empty, o2, empty)
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.equal(lse, empty)


@pytest.mark.parametrize("marker", [-INF, INF])  # FA2 marks an empty sequence with +inf
def test_an_empty_partial_leaves_the_other_unchanged(marker):
    o1, lse1, o2, _ = random_inputs()
    o2[1, 2] = float("nan")
    o, lse = merge(o1, lse1, o2, torch.full_like(lse1, marker))
    assert torch.equal(o, o1)
    assert torch.equal(lse, lse1)


def test_rejects_mismatched_shapes():
    o1, lse1, o2, lse2 = random_inputs()
    with pytest.raises(ValueError, match="lse1"):
        merge(o1, lse1[:, :2], o2, lse2)
    with pytest.raises(ValueError, match="o2"):
        merge(o1, lse1, o2[:, :, :4], lse2)


def test_opcheck():
    o1, lse1, o2, lse2 = random_inputs()
    lse2[0] = -INF
    lse1[1, 1] = INF
    torch.library.opcheck(merge, (o1, lse1, o2, lse2))
    torch.library.opcheck(merge, random_inputs(n=1, h=1, d=8, dtype=torch.bfloat16))


def test_compiles_with_inductor():
    def f(o1, lse1, o2, lse2):
        o, lse = merge(o1 * 2, lse1, o2, lse2 - 1)
        return o.sum(-1), lse

    args = random_inputs()
    compiled = torch.compile(f, fullgraph=True)
    for got, want in zip(compiled(*args), f(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_torch(dtype):
    from dspark.ops.lse_merge import lse_merge_torch

    o1, lse1, o2, lse2 = random_inputs(n=37, h=3, d=20, dtype=dtype)
    lse1[0], lse2[0], lse2[1], lse1[2] = -INF, -INF, -INF, INF
    args = [t.cuda() for t in (o1, lse1, o2, lse2)]
    o, lse = merge(*args)
    o_ref, lse_ref = lse_merge_torch(*args)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    torch.library.opcheck(merge, args)
    compiled = torch.compile(lambda *a: merge(*a), fullgraph=True)
    for got, want in zip(compiled(*args), (o, lse)):
        torch.testing.assert_close(got, want)
