"""RMSNorm, with the residual add fused in front of it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = False  # the model runner turns this on for the GPU path

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the model's dtype, as in transformers.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x), or with a residual: (rmsnorm(x + residual), x + residual).

        Each decoder layer adds its input back to its output before the next
        norm. Doing both in one call saves a pass over the activations, and
        the GPU path fuses them into one kernel.
        """
        if self.use_triton:
            return self._triton(x, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _triton(self, x: torch.Tensor, residual: torch.Tensor | None):
        from engine.kernels import fused_add_rms_norm, rms_norm

        rows = x.reshape(-1, x.shape[-1])  # q/k norms see [tokens, heads, head_dim]
        if residual is None:
            return rms_norm(rows, self.weight, self.eps).view(x.shape)
        out, summed = fused_add_rms_norm(rows, residual.reshape(rows.shape), self.weight, self.eps)
        return out.view(x.shape), summed.view(x.shape)
