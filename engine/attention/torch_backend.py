"""The reference attention backend, in plain torch.

It reads each sequence's keys and values out of the paged cache through its
block table and calls scaled_dot_product_attention. Decodes run as padded
batches of sequences with similar context lengths; prompt chunks run one
sequence at a time, with a causal mask offset by the tokens already in the cache.
Norms and RoPE run as the layers' own torch code.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ops import rms_norm, rotary_embedding
from engine.kv.kv_cache import (
    LatentKV,
    PagedKV,
    as_bytes,
    dequantize_rows,
    gather_latents,
    store_kvcache,
    store_latent,
)
from engine.kv.sparse_cache import gather_selected
from engine.utils import cdiv


def gather_blocks(
    cache: torch.Tensor, tables: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[seqs, blocks] block ids -> [seqs, blocks * block_size, kv_heads, head_dim].

    Copying whole blocks keeps each copy a contiguous run of memory, which is
    much faster than gathering one slot at a time. ``out``, a reused buffer of
    seqs * blocks blocks, saves asking the allocator for fresh pages each time.
    """
    seqs, blocks = tables.shape
    gathered = torch.index_select(cache, 0, tables.flatten(), out=out)
    return gathered.view(seqs, blocks * cache.shape[1], *cache.shape[2:])


def dequantized(
    cache: PagedKV, tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized cache's keys and values in these blocks, [seqs, L, kv_heads,
    head_dim] numbers of ``dtype``: each row's codes times the scale beside it."""
    assert cache.k_scale is not None and cache.v_scale is not None
    ks = gather_blocks(as_bytes(cache.k), tables).view(cache.k.dtype)
    vs = gather_blocks(as_bytes(cache.v), tables).view(cache.v.dtype)
    k_scales = gather_blocks(cache.k_scale, tables)  # [seqs, L, kv_heads]
    v_scales = gather_blocks(cache.v_scale, tables)
    return dequantize_rows(ks, k_scales, dtype), dequantize_rows(vs, v_scales, dtype)


DECODE_GROUP = 16  # decodes per padded attention batch


@dataclass
class DecodeGroup:
    """Decodes attended together, padded only to the longest context among them."""

    rows: torch.Tensor  # [seqs] their rows in the batch
    tables: torch.Tensor  # [seqs, blocks] the blocks to read, -1 padding made block 0
    valid: torch.Tensor  # [seqs, 1, 1, blocks * block_size] which positions are real


@dataclass
class PrefillChunk:
    """One sequence's prompt tokens in this step, attended on their own."""

    start: int  # its first query row
    num_tokens: int
    tables: torch.Tensor | None  # [1, blocks] when part of its context is cached, else None
    mask: torch.Tensor | None  # [num_tokens, context], causal over the cache and the new tokens


@dataclass
class TorchAttentionMetadata:
    decode_groups: list[DecodeGroup]
    prefill_chunks: list[PrefillChunk]


