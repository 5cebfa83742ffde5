"""The CPU backend: the torch backend, with decodes through a C++ operator.

Decode is where a CPU engine spends its attention time, and the torch path
pays twice for it: it copies every block of a group's contexts into a padded
tensor, then reads that copy in scaled_dot_product_attention. The operator in
engine/csrc/paged_attention.cpp reads each block where it lies, through the
block table. Prompt chunks still run through the torch backend's code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionMetadata, TorchBackend
from engine.kv.kv_cache import LatentKV, PagedKV


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    """The torch backend's prompt chunks, plus the decodes' tables for the
    operator. The torch decode groups are built only if a layer asks for them
    (MLA's decode still attends through torch): a dense model never does."""

    decode_tables: torch.Tensor  # [decodes, max_blocks] int32, padded with -1
    decode_lens: torch.Tensor  # [decodes] int32: tokens each decode attends over
    meta: AttentionMetadata  # what the decode groups are built from, when needed


class CpuBackend(TorchBackend):
    name = "cpu"

    def build_metadata(self, meta: AttentionMetadata) -> CpuAttentionMetadata:
        d = meta.num_decodes
        tables = meta.block_tables[:d].to(torch.int32).contiguous()
        lens = meta.context_lens[:d].to(torch.int32).contiguous()
        return CpuAttentionMetadata([], self.prefill_chunks(meta), tables, lens, meta)

    def mla_decode(self, q, cache: LatentKV, rank: int, attn_metadata: CpuAttentionMetadata, scale):
        """MLA decodes through the torch path, whose groups the first layer builds."""
        if not attn_metadata.decode_groups and attn_metadata.meta.num_decodes:
            attn_metadata.decode_groups = self.decode_groups(attn_metadata.meta)
        return super().mla_decode(q, cache, rank, attn_metadata, scale)

    # --8<-- [start:cpu_decode]
    def forward(self, q, k, v, cache: PagedKV, attn_metadata: CpuAttentionMetadata, scale):
        d = attn_metadata.decode_lens.shape[0]
        out = super().forward(q, k, v, cache, attn_metadata, scale)  # the prompt chunks
        if d:  # one query per decode, at the start of the batch
            tables, lens = attn_metadata.decode_tables, attn_metadata.decode_lens
            out[:d] = torch.ops.deepinfer.paged_decode_attention(
                q[:d], cache.k, cache.v, tables, lens, scale
            )
        return out

    # --8<-- [end:cpu_decode]
