"""DeepSeek-V4's rotary embedding: interleaved pairs, on the trailing part of a head.

A head of V4 is [nope | rope]: only its last ``rope_dim`` numbers turn, pair
(x[2i], x[2i+1]) by position * inv_freq[i]. Since K = V, the values carry that
rotation too, so the attention output's rope slice is turned back by the same
angle at the query's position (``inverse=True``): each cached row then adds in
as a function of its distance to the query alone.

cos and sin are computed from the positions on each call, in float32, as
transformers computes them; the rotation runs in float32 and is cast back.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config.deepseek_v4 import RopeSpec
from engine.layers.rotary_embedding import inverse_frequencies


class PartialRope(nn.Module):
    def __init__(self, rope_dim: int, spec: RopeSpec) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        inv_freq = inverse_frequencies(rope_dim, spec.theta, spec.yarn)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """x [tokens, ..., dim], positions [tokens]: x with its last rope_dim numbers
        turned by each token's angle (backwards with ``inverse``)."""
        freqs = positions[:, None].float() * self.inv_freq.float()
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        if inverse:
            sin = -sin
        shape = (len(x), *[1] * (x.dim() - 2), self.rope_dim)
        cos = cos.repeat_interleave(2, dim=-1).view(shape)
        sin = sin.repeat_interleave(2, dim=-1).view(shape)
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim :]
        pairs = rope.unflatten(-1, (-1, 2))
        turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        rotated = (rope.float() * cos + turned.float() * sin).to(x.dtype)
        return torch.cat([nope, rotated], dim=-1)
