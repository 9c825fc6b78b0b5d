"""Input checks shared by the ops: the kernels read raw pointers, so shapes, dtypes and
contiguity are checked (from metadata only) before any launch."""
from __future__ import annotations

import torch


def check_rows(batch: int, **tensors: tuple[torch.Tensor, torch.dtype]) -> None:
    """Each named tensor must be a contiguous [batch] vector of its dtype."""
    for name, (t, dtype) in tensors.items():
        if t.shape != (batch,) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{batch}] {dtype}, got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()}")
