"""The ops a backend runs beside attention, in plain torch: RMSNorm and the
rotary embedding. The reference (torch) and CPU backends run these; the Triton
backend runs its own kernels (engine/kernels/). The layers that use them
(layers/layernorm.py, layers/rotary_embedding.py) call the step's backend."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch version, which the reference backend runs."""
    if residual is not None:
        x = x + residual
    # In float32 whatever the model's dtype, as in transformers.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return out if residual is None else (out, x)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version, which the reference backend runs."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
