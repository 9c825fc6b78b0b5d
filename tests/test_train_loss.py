"""Drafter training's loss: DeepSpec's terms per slot, the argmax and KL terms, agreement, and the
reach estimates and weights of standard verification."""
import itertools
import math

import pytest
import torch

from dspark import train as training

pytestmark = pytest.mark.usefixtures("one_thread")


def test_compiled_slot_losses_equal_the_eager_ones():
    """train_step compiles slot_losses on the GPU: the compiled function gives the eager terms,
    acceptance and gradients (Inductor on the CPU; two block counts, one compilation)."""
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(training.slot_losses, dynamic=True)
    for blocks in (3, 5):
        logits = torch.randn(2, blocks, 4, 50, generator=g, requires_grad=True)
        bias = torch.randn(2, blocks, 4, 50, generator=g, requires_grad=True)
        confidence = torch.randn(2, blocks, 4, generator=g, requires_grad=True)
        labels = torch.randint(0, 50, (2, blocks, 4), generator=g)
        target_logits = torch.randn(2, blocks, 4, 50, generator=g)
        results = []
        for losses in (training.slot_losses, compiled):
            terms, accept, agree, log_ratio = losses(logits, bias, confidence, labels, target_logits,
                                                     0.1, 0.9, 1.0, 0.5, 0.3)
            grads = torch.autograd.grad(terms.sum(), (logits, bias, confidence))
            results.append((terms, accept, agree, log_ratio, *grads))
        for want, got in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kl_term_is_the_targets_kl_to_the_draft_and_pulls_up_what_the_draft_nearly_zeroes():
    """kl_weight adds w * KL(p || q) to each slot's terms, zero where the draft is the target. On a
    token the draft nearly zeroes (q = 1e-6, p = 0.3) TV's gradient on its logit is about q, and the
    KL's is q - p: only the KL term moves that logit."""
    g = torch.Generator().manual_seed(3)
    logits, target_logits = torch.randn(2, 3, 4, 50, generator=g), torch.randn(2, 3, 4, 50, generator=g)
    labels = torch.randint(0, 50, (2, 3, 4), generator=g)
    plain, _, _, _ = training.slot_losses(logits, None, None, labels, target_logits, 0.1, 0.9, 1.0)
    weighted, _, _, _ = training.slot_losses(logits, None, None, labels, target_logits, 0.1, 0.9, 1.0, 0.0, 0.5)
    p, log_q = target_logits.softmax(-1), logits.log_softmax(-1)
    torch.testing.assert_close(weighted - plain, 0.5 * (p * (p.log() - log_q)).sum(-1))
    same, _, _, _ = training.slot_losses(target_logits, None, None, labels, target_logits, 0.0, 0.0, 1.0, 0.0, 1.0)
    torch.testing.assert_close(same, torch.zeros_like(same), atol=1e-6, rtol=0)

    target = torch.tensor([0.3, 0.7, 0.0]).clamp_min(1e-12).log()
    draft = torch.tensor([1e-6, 1 - 1e-6, 1e-12]).log().requires_grad_()
    label = torch.tensor(1)
    tv_only, = torch.autograd.grad(training.slot_losses(draft, None, None, label, target, 0.0, 1.0, 0.0)[0], draft)
    kl_only, = torch.autograd.grad(
        training.slot_losses(draft, None, None, label, target, 0.0, 0.0, 0.0, 0.0, 1.0)[0], draft)
    assert abs(tv_only[0]) < 1e-5 and kl_only[0] == pytest.approx(-0.3, abs=1e-5)