class TorchLatents:
    """MLA's store and prefill read in plain torch, which every backend shares:
    one indexed copy of [latent, rotary key] rows, and a gather through a block
    table. Only MLA's absorbed decode has kernels of its own."""

    def store_latent(
        self,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        cache: LatentKV,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_latent(latent, k_rope, cache, slot_mapping)

    def gather_latents(
        self, cache: LatentKV, block_table: torch.Tensor, context: int
    ) -> torch.Tensor:
        return gather_latents(cache, block_table, context)


class TorchBackend(TorchLatents):
    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._buffers: dict[str, torch.Tensor] = {}  # gather space, reused across layers

    def _buffer(self, name: str, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        rows = tables.numel()
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty((rows, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
            self._buffers[name] = buf
        return buf[:rows]

    def build_metadata(self, meta: AttentionMetadata) -> TorchAttentionMetadata:
        """Work shared by every layer, done once per step: which blocks to read,
        and which of the positions read are real (and causal)."""
        return TorchAttentionMetadata(self.decode_groups(meta), self.prefill_chunks(meta))

    def decode_groups(self, meta: AttentionMetadata) -> list[DecodeGroup]:
        d, block_size = meta.num_decodes, self.block_size
        tables = meta.block_tables.clamp(min=0).long()  # -1 padding reads block 0, masked
        # --8<-- [start:decode_groups]
        # Decodes run as padded batches, and padding is memory read only to be
        # masked. Sorting by context length and batching neighbours keeps it small.
        lens = meta.context_lens_cpu[:d]
        order = sorted(range(d), key=lens.__getitem__)
        groups = []
        for first in range(0, d, DECODE_GROUP):
            rows = order[first : first + DECODE_GROUP]
            blocks = cdiv(lens[rows[-1]], block_size)  # the group's longest context
            idx = torch.tensor(rows, device=tables.device)
            pos = torch.arange(blocks * block_size, device=tables.device)
            valid = pos < meta.context_lens[idx, None]
            groups.append(DecodeGroup(idx, tables[idx, :blocks], valid[:, None, None, :]))
        # --8<-- [end:decode_groups]
        return groups

    def prefill_chunks(
        self, meta: AttentionMetadata, seqs: list[int] | None = None
    ) -> list[PrefillChunk]:
        d, block_size = meta.num_decodes, self.block_size
        tables = meta.block_tables.clamp(min=0).long()
        chunks = []
        starts = list(accumulate(meta.query_lens_cpu, initial=0))  # on the host: no GPU wait
        for i in range(d, len(meta.query_lens_cpu)) if seqs is None else seqs:
            n, ctx = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
            if n == ctx:  # no cached prefix: attend over the new tokens themselves
                chunks.append(PrefillChunk(starts[i], n, None, None))
                continue
            blocks = cdiv(ctx, block_size)
            q_pos = torch.arange(ctx - n, ctx, device=tables.device)  # query j sits at ctx-n+j
            mask = torch.arange(ctx, device=tables.device) <= q_pos[:, None]
            chunks.append(PrefillChunk(starts[i], n, tables[i : i + 1, :blocks], mask))
        return chunks

    def store_kvcache(self, k, v, cache: PagedKV, slot_mapping) -> None:
        store_kvcache(k, v, cache, slot_mapping)

    rms_norm = staticmethod(rms_norm)
    rotary_embedding = staticmethod(rotary_embedding)

    def mla_decode(
        self, q, cache: LatentKV, rank: int, attn_metadata: TorchAttentionMetadata, scale
    ) -> torch.Tensor:
        """Absorbed MLA decode (engine/layers/mla.py): q [decodes, heads, rank + rope]
        over the paged latents [blocks, block_size, rank + rope], which serve as one
        KV head shared by every query head, with their first rank numbers as values.
        Returns [decodes, heads, rank]."""
        out = q.new_empty(*q.shape[:2], rank)
        for group in attn_metadata.decode_groups:
            rows, tables = group.rows, group.tables
            if cache.scales is None:
                latents = gather_blocks(
                    cache.rows, tables, self._buffer("latent", cache.rows, tables)
                )
            else:  # quantized: codes times their scales, beside the rotary keys
                latents = cache.numbers(tables).flatten(1, 2)
            latents = latents[:, None]  # [seqs, 1, L, rank + rope]: the one KV head
            o = F.scaled_dot_product_attention(
                q[rows][:, None], latents, latents[..., :rank], attn_mask=group.valid, scale=scale
            )
            out[rows] = o[:, 0]
        return out

    def forward(self, q, k, v, cache: PagedKV, attn_metadata: TorchAttentionMetadata, scale):
        """q: [tokens, heads, head_dim]; k, v: this step's [tokens, kv_heads, head_dim],
        already stored in the cache. The result has q's shape."""
        k_cache, v_cache = cache.k, cache.v
        # --8<-- [start:decode_attend]
        out = torch.empty_like(q)
        kv_heads = k_cache.shape[2]
        for group in attn_metadata.decode_groups:  # one query per sequence
            rows, tables = group.rows, group.tables
            if cache.k_scale is None:
                ks = gather_blocks(k_cache, tables, self._buffer("k", k_cache, tables))
                vs = gather_blocks(v_cache, tables, self._buffer("v", v_cache, tables))
            else:  # one-byte codes, times their scales (engine/kv/quant.py)
                ks, vs = dequantized(cache, tables, q.dtype)
            ks, vs = ks.transpose(1, 2), vs.transpose(1, 2)  # [seqs, kv_heads, L, head_dim]
            # GQA: the query heads that share a KV head become that head's query
            # rows, so each key is scored against all of them in one matmul.
            qs = q[rows].view(len(rows), kv_heads, -1, q.shape[-1])
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=group.valid, scale=scale)
            out[rows] = o.flatten(1, 2)
            # --8<-- [end:decode_attend]
        for chunk in attn_metadata.prefill_chunks:
            start, n, mask = chunk.start, chunk.num_tokens, chunk.mask
            if chunk.tables is None:  # a whole prompt: its keys are the new ones, causal
                ks, vs = (
                    cache.as_stored(k[start : start + n]),
                    cache.as_stored(v[start : start + n]),
                )
            else:  # a later chunk, or a prefix-cache hit: read the prefix from the cache
                ctx = mask.shape[1]
                if cache.k_scale is None:
                    ks = gather_blocks(k_cache, chunk.tables)
                    vs = gather_blocks(v_cache, chunk.tables)
                else:
                    ks, vs = dequantized(cache, chunk.tables, q.dtype)
                ks, vs = ks[0, :ctx], vs[0, :ctx]
            o = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1)[None],
                ks.transpose(0, 1)[None],
                vs.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[start : start + n] = o[0].transpose(0, 1)
        return out

    def sparse_mla_decode(
        self, q, cache: LatentKV, rank: int, chosen, block_tables, scale
    ) -> torch.Tensor:
        """Absorbed MLA decode over the chosen rows (DSA): the rows at ``chosen`` are
        gathered through the block tables, [decodes, k, rank + rope], and serve as
        one KV head, masked where no position was chosen."""
        rows = gather_selected(cache, block_tables, chosen)[:, None]  # [decodes, 1, k, width]
        valid = (chosen >= 0)[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q[:, None], rows, rows[..., :rank], attn_mask=valid, scale=scale
        )
        return o[:, 0]
