"""The SwiGLU activation of Llama-style MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, for the fused [gate | up] projection's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        # Multiplying in place into silu's fresh output saves allocating (and,
        # on CPU, page-faulting in) a third tensor of the MLP's width.
        return F.silu(gate).mul_(up)
