"""DeepSeek-V4's RMS norms, in transformers' order of operations.

V4 keeps its norm weights in float32 whatever the model's dtype, and multiplies
by them before casting back; its per-head query norm has no weight at all.
"""

from __future__ import annotations

import torch
from torch import nn


class Float32RMSNorm(nn.Module):
    """rmsnorm(x) * weight, computed in float32 with a float32 weight, then cast to x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, the rms taken in float32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
