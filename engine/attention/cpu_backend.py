"""The CPU backend: the torch backend, with decodes through a C++ operator.

Decode is where a CPU engine spends its attention time, and the torch path
pays twice for it: it copies every block of a group's contexts into a padded
tensor, then reads that copy in scaled_dot_product_attention. The operator in
engine/csrc/paged_attention.cpp reads each block where it lies, through the
block table. Prompt chunks still run through the torch backend's code.
Decodes with drafts run through the operator too, a query token per row. A
quantized cache's codes are scaled inside the operator, row by row. MLA's
absorbed decodes run through it as well, with the latent rows as one KV head.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionMetadata, TorchBackend
from engine.kv.kv_cache import LatentKV, PagedKV

SHORT_QUERY = 17  # query tokens a sequence may have for the operator: a decode and 16 drafts
MAX_HEAD_DIM = 576  # the operator's widest head (kMaxChunks lanes of 8): DeepSeek-V3's MLA rows


def fits_operator(q: torch.Tensor, rows: torch.Tensor) -> bool:
    """Can the operator attend with these queries over these cache rows?"""
    dim = q.shape[-1]
    return dim % 8 == 0 and dim <= MAX_HEAD_DIM and q.dtype == rows.dtype


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    """The torch backend's prompt chunks, plus the decodes' tables for the
    operator. The torch decode groups are built only if a layer asks for them
    (MLA's decode over a quantized cache attends through torch): most never do."""

    decode_tables: torch.Tensor  # [decodes, max_blocks] int32, padded with -1
    decode_lens: torch.Tensor  # [decodes] int32: tokens each decode attends over
    meta: AttentionMetadata  # what the decode groups are built from, when needed
    # The token rows the operator serves; None: the first len(decode_lens) rows.
    decode_rows: torch.Tensor | None = None


class CpuBackend(TorchBackend):
    name = "cpu"

    def build_metadata(self, meta: AttentionMetadata) -> CpuAttentionMetadata:
        if meta.decode_query_len > 1:  # decodes with drafts: see _verify_metadata
            return self._verify_metadata(meta)
        d = meta.num_decodes
        tables = meta.block_tables[:d].to(torch.int32).contiguous()
        lens = meta.context_lens[:d].to(torch.int32).contiguous()
        return CpuAttentionMetadata([], self.prefill_chunks(meta), tables, lens, meta)

    def _verify_metadata(self, meta: AttentionMetadata) -> CpuAttentionMetadata:
        """A step with drafts, its short queries through the operator: each query
        token of a sequence scheduled for at most SHORT_QUERY tokens (decodes with
        or without drafts, short chunks) is a one-token decode of its own, over
        the context up to and including itself (causal by length), with the
        sequence's block table. Every key and value of the step is in the cache
        before attention runs. Longer chunks stay with the torch path."""
        qlens, ctxs = meta.query_lens_cpu, meta.context_lens_cpu
        short = [i for i, n in enumerate(qlens) if n <= SHORT_QUERY]
        starts = list(accumulate(qlens, initial=0))
        rows = [starts[i] + j for i in short for j in range(qlens[i])]
        seq_of_row = [i for i in short for _ in range(qlens[i])]
        lens = [ctxs[i] - qlens[i] + 1 + j for i in short for j in range(qlens[i])]
        device = meta.block_tables.device
        index = torch.tensor(seq_of_row, dtype=torch.int64, device=device)
        tables = meta.block_tables.index_select(0, index).to(torch.int32).contiguous()
        long = [i for i, n in enumerate(qlens) if n > SHORT_QUERY]
        return CpuAttentionMetadata(
            [],
            self.prefill_chunks(meta, long),
            tables,
            torch.tensor(lens, dtype=torch.int32, device=device),
            meta,
            torch.tensor(rows, dtype=torch.int64, device=device),
        )

    def mla_decode(self, q, cache: LatentKV, rank: int, attn_metadata: CpuAttentionMetadata, scale):
        """Absorbed MLA decodes through the operator: the latent rows are one KV
        head that every query head shares, keys and values at once. The operator
        sums whole rows, so the first ``rank`` numbers of its output are the
        latents' weighted sum, and the rest (the rotary keys') is dropped. A
        quantized cache, whose rows are codes beside separate rotary keys, goes
        through the torch path, whose groups the first such layer builds."""
        rows = cache.rows
        if cache.scales is None and fits_operator(q, rows):
            one_head = rows[:, :, None]  # [blocks, block_size, 1, rank + rope]
            tables, lens = attn_metadata.decode_tables, attn_metadata.decode_lens
            out = torch.ops.deepinfer.paged_decode_attention(
                q, one_head, one_head, tables, lens, scale
            )
            return out[..., :rank]
        if not attn_metadata.decode_groups and attn_metadata.meta.num_decodes:
            attn_metadata.decode_groups = self.decode_groups(attn_metadata.meta)
        return super().mla_decode(q, cache, rank, attn_metadata, scale)

    # --8<-- [start:cpu_decode]
    def forward(self, q, k, v, cache: PagedKV, attn_metadata: CpuAttentionMetadata, scale):
        d = attn_metadata.decode_lens.shape[0]
        out = super().forward(q, k, v, cache, attn_metadata, scale)  # the prompt chunks
        rows = attn_metadata.decode_rows
        if d and rows is None:  # one query per decode, at the start of the batch
            tables, lens = attn_metadata.decode_tables, attn_metadata.decode_lens
            out[:d] = torch.ops.deepinfer.paged_decode_attention(
                q[:d], cache.k, cache.v, tables, lens, scale, cache.k_scale, cache.v_scale
            )
        elif d:  # a step with drafts: every short query's token (_verify_metadata)
            tables, lens = attn_metadata.decode_tables, attn_metadata.decode_lens
            out[rows] = torch.ops.deepinfer.paged_decode_attention(
                q[rows], cache.k, cache.v, tables, lens, scale, cache.k_scale, cache.v_scale
            )
        return out

    # --8<-- [end:cpu_decode]
