"""RMSNorm, with the residual add fused in front of it."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.context import get_forward_context


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x), or with a residual: (rmsnorm(x + residual), x + residual).

        Each decoder layer adds its input back to its output before the next
        norm. Doing both in one call saves a pass over the activations, and
        the GPU path fuses them into one kernel: the step's backend chooses.
        """
        return get_forward_context().backend.rms_norm(x, residual, self.weight, self.eps)
