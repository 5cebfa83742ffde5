"""The attention layer: store this step's keys and values in the paged cache,
then attend over everything the cache holds for each sequence."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import get_forward_context
from engine.kv_cache import FullAttentionSpec, PagedKV


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache: PagedKV | None = None  # this layer's blocks; KVCachePool binds them

    def kv_cache_spec(self, dtype: torch.dtype) -> FullAttentionSpec:
        """What this layer caches for every token: a key and a value per KV head."""
        return FullAttentionSpec(self.num_kv_heads, self.head_dim, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim].

        The new keys and values are written first, so that a sequence's queries
        see its own new tokens through the same cache as its earlier ones.
        """
        ctx = get_forward_context()
        ctx.backend.store_kvcache(k, v, self.kv_cache, ctx.meta.slot_mapping)
        return ctx.backend.forward(q, k, v, self.kv_cache, ctx.attn_metadata, self.scale)