def test_argmax_term_is_the_cross_entropy_of_the_targets_argmax_and_agreement_counts_argmaxes():
    """argmax_weight adds w * -log q(argmax p) to each slot's terms; agree is 1 exactly where the
    drafter's biased argmax is the target's, and the greedy AL estimate multiplies agreements along a
    block (a drafter equal to the target agrees everywhere: AL 1 + K)."""
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(2, 3, 4, 50, generator=g), torch.randn(2, 3, 4, 50, generator=g)
    labels = torch.randint(0, 50, (2, 3, 4), generator=g)
    target_logits = torch.randn(2, 3, 4, 50, generator=g)
    plain, _, agree, _ = training.slot_losses(logits, bias, None, labels, target_logits, 0.1, 0.9, 1.0)
    weighted, _, _, _ = training.slot_losses(logits, bias, None, labels, target_logits, 0.1, 0.9, 1.0, 0.5)
    log_q = (logits + bias).log_softmax(-1)
    target_ce = -log_q.gather(-1, target_logits.argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(weighted - plain, 0.5 * target_ce)
    assert torch.equal(agree, ((logits + bias).argmax(-1) == target_logits.argmax(-1)).float())
    assert 0 < agree.mean() < 1

    _, _, same, _ = training.slot_losses(target_logits, None, None, labels, target_logits, 0.1, 0.9, 1.0)
    valid = torch.ones(2, 3, 4, dtype=torch.bool)
    summary = training.step_stats(torch.tensor(1.0), torch.ones(2, 3, 4), same, torch.ones(2, 3, 4), valid).summary()
    assert summary["greedy_agreement"] == [1.0] * 4 and summary["al_greedy_estimate"] == 5.0
    mixed = agree.clone()
    mixed[..., 1] = 0  # nothing survives position 1
    summary = training.step_stats(torch.tensor(1.0), torch.ones(2, 3, 4), mixed, torch.ones(2, 3, 4), valid).summary()
    assert summary["al_greedy_estimate"] == pytest.approx(1 + agree[..., 0].mean().item())


def test_reach_estimate_is_the_expected_acceptance_length_of_standard_verification():
    """Along text the target samples, sum_k E[reach_k (1 - TV_k)] is the expected number of drafts
    standard verification accepts. Exact on a toy pair (3 tokens, 3 slots, p and q depending on the
    whole prefix): every text weighed by its probability under p, against the verification process
    itself (draft from q, accept with min(1, p / q), stop at a rejection), enumerated. The control:
    the log's other estimate, prod (1 - TV) along the text, is not it."""
    vocab, slots = 3, 3
    g = torch.Generator().manual_seed(0)
    logits = {}

    def law(prefix: tuple, who: str) -> torch.Tensor:  # log p or log q of the next token after prefix
        if (prefix, who) not in logits:
            logits[prefix, who] = (torch.randn(vocab, generator=g) * 1.5).log_softmax(-1)
        return logits[prefix, who]

    def accepted(prefix: tuple) -> float:  # expected accepted drafts from here on, by the process
        if len(prefix) == slots:
            return 0.0
        p, q = law(prefix, "p").exp(), law(prefix, "q").exp()
        return sum(float(q[x] * min(1.0, p[x] / q[x])) * (1 + accepted(prefix + (x,))) for x in range(vocab))

    texts = list(itertools.product(range(vocab), repeat=slots))
    draft = torch.stack([torch.stack([law(t[:k], "q") for k in range(slots)]) for t in texts])[:, None]
    target_logits = torch.stack([torch.stack([law(t[:k], "p") for k in range(slots)]) for t in texts])[:, None]
    labels = torch.tensor(texts)[:, None]  # [texts, 1 block, slots]
    chance = (target_logits.gather(-1, labels[..., None]).squeeze(-1).sum(-1).exp())[:, 0]  # P(text) under p
    _, accept, _, log_ratio = training.slot_losses(draft, None, None, labels, target_logits, 0.1, 0.9, 1.0)
    reached = training.reach(log_ratio, torch.ones_like(labels, dtype=torch.bool))
    want = accepted(())
    assert (chance * (reached * accept).sum(-1)[:, 0]).sum().item() == pytest.approx(want, abs=1e-5)
    assert abs((chance * accept.cumprod(-1).sum(-1)[:, 0]).sum().item() - want) > 0.01
    assert torch.equal(reached[..., 0], torch.ones(len(texts), 1))


def test_reach_multiplies_min_1_ratio_before_each_slot_and_survives_a_zero_draft_chance():
    log_ratio = torch.tensor([[[0.5, 0.5 ** 0.5, 0.25, 2.0]]]).log()
    log_ratio[0, 0, 1] = float("-inf")  # the draft gives the label no chance: nothing after it is reached
    valid = torch.tensor([[[True, True, True, False]]])
    got = training.reach(log_ratio, valid)
    assert got.isfinite().all()
    torch.testing.assert_close(got, torch.tensor([[[1.0, 0.5, 0.0, 0.0]]]))
    log_ratio[0, 0, 1] = math.log(0.25)
    torch.testing.assert_close(training.reach(log_ratio, valid), torch.tensor([[[1.0, 0.5, 0.125, 0.03125]]]))


def test_reach_weights_keep_each_positions_mean_weight_and_follow_the_reach_within_it():
    g = torch.Generator().manual_seed(0)
    reached = torch.rand(3, 5, 4, generator=g)
    reached[..., 0] = 1.0
    valid = torch.rand(3, 5, 4, generator=g) > 0.2
    plain = training.slot_weights(reached, valid, training.TrainConfig())
    decay = torch.exp(-torch.arange(4) / 4.0)
    torch.testing.assert_close(plain, decay * valid)
    weighted = training.slot_weights(reached, valid, training.TrainConfig(reach_weights=True))
    torch.testing.assert_close((weighted * valid).sum((0, 1)) / valid.sum((0, 1)), decay)
    assert torch.equal(weighted == 0, ~valid)
    torch.testing.assert_close(weighted[valid] / plain[valid], (reached / (reached * valid).sum((0, 1))
                                                                 * valid.sum((0, 1)))[valid])
    assert not torch.allclose(weighted, plain)  # the control: the reach moves the weights
