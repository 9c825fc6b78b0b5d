"""dspark::distill_loss: its terms, agreement and closed-form gradient against an independent float64
reference written from the loss's definition (reference_loss) and against autograd of the plain formulas
(distill_terms), on the CPU (eager, opcheck, compiled) and on CUDA (the Triton kernel)."""
import pytest
import torch

from dspark.ops.distill_loss import distill_loss_torch, distill_terms

loss_op = torch.ops.dspark.distill_loss
WEIGHTS = (0.1, 0.9, 0.3, 1.0)  # ce, tv, argmax, kl: the shipped recipe's


def inputs(rows=7, vocab=50, dtype=torch.float32, with_bias=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(dtype)
    bias = torch.randn(rows, vocab, generator=g).to(dtype) if with_bias else None
    target_logits = (torch.randn(rows, vocab, generator=g) * 2).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    return [None if t is None else t.to(device) for t in (logits, bias, target_logits, labels)]


def gradients(fn, logits, bias, target_logits, labels, weights):
    """fn's terms and the gradients of sum(terms * upstream) for logits and bias (a random upstream)."""
    leaves = [t.detach().requires_grad_() for t in (logits, bias) if t is not None]
    terms = fn(*leaves[:1], leaves[1] if bias is not None else None, target_logits, labels, *weights)
    terms = terms[0] if isinstance(terms, tuple) else terms
    upstream = torch.linspace(-1.0, 2.0, len(terms), device=terms.device)
    return terms, torch.autograd.grad((terms * upstream).sum(), leaves)


def reference_loss(logits, bias, target_logits, labels, ce_weight, tv_weight, argmax_weight, kl_weight):
    """The loss from its definition in float64 (z = logits + bias, q = softmax(z), p = softmax(target),
    y the label, a the target's first argmax): terms = w_ce CE + w_tv TV + w_am AM + w_kl KL with
    CE = -log q_y, TV = 1/2 sum |q - p|, AM = -log q_a, KL = sum p log(p / q); the agreement
    [argmax z == a]; log q_y - log p_y; and d terms / d z by float64 autograd of those formulas."""
    z = logits.double() + (0.0 if bias is None else bias.double())
    z.requires_grad_()
    q = torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)
    t = target_logits.double()
    p = torch.exp(t) / torch.exp(t).sum(-1, keepdim=True)
    rows, a = torch.arange(len(labels)), t.argmax(-1)
    ce, am = -torch.log(q[rows, labels]), -torch.log(q[rows, a])
    tv = 0.5 * (q - p).abs().sum(-1)
    kl = (p * torch.log(p / q)).sum(-1)
    terms = ce_weight * ce + tv_weight * tv + argmax_weight * am + kl_weight * kl
    grad, = torch.autograd.grad(terms.sum(), z)  # row r's terms depend on row r of z only
    log_ratio = torch.log(q[rows, labels]) - torch.log(p[rows, labels])
    return terms.detach(), tv.detach(), (z.argmax(-1) == a).double(), log_ratio.detach(), grad


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("weights", [WEIGHTS, (1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.0),
                                     (0.0, 0.0, 0.0, 1.0)], ids=["recipe", "ce", "tv", "argmax", "kl"])
def test_op_is_the_losss_definition_in_float64(with_bias, weights):
    """Every output of the op (float32) against reference_loss; the op's autograd is the reference's
    gradient scaled by the upstream gradient, for the logits and the bias. A negative control: another
    weighting's reference terms differ from the op's."""
    args = inputs(rows=9, with_bias=with_bias, seed=10 + len(weights))
    want = reference_loss(*args, *weights)
    got = loss_op(*args, *weights)
    for name, a, b in zip(("terms", "tv", "agree", "log_ratio", "grad"), got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=2e-6, msg=name)
    _, grads = gradients(loss_op, *args, weights)
    upstream = torch.linspace(-1.0, 2.0, len(args[3]), dtype=torch.float64)[:, None]
    for g in grads:
        torch.testing.assert_close(g.double(), want[4] * upstream, rtol=1e-5, atol=2e-6)
    other = reference_loss(*args, *reversed(weights))[0]
    assert (other - got[0].double()).abs().max() > 1e-2


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("weights", [WEIGHTS, (1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.0),
                                     (0.0, 0.0, 0.0, 1.0)], ids=["recipe", "ce", "tv", "argmax", "kl"])
