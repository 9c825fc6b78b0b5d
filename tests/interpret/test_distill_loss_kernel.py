"""The distill_loss Triton kernel under TRITON_INTERPRET=1 against the torch implementation."""
import pytest
import torch

from dspark.ops.distill_loss import distill_loss_torch, launch_distill_loss

WEIGHTS = (0.1, 0.9, 0.3, 1.0)  # ce, tv, argmax, kl: the shipped recipe's


def run_kernel(logits, bias, target_logits, labels, weights, chunk):
    rows = logits.shape[0]
    terms, tv, agree, log_ratio = (torch.empty(rows) for _ in range(4))
    grad = torch.empty_like(logits)
    launch_distill_loss(lambda kernel: kernel, logits, bias, target_logits, labels, weights, terms, tv, agree,
                        log_ratio, grad, chunk=chunk)
    return terms, tv, agree, log_ratio, grad


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [64, 512])  # five chunks, the last one partial; or the whole row in one
def test_kernel_matches_torch(with_bias, chunk):
    g = torch.Generator().manual_seed(chunk + with_bias)
    rows, vocab = 6, 300
    logits, target_logits = torch.randn(rows, vocab, generator=g) * 3, torch.randn(rows, vocab, generator=g) * 3
    bias = torch.randn(rows, vocab, generator=g) if with_bias else None
    labels = torch.randint(0, vocab, (rows,), generator=g)
    z = logits if bias is None else logits + bias
    # ties of the maximum in two chunks: both argmaxes take the first index
    target_logits[0, [70, 200]] = 20.0
    logits[1, [10, 290]] = 30.0 - (0.0 if bias is None else bias[1, [10, 290]])
    labels[2] = target_logits[2].argmax()  # the label is the target's argmax: both picks on one token
    target_logits[3] = z[3]  # the draft is the target: no TV, no KL
    got = run_kernel(logits, bias, target_logits, labels, WEIGHTS, chunk)
    want = distill_loss_torch(logits, bias, target_logits, labels, *WEIGHTS)
    for name, a, b in zip(("terms", "tv", "agree", "log_ratio", "grad"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert got[1][3] < 1e-5 and got[2][3] == 1.0


def test_kernel_matches_torch_on_masked_chunks_and_near_ties():
    """A first chunk of -inf draft logits (once NaN for the whole row: -inf - -inf in the running sum) and a
    target maximum 1e-7 above the rest (once another argmax on the CPU: log_softmax rounds it to a tie)."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 2, 200
    logits, target_logits = torch.randn(rows, vocab, generator=g), torch.randn(rows, vocab, generator=g)
    logits[0, :64] = float("-inf")
    target_logits[1] = 0.0
    target_logits[1, 5] = 1e-7
    logits[1, 5] = 10.0
    labels = torch.tensor([70, 5])
    got = run_kernel(logits, None, target_logits, labels, WEIGHTS, 64)
    want = distill_loss_torch(logits, None, target_logits, labels, *WEIGHTS)
    for name, a, b in zip(("terms", "tv", "agree", "log_ratio", "grad"), got, want):  # row 0's KL term is inf in both
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert got[1].isfinite().all() and got[4].isfinite().all()
    assert got[2][1] == 1.0  # the draft's argmax is the target's
