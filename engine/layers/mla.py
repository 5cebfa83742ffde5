"""Multi-head latent attention (MLA): the paged cache holds one latent per token.

A token's keys and values for every head are linear in one small vector: the
latent c (kv_lora_rank numbers, after kv_a_layernorm). Head h's key is
[W_UK[h] c, k_rope] and its value W_UV[h] c, where k_rope, the rotary part,
is one vector shared by every head. So the cache keeps only [c, k_rope] per
token, kv_lora_rank + qk_rope_head_dim numbers, for all heads together.

Two ways to attend over it, equal up to rounding:

- expanded (prefill): turn the latents back into per-head keys and values with
  kv_b_proj, then attend as usual. A prompt has many queries per key, so the
  expansion is paid once and shared.
- absorbed (decode): fold W_UK into the query (q_nope . W_UK[h] c is
  (W_UK[h]^T q_nope) . c) and W_UV into the output (sum_t p_t W_UV[h] c_t is
  W_UV[h] sum_t p_t c_t). Attention then reads only the latents, as one KV
  head shared by all query heads, with keys [c, k_rope] and values c. A decode
  step has one query per sequence, and this reads the fewest bytes.

Sparse (DeepSeek-V3.2's DSA): an indexer (engine/layers/indexer.py) has chosen,
for each query, the cached positions it attends to. A prompt chunk masks every
other position of its gathered latents; a decode reads the chosen rows alone,
through the block table (the backends' sparse_mla_decode).
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.context import get_forward_context
from engine.attention.metadata import AttentionMetadata
from engine.kv.kv_cache import LatentKV, MLACacheSpec
from engine.kv.sparse_cache import IndexedLatentKV, IndexedLatentSpec
from engine.layers import opaque


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, nope] with W_UK [heads, nope, rank] -> [tokens, heads, rank]."""
    return torch.einsum("thd,hdc->thc", q_nope, w_uk)


def absorb_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, rank] with W_UV [heads, v_dim, rank] -> [tokens, heads, v_dim]."""
    return torch.einsum("thc,hvc->thv", o_latent, w_uv)


def chunk_mask(
    n: int, context: int, chosen: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Which of its context's positions each query of a prompt chunk (the last n of
    ``context`` tokens) attends to: [n, context], or None for plain causal over a
    whole prompt. ``chosen`` [n, k], the indexer's positions (-1: none), keeps those
    alone; they are causal already."""
    if chosen is None:
        if n == context:
            return None
        q_pos = torch.arange(context - n, context, device=device)
        return torch.arange(context, device=device) <= q_pos[:, None]
    mask = torch.zeros(n, context + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, torch.where(chosen >= 0, chosen, context), True)  # -1: a spare column
    return mask[:, :context]


