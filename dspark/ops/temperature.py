"""Logits at a temperature as every op and the sampling filters round them: x * (1 / T), one
correctly rounded reciprocal per row, which the kernels compute the same way (`tl.div_rn`)."""
from __future__ import annotations

import torch


def scaled(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """x [B, ...] times 1 / T per row, temperature [B]; greedy rows (T = 0) keep their logits."""
    inverse = 1.0 / torch.where(temperature == 0, 1.0, temperature)
    return x * inverse.view(-1, *[1] * (x.dim() - 1))