def test_terms_and_gradients_are_autograds_of_the_formulas(with_bias, weights):
    args = inputs(with_bias=with_bias, seed=len(weights))
    want_terms, want_grads = gradients(distill_terms, *args, weights)
    got_terms, got_grads = gradients(loss_op, *args, weights)
    torch.testing.assert_close(got_terms, want_terms)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a negative control: another weighting is another gradient
    other = tuple(reversed(weights))
    assert not torch.allclose(gradients(loss_op, *args, other)[1][0], want_grads[0], atol=1e-4)


def test_tv_and_agreement_are_the_distance_and_the_argmax_match_and_carry_no_gradient():
    logits, bias, target_logits, labels = inputs()
    target_logits[0] = logits[0] + bias[0] + 5.0  # the same distribution, shifted: TV 0, agreement
    logits_leaf = logits.requires_grad_()
    terms, tv, agree, log_ratio, grad = loss_op(logits_leaf, bias, target_logits, labels, *WEIGHTS)
    q, p = (logits + bias).softmax(-1), target_logits.softmax(-1)
    torch.testing.assert_close(tv, 0.5 * (q - p).abs().sum(-1))
    assert torch.equal(agree, ((logits + bias).argmax(-1) == target_logits.argmax(-1)).float())
    picked = torch.arange(len(labels)), labels
    torch.testing.assert_close(log_ratio, (q[picked] / p[picked]).log())
    assert tv[0] < 1e-6 and agree[0] == 1.0 and 0 < agree.mean() < 1 and log_ratio[0].abs() < 1e-5
    assert terms.requires_grad and not any(t.requires_grad for t in (tv, agree, log_ratio, grad))


def test_bfloat16_inputs_give_their_float32_values_and_a_bfloat16_gradient():
    logits, bias, target_logits, labels = inputs(dtype=torch.bfloat16)
    terms, tv, agree, log_ratio, grad = loss_op(logits, bias, target_logits, labels, *WEIGHTS)
    want = distill_loss_torch(logits.float(), bias.float(), target_logits.float(), labels, *WEIGHTS)
    assert grad.dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in (terms, tv, agree, log_ratio))
    for got, expected in zip((terms, tv, agree, log_ratio, grad.float()), want):
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-3)


def test_bad_shapes_are_refused_by_name():
    logits, bias, target_logits, labels = inputs()
    with pytest.raises(ValueError, match="must all be"):
        loss_op(logits, bias[:, :10], target_logits, labels, *WEIGHTS)
    with pytest.raises(ValueError, match="labels must be int64"):
        loss_op(logits, bias, target_logits, labels.int(), *WEIGHTS)


def test_opcheck_and_compiled_equal_eager():
    args = inputs()
    torch.library.opcheck(loss_op, (*args, *WEIGHTS))
    torch.library.opcheck(loss_op, (args[0], None, *args[2:], *WEIGHTS))
    compiled = torch.compile(lambda *a: loss_op(*a)[0], dynamic=True, fullgraph=True)
    for rows in (5, 9):  # two row counts, one compilation
        args = inputs(rows=rows, seed=rows)
        want_terms, want_grads = gradients(loss_op, *args, WEIGHTS)
        got_terms, got_grads = gradients(compiled, *args, WEIGHTS)
        torch.testing.assert_close(got_terms, want_terms)
        for got, want in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cuda_kernel_matches_torch(dtype, with_bias):
    """The default target's vocabulary (49152, twelve chunks), compiled with its backward as the
    training step is, against the CPU implementation on the same inputs."""
    args = inputs(rows=37, vocab=49152, dtype=dtype, with_bias=with_bias, device="cuda")
    got = loss_op(*args, *WEIGHTS)
    want = distill_loss_torch(*args, *WEIGHTS)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-5)
    for name, a, b in zip(("terms", "tv", "agree", "log_ratio", "grad"), got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)
    compiled = torch.compile(lambda *a: loss_op(*a)[0], dynamic=True)
    want_terms, want_grads = gradients(distill_terms, *args, WEIGHTS)
    got_terms, got_grads = gradients(compiled, *args, WEIGHTS)
    torch.testing.assert_close(got_terms, want_terms, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)
