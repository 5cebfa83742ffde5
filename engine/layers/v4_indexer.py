"""DeepSeek-V4's lightning indexer: which compressed rows a CSA query attends to.

V3.2's indexer scored every token; V4's scores the CSA layer's compressed rows,
through keys of its own: a second compressor (engine/layers/compressor.py) at
index_head_dim over the same overlapping windows, cached beside the layer's rows
(``index_keys``). Query t scores row s as

    I(t, s) = sum_h w(t, h) * relu(q(t, h) . k(s)) / sqrt(index_head_dim)

with q from the query latent (wq_b), rotated at t with the compress RoPE, and
w(t) = weights_proj(x_t) / sqrt(index_n_heads). Row s closes at token s*m + m-1,
so query t may see rows s < (t + 1) // m; it keeps its index_topk best of those,
best first, and -1 past the ones it has. As in V3.2's indexer
(engine/layers/indexer.py), the choice depends on the request alone: scores
are summed in an order fixed by the query row (`index_scores`), and of exactly
equal scores the lower row wins (`best_first`), however the prompt was chunked,
even with a chunk boundary inside a compression window.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.kv.compressed_cache import ROW_GROUP, CompressedKV, batch_slots, read, row_slots
from engine.layers.compressor import Compressor
from engine.layers.indexer import SCORE_TILE, best_first, index_scores, pairwise_sum
from engine.layers.partial_rope import PartialRope
from engine.layers.seq_spans import SeqSpan, one_token_spans


def visible_rows(q_pos: torch.Tensor, num_rows: int, rate: int) -> torch.Tensor:
    """[n, num_rows]: may the query at each position see each compressed row?"""
    rows = torch.arange(num_rows, device=q_pos.device)
    return rows[None, :] < (q_pos[:, None] + 1) // rate


def top_rows(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Each query's best min(k, rows) visible rows [n, k], best first, -1 where it
    has fewer. Tie rule (`best_first`): of exactly equal scores, the lower row wins."""
    n, num_rows = scores.shape
    out = torch.full((n, k), -1, dtype=torch.int64, device=scores.device)
    if num_rows == 0:
        return out
    _, chosen = best_first(scores.masked_fill(~visible, float("-inf")), min(k, num_rows))
    ok = visible.gather(1, chosen)
    out[:, : chosen.shape[1]] = chosen.masked_fill(~ok, -1)
    return out


class V4Indexer(nn.Module):
    """Checkpoint names wq_b, weights_proj, compressor.* (under attn.indexer)."""

    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        heads: int,
        dim: int,
        topk: int,
        rate: int,
        rope: PartialRope,
        eps: float,
    ) -> None:
        super().__init__()
        self.heads, self.dim, self.topk, self.rate = heads, dim, topk, rate
        self.wq_b = nn.Linear(q_lora_rank, heads * dim, bias=False)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)
        self.compressor = Compressor(hidden, dim, rate, True, rope, eps)
        self.rope = rope

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        spans: list[SeqSpan],
        cache: CompressedKV,
    ) -> torch.Tensor:
        """The rows [tokens, index_topk] each query keeps (after caching this step's
        indexer states and closing its windows' keys)."""
        assert cache.index_state is not None and cache.index_keys is not None
        self.compressor.update(x, meta, spans, cache.index_state, cache.index_keys)
        q = self.rope(self.wq_b(q_latent).view(len(x), self.heads, self.dim), positions)
        w = self.weights_proj(x).float() * self.heads**-0.5
        out = torch.full((len(x), self.topk), -1, dtype=torch.int64, device=x.device)
        m = self.rate
        decodes, spans = one_token_spans(spans)
        if decodes:  # every one-token query at once
            rows = torch.tensor([s.rows.start for s in decodes], device=x.device)
            out[rows] = self.decode_rows(q[rows], w[rows], decodes, meta, cache.index_keys)
        for span in spans:
            num_rows = span.end // m
            rows = torch.arange(num_rows, device=x.device)
            where = row_slots(meta.group_tables[ROW_GROUP][span.seq], rows, cache.index_keys)
            keys = read(cache.index_keys, where)
            # relu(q.k) / sqrt(dim) = relu(q.k / sqrt(dim)): the scale is positive
            scores = index_scores(q[span.rows], w[span.rows], keys, self.dim**-0.5)
            visible = visible_rows(span.positions(x.device), num_rows, m)
            out[span.rows] = top_rows(scores, visible, self.topk)
        return out

    def decode_rows(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        spans: list[SeqSpan],
        meta: AttentionMetadata,
        index_keys: torch.Tensor,
    ) -> torch.Tensor:
        """The rows each of several one-token queries keeps [seqs, index_topk]: the
        scores index_scores gives each alone (the same products, summed in the same
        order), over every sequence's rows padded to the most."""
        ends = torch.tensor([s.end for s in spans], device=q.device)
        most = max(s.end for s in spans) // self.rate
        rows = torch.arange(most, device=q.device).expand(len(spans), most)
        tables = meta.group_tables[ROW_GROUP][[s.seq for s in spans]].long()
        keys = read(index_keys, batch_slots(tables, rows, index_keys.shape[1])).float()
        q, w = q.float(), w.float()
        scores = q.new_empty((len(spans), most))
        step = max(1, SCORE_TILE // max(1, self.heads * self.dim * most))
        for i in range(0, len(spans), step):  # at most SCORE_TILE products at once
            dots = pairwise_sum(q[i : i + step, :, None] * keys[i : i + step, None], -1)
            scored = w[i : i + step, :, None] * torch.relu(dots * self.dim**-0.5)
            scores[i : i + step] = pairwise_sum(scored, 1)
        return top_rows(scores, rows < (ends // self.rate)[:, None], self.topk)
