"""Code of earlier commits that the benchmarks run beside the current code, as it was then."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def slot_losses_7c07aee(logits: torch.Tensor, bias: torch.Tensor | None, confidence: torch.Tensor | None,
                        labels: torch.Tensor, target_logits: torch.Tensor, ce_weight: float, tv_weight: float,
                        confidence_weight: float, argmax_weight: float = 0.0, kl_weight: float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dspark.train.slot_losses of commit 7c07aee, before dspark::distill_loss: the formulas over the
    vocabulary in torch, differentiated by autograd (compiled, Inductor fuses their passes).
    logits, bias, target_logits: [..., V]; confidence, labels: [...] -> terms, accept, agree [...]"""
    logits = logits.float() if bias is None else logits.float() + bias.float()
    log_q = logits.log_softmax(-1)
    target_probs = target_logits.float().softmax(-1)  # T = 1
    ce = -log_q.gather(-1, labels[..., None]).squeeze(-1)
    tv = 0.5 * (log_q.exp() - target_probs).abs().sum(-1)
    accept = (1 - tv.detach()).clamp_min(0.0)  # TV can exceed 1 by a rounding error
    target_argmax = target_probs.argmax(-1, keepdim=True)
    agree = (logits.detach().argmax(-1, keepdim=True) == target_argmax).squeeze(-1).float()
    terms = ce_weight * ce + tv_weight * tv
    if argmax_weight:
        terms = terms + argmax_weight * -log_q.gather(-1, target_argmax).squeeze(-1)
    if kl_weight:
        terms = terms + kl_weight * (target_probs * (target_logits.float().log_softmax(-1) - log_q)).sum(-1)
    if confidence is not None:
        terms = terms + confidence_weight * F.binary_cross_entropy_with_logits(
            confidence.float(), accept, reduction="none")
    return terms, accept, agree
