"""DeepSeek-V4's attention: one shared K = V head over a sliding window, and in
CSA and HCA layers compressed rows beside it.

Queries come through a low-rank latent (wq_a, q_norm, wq_b) and an unweighted
RMS norm per head; the one KV head is wkv then a norm. Both turn on their last
rope_dim numbers (engine/layers/partial_rope.py). Query t attends to

- the raw rows of the last ``sliding_window`` tokens (t - window, t];
- HCA: every compressed row closed by t (row s when s < (t + 1) // m);
- CSA: the compressed rows the lightning indexer chose for t;

with a learned per-head sink: one more logit in the softmax with no value, so a
head may attend to nothing. The output's rope slice is turned back at t, and a
grouped low-rank projection (wo_a per group of heads, then wo_b) maps it out.

In torch, on every backend: a step's one-token queries (decodes) all at once,
over contexts padded to the longest and masked (attend_decodes); a prompt chunk
or a verify step one sequence at a time (attend).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.context import get_forward_context
from engine.attention.metadata import AttentionMetadata
from engine.config.deepseek_v4 import CSA, SLIDING
from engine.config.model import ModelConfig
from engine.kv.compressed_cache import (
    ROW_GROUP,
    CompressedAttentionSpec,
    CompressedKV,
    batch_slots,
    read,
    row_slots,
    slots,
    write,
)
from engine.layers.compressor import Compressor
from engine.layers.partial_rope import PartialRope
from engine.layers.quantization.fp8 import Fp8Linear, fp8_linear
from engine.layers.seq_spans import SeqSpan, one_token_spans, seq_spans
from engine.layers.v4_indexer import V4Indexer, visible_rows
from engine.layers.v4_norm import Float32RMSNorm, unweighted_rms_norm


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, heads, dim] over keys = values [context, dim] where ``mask`` [n, context]
    allows, with one sink logit per head in the softmax -> [n, heads, dim]."""
    logits = torch.matmul(q.transpose(0, 1), keys.T) * scale  # [heads, n, context]
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.view(-1, 1, 1).expand(-1, len(q), 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1, dtype=combined.dtype)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys).transpose(0, 1)


def decode_sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """sink_attention for one query per sequence: q [seqs, heads, dim] over each
    sequence's keys = values [seqs, context, dim] where ``mask`` [seqs, context]
    allows -> [seqs, heads, dim]."""
    logits = torch.matmul(q, keys.transpose(1, 2)) * scale  # [seqs, heads, context]
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink = sinks.view(1, -1, 1).expand(len(q), -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1, dtype=combined.dtype)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys)


def window_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[n, context]: kv_pos in (q_pos - window, q_pos]."""
    gap = q_pos[:, None] - kv_pos[None, :]
    return (gap >= 0) & (gap < window)


def chosen_mask(chosen: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[n, num_rows]: the rows in each query's ``chosen`` [n, k] (-1: none)."""
    mask = torch.zeros(len(chosen), num_rows + 1, dtype=torch.bool, device=chosen.device)
    mask.scatter_(1, torch.where(chosen >= 0, chosen, num_rows), True)
    return mask[:, :num_rows]