class MLAAttention(nn.Module):
    """The cache-facing half of an MLA layer: it stores this step's latents, then
    attends, expanded for prompt chunks and absorbed for decodes. The projections
    around it live in the model (engine/models/deepseek_v3.py)."""

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
    ) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = scale
        self.kv_cache: LatentKV | None = None  # KVCachePool binds this layer's blocks
        self.index = 0  # its place among the model's opaque layers (layers/opaque.py)

    def kv_cache_spec(self, dtype: torch.dtype) -> MLACacheSpec:
        return MLACacheSpec(self.kv_lora_rank, self.rope_dim, dtype)

    def split_kv_b(self, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight [heads * (nope + v), rank] as W_UK [heads, nope, rank]
        and W_UV [heads, v, rank] (views, no copy)."""
        w = kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def expand(
        self, latent: torch.Tensor, k_rope: torch.Tensor, kv_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [n, rank] and rotary keys [n, rope] -> per-head keys
        [n, heads, nope + rope] and values [n, heads, v]."""
        kv = (latent @ kv_b.T).view(len(latent), self.num_heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, self.num_heads, -1)], dim=-1)
        return k, v

    def forward(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_b: torch.Tensor,
        chosen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_nope [tokens, heads, nope], q_rope [tokens, heads, rope], latent
        [tokens, rank], k_rope [tokens, rope], kv_b kv_b_proj's weight; for sparse
        attention, ``chosen`` [tokens, k]: the positions each query attends to, -1
        past the last (engine/layers/indexer.py). Returns [tokens, heads, v]."""
        if chosen is None and torch.compiler.is_compiling():  # opaque: layers/opaque.py
            return torch.ops.deepinfer.mla_attention(
                q_nope, q_rope, latent, k_rope, kv_b, self.index
            )
        ctx = get_forward_context()
        meta = ctx.meta
        ctx.backend.store_latent(latent, k_rope, self.kv_cache, meta.slot_mapping)
        out = q_nope.new_empty(len(q_nope), self.num_heads, self.v_dim)
        d = meta.num_decodes
        if d:  # absorbed: attention reads the latents alone, on the backend's kernel
            w_uk, w_uv = self.split_kv_b(kv_b)
            q = torch.cat([absorb_query(q_nope[:d], w_uk), q_rope[:d]], dim=-1)
            out[:d] = absorb_output(
                self._decode(q, meta, None if chosen is None else chosen[:d]), w_uv
            )
        if d < len(q_nope):  # expanded: per-head keys and values, in torch on every backend
            q = torch.cat([q_nope, q_rope], dim=-1)
            rows = torch.cat([self.kv_cache.as_stored(latent), k_rope], dim=-1)
            self._prefill(q, rows, kv_b, meta, out, chosen)
        return out

    def _decode(
        self, q: torch.Tensor, meta: AttentionMetadata, chosen: torch.Tensor | None
    ) -> torch.Tensor:
        """The decodes' absorbed attention [decodes, heads, rank], over every cached
        row, or over the ``chosen`` rows alone."""
        ctx, rank = get_forward_context(), self.kv_lora_rank
        if chosen is None:
            return ctx.backend.mla_decode(q, self.kv_cache, rank, ctx.attn_metadata, self.scale)
        tables = meta.block_tables[: len(q)]
        return ctx.backend.sparse_mla_decode(q, self.kv_cache, rank, chosen, tables, self.scale)

    def _prefill(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        kv_b: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        chosen: torch.Tensor | None = None,
    ) -> None:
        """Causal attention for each prompt chunk, over its whole context: the new
        rows alone for a whole prompt, else the rows the cache holds (the prefix
        and, stored already, the chunk itself), read through the backend. With
        ``chosen``, each query sees its chosen positions alone (chunk_mask)."""
        backend = get_forward_context().backend
        starts = list(accumulate(meta.query_lens_cpu, initial=0))  # on the host: no GPU wait
        for i in range(meta.num_decodes, len(meta.query_lens_cpu)):
            start, n, context = starts[i], meta.query_lens_cpu[i], meta.context_lens_cpu[i]
            if n == context:
                seen = rows[start : start + n]
            else:
                seen = backend.gather_latents(self.kv_cache, meta.block_tables[i], context)
            picks = None if chosen is None else chosen[start : start + n]
            mask = chunk_mask(n, context, picks, q.device)
            k, v = self.expand(*seen.split([self.kv_lora_rank, self.rope_dim], dim=-1), kv_b)
            o = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
            )
            out[start : start + n] = o.transpose(0, 1)


class SparseMLAAttention(MLAAttention):
    """MLA for DeepSeek-V3.2's sparse attention: the same attention, given each
    query's chosen positions, over a cache that holds the indexer's keys too."""

    kv_cache: IndexedLatentKV | None  # KVCachePool binds this layer's blocks

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        index_head_dim: int,
    ) -> None:
        super().__init__(
            num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale
        )
        self.index_head_dim = index_head_dim

    def kv_cache_spec(self, dtype: torch.dtype) -> IndexedLatentSpec:
        return IndexedLatentSpec(super().kv_cache_spec(dtype), self.index_head_dim)


@torch.library.custom_op("deepinfer::mla_attention", mutates_args=())
def mla_attention_op(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    kv_b: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """MLAAttention.forward as one operator, for a compiled forward pass (it runs
    eagerly in here, where nothing is being compiled). It writes the layer's
    cache in place, unseen by the compiler, as the deepinfer::attention operator
    does (engine/layers/attention.py)."""
    return opaque.layer(layer)(q_nope, q_rope, latent, k_rope, kv_b)


@mla_attention_op.register_fake
def _(q_nope: torch.Tensor, *rest: torch.Tensor | int) -> torch.Tensor:
    """The output's shape, [tokens, heads, v]: kv_b (rest[3]) has heads * (nope + v) rows."""
    kv_b, (tokens, heads, nope) = rest[3], q_nope.shape
    return q_nope.new_empty(tokens, heads, kv_b.shape[0] // heads - nope)
