"""The attention layer: store this step's keys and values in the paged cache,
then attend over everything the cache holds for each sequence."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.context import get_forward_context
from engine.kv.kv_cache import FullAttentionSpec, PagedKV
from engine.layers import opaque


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache: PagedKV | None = None  # this layer's blocks; KVCachePool binds them
        self.index = 0  # its place among the model's opaque layers (layers/opaque.py)

    def kv_cache_spec(self, dtype: torch.dtype) -> FullAttentionSpec:
        """What this layer caches for every token: a key and a value per KV head."""
        return FullAttentionSpec(self.num_kv_heads, self.head_dim, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim].

        The new keys and values are written first, so that a sequence's queries
        see its own new tokens through the same cache as its earlier ones.
        """
        if torch.compiler.is_compiling():  # one opaque operator: see compiled_decode.py
            return torch.ops.deepinfer.attention(q, k, v, self.index)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        ctx.backend.store_kvcache(k, v, self.kv_cache, ctx.meta.slot_mapping)
        return ctx.backend.forward(q, k, v, self.kv_cache, ctx.attn_metadata, self.scale)


@torch.library.custom_op("deepinfer::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Attention.attend as one operator, for a compiled forward pass. It writes
    the layer's cache in place, a side effect the compiler is not told of: no
    other operator in the graph reads the cache, so no order is lost, and the
    cache, absent from the graph, can be neither copied nor functionalized."""
    return opaque.layer(layer).attend(q, k, v)


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)  # what the compiler needs to know: the output's shape
