"""The torch backend's batch-invariant attention: every query alone, keys in fixed splits.

The reference backend batches decodes of similar length and pads them, and runs
a prompt chunk as one attention call; both choose the order of a query's sums
from its company. Here every query token is a row of its own (see
`engine.attention.metadata.one_query_per_row`), and its keys are read in splits of
KV_SPLIT positions counted from the sequence's start. Each split's scores and
weighted values are sums along the last dimension, whose order torch fixes by
that dimension's length alone; the splits are merged in order, as the Triton
decode kernel's second stage merges its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, one_query_per_row
from engine.attention.torch_backend import TorchBackend
from engine.kv.kv_cache import PagedKV
from engine.utils import cdiv

KV_SPLIT = 32  # key positions per split: the same cut for every query of every step


@dataclass
class KVSplit:
    """Split s of every query whose context reaches it."""

    rows: torch.Tensor  # [n] the queries
    slots: torch.Tensor  # [n, KV_SPLIT] cache slots of positions s*KV_SPLIT onwards
    valid: torch.Tensor  # [n, 1, 1, KV_SPLIT] positions inside each query's context


@dataclass
class SplitKVMetadata:
    splits: list[KVSplit]


class TorchSplitKVBackend(TorchBackend):
    name = "torch"

    def build_metadata(self, meta: AttentionMetadata) -> SplitKVMetadata:
        """Every split's rows and slots, computed once for all layers."""
        meta = one_query_per_row(meta)
        tables, lens, bs = meta.block_tables.long(), meta.context_lens.long(), self.block_size
        splits = []
        for s in range(cdiv(max(meta.context_lens_cpu), KV_SPLIT)):
            start = s * KV_SPLIT
            rows = torch.tensor(
                [i for i, n in enumerate(meta.context_lens_cpu) if n > start],
                device=tables.device,
            )
            pos = torch.arange(start, start + KV_SPLIT, device=tables.device)
            valid = pos < lens[rows, None]
            blocks = tables[rows[:, None], (pos // bs).clamp(max=tables.shape[1] - 1)]
            slots = blocks.clamp(min=0) * bs + pos % bs  # padding reads block 0, masked
            splits.append(KVSplit(rows, slots, valid[:, None, None, :]))
        return SplitKVMetadata(splits)

    def forward(self, q, k, v, cache: PagedKV, attn_metadata: SplitKVMetadata, scale):
        """q: [tokens, heads, head_dim], one query per row; the result has its shape."""
        tokens, heads, dim = q.shape
        kv_heads = cache.k.shape[2]
        qs = q.view(tokens, kv_heads, heads // kv_heads, 1, dim)  # GQA groups
        m = q.new_full((tokens, kv_heads, heads // kv_heads), float("-inf"))
        denom = q.new_zeros(m.shape)
        acc = q.new_zeros((*m.shape, dim))
        for split in attn_metadata.splits:
            m_s, denom_s, o_s = attend_split(qs[split.rows], cache, split, scale)
            merge_split(split.rows, m_s, denom_s, o_s, m, denom, acc)
        return (acc / denom[..., None]).view(tokens, heads, dim)


def attend_split(q: torch.Tensor, cache: PagedKV, split: KVSplit, scale: float):
    """One split of keys for some queries: the scores' max, the sum of their
    exponentials, and the exponentials' weighted sum of values, normalised by
    neither. Every sum runs along the last dimension, of a fixed length."""
    kv_heads, dim = cache.k.shape[2], cache.k.shape[3]
    keys = cache.k.view(-1, kv_heads, dim)[split.slots]  # [n, KV_SPLIT, kv_heads, dim]
    values = cache.v.view(-1, kv_heads, dim)[split.slots]
    keys = keys.permute(0, 2, 1, 3)[:, :, None]  # [n, kv_heads, 1, KV_SPLIT, dim]
    scores = (q * keys).sum(-1) * scale  # [n, kv_heads, group, KV_SPLIT]
    scores = scores.masked_fill(~split.valid, float("-inf"))
    m = scores.amax(-1)
    p = torch.exp(scores - m[..., None])
    values = values.permute(0, 2, 3, 1)[:, :, None]  # [n, kv_heads, 1, dim, KV_SPLIT]
    return m, p.sum(-1), (p[..., None, :] * values).sum(-1)


def merge_split(rows, m_s, denom_s, o_s, m, denom, acc) -> None:
    """Fold a split into its rows' running max, denominator and output, in place."""
    m_old = m[rows]
    m_new = torch.maximum(m_old, m_s)
    old, new = torch.exp(m_old - m_new), torch.exp(m_s - m_new)
    acc[rows] = acc[rows] * old[..., None] + o_s * new[..., None]
    denom[rows] = denom[rows] * old + denom_s * new
    m[rows] = m_new