class V4Attention(nn.Module):
    """Checkpoint names under layers.N.attn: wq_a, q_norm, wq_b, wkv, norm, wo_a,
    wo_b, attn_sink, and compressor.* and indexer.* where the layer has them."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        v4, hidden, eps = cfg.v4, cfg.hidden_size, cfg.rms_norm_eps
        assert v4 is not None
        self.kind, self.rate = v4.layer_types[layer], v4.rate(layer)
        self.heads, self.dim, self.window = cfg.num_attention_heads, v4.head_dim, v4.sliding_window
        self.groups, self.eps = v4.o_groups, eps
        self.widths = (v4.token_widths(layer), v4.row_widths(layer))
        self.wq_a = nn.Linear(hidden, v4.q_lora_rank, bias=False)
        self.q_norm = Float32RMSNorm(v4.q_lora_rank, eps)
        self.wq_b = nn.Linear(v4.q_lora_rank, self.heads * self.dim, bias=False)
        self.wkv = nn.Linear(hidden, self.dim, bias=False)
        self.norm = Float32RMSNorm(self.dim, eps)
        group_width = self.heads * self.dim // self.groups
        self.wo_a = nn.Linear(group_width, self.groups * v4.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.groups * v4.o_lora_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(self.heads, dtype=torch.float32))
        compressed = self.kind != SLIDING
        self.rope = PartialRope(v4.rope_dim, v4.compress_rope if compressed else v4.main_rope)
        self.compressor = (
            Compressor(hidden, self.dim, self.rate, self.kind == CSA, self.rope, eps)
            if compressed
            else None
        )
        self.indexer = (
            V4Indexer(
                hidden,
                v4.q_lora_rank,
                v4.index_n_heads,
                v4.index_head_dim,
                v4.index_topk,
                self.rate,
                self.rope,
                eps,
            )
            if self.kind == CSA
            else None
        )
        self.kv_cache: CompressedKV | None = None  # KVCachePool binds this layer's blocks

    def kv_cache_spec(self, dtype: torch.dtype) -> CompressedAttentionSpec:
        """Its widths per token and per row (V4Config.token_widths, row_widths); the
        pool keeps every layer's in one page per block (compressed_cache.py)."""
        (kv, state, index_state), (row, index_key) = self.widths
        return CompressedAttentionSpec(kv, state, index_state, row, index_key, self.rate)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        meta, cache = get_forward_context().meta, self.kv_cache
        assert cache is not None, "the KV pool binds the cache before the first step"
        spans = seq_spans(meta)
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(len(x), self.heads, self.dim)
        q = self.rope(unweighted_rms_norm(q, self.eps), positions)
        write(cache.kv, meta.slot_mapping, self.rope(self.norm(self.wkv(x)), positions))
        chosen = None
        if self.compressor is not None:
            assert cache.state is not None and cache.rows is not None
            self.compressor.update(x, meta, spans, cache.state, cache.rows)
        if self.indexer is not None:
            chosen = self.indexer(x, q_latent, positions, meta, spans, cache)
        out = torch.empty_like(q)
        decodes, others = one_token_spans(spans)
        if decodes:  # every one-token query at once, padded to the longest context
            rows = torch.tensor([s.rows.start for s in decodes], device=q.device)
            picks = None if chosen is None else chosen[rows]
            out[rows] = self.attend_decodes(q[rows], decodes, meta, picks)
        for span in others:
            picks = None if chosen is None else chosen[span.rows]
            out[span.rows] = self.attend(q[span.rows], span, meta, picks)
        return self.project(self.rope(out, positions, inverse=True))

    def attend_decodes(
        self, q: torch.Tensor, spans: list[SeqSpan], meta: AttentionMetadata, chosen
    ) -> torch.Tensor:
        """Sequences with one new token each, batched: q [seqs, heads, dim] over each
        one's last ``window`` raw rows and its compressed rows, padded to the
        longest and masked; the same keys and masks as attend() gives one of them."""
        cache, device = self.kv_cache, q.device
        assert cache is not None
        ends = torch.tensor([s.end for s in spans], device=device)
        tables = meta.block_tables[[s.seq for s in spans]].long()
        width = min(self.window, max(s.end for s in spans))
        kv_pos = ends[:, None] - width + torch.arange(width, device=device)  # [seqs, width]
        mask = kv_pos >= 0
        keys = read(cache.kv, batch_slots(tables, kv_pos.clamp(min=0), cache.kv.shape[1]))
        most = max(s.end for s in spans) // self.rate if self.compressor is not None else 0
        if most > 0:
            assert cache.rows is not None
            rows = torch.arange(most, device=device).expand(len(spans), most)
            row_tables = meta.group_tables[ROW_GROUP][[s.seq for s in spans]].long()
            keys = torch.cat(
                [keys, read(cache.rows, batch_slots(row_tables, rows, cache.rows.shape[1]))], 1
            )
            seen = rows < (ends // self.rate)[:, None]  # the rows closed by each query
            mask = torch.cat(
                [mask, seen if chosen is None else seen & chosen_mask(chosen, most)], 1
            )
        return decode_sink_attention(q, keys, mask, self.attn_sink, self.dim**-0.5)

    def attend(
        self, q: torch.Tensor, span: SeqSpan, meta: AttentionMetadata, chosen: torch.Tensor | None
    ) -> torch.Tensor:
        """One sequence's queries over its window's raw rows and its compressed rows."""
        cache, device = self.kv_cache, q.device
        assert cache is not None
        block_size = cache.kv.shape[1]
        q_pos = span.positions(device)
        kv_pos = torch.arange(max(0, span.start - self.window + 1), span.end, device=device)
        keys = read(cache.kv, slots(meta.block_tables[span.seq], kv_pos, block_size))
        mask = window_mask(q_pos, kv_pos, self.window)
        if self.compressor is not None and span.end >= self.rate:
            assert cache.rows is not None
            num_rows = span.end // self.rate
            rows = torch.arange(num_rows, device=device)
            where = row_slots(meta.group_tables[ROW_GROUP][span.seq], rows, cache.rows)
            keys = torch.cat([keys, read(cache.rows, where)])
            rows_mask = (
                visible_rows(q_pos, num_rows, self.rate)
                if chosen is None
                else chosen_mask(chosen, num_rows)
            )
            mask = torch.cat([mask, rows_mask], dim=1)
        return sink_attention(q, keys, mask, self.attn_sink, self.dim**-0.5)

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """The grouped low-rank output: each group of heads through its own slice of
        wo_a, [tokens, groups * o_lora_rank], then wo_b."""
        groups = out.reshape(len(out), self.groups, -1).transpose(0, 1)  # [groups, tokens, width]
        if isinstance(self.wo_a, Fp8Linear):  # each group through its rows, read as FP8
            q, scales = self.wo_a.weight, self.wo_a.weight_scale_inv
            r = self.wo_a.out_features // self.groups
            parts = [
                fp8_linear(groups[g], q[g * r : (g + 1) * r], scales[g * r : (g + 1) * r], None)
                for g in range(self.groups)
            ]
            return self.wo_b(torch.cat(parts, dim=1))
        w = self.wo_a.weight.view(self.groups, -1, groups.shape[-1]).transpose(1, 2)
        mixed = torch.bmm(groups, w).transpose(0, 1).flatten(1)
        return self.wo_b(mixed)
