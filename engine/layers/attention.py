"""The attention layer: store this step's keys and values in the paged cache,
then attend over everything the cache holds for each sequence."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # This layer's slice of the paged cache; the model runner binds it.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim].

        The new keys and values are written first, so that a sequence's queries
        see its own new tokens through the same cache as its earlier ones.
        """
        ctx = get_forward_context()
        ctx.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.meta.slot_mapping)
        return ctx.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx.meta, self.scale)
