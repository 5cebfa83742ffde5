"""DeepSeek-V3.2's lightning indexer: which cached tokens each query attends to.

It is a small attention of its own, run before MLA. Its queries have
``index_n_heads`` heads of ``index_head_dim`` numbers, projected from the
query latent that MLA's queries come from (q_a_layernorm's output); its key is
one vector per token, from the hidden state through wk and a LayerNorm, cached
beside the token's latent (engine/kv/sparse_cache.py). Both are rotated on
their first qk_rope_head_dim numbers, in the neox layout (split halves), not
MLA's interleaved one. Query t scores cached token s as

    I(t, s) = sum_h w(t, h) * relu(q(t, h) . k(s) / sqrt(index_head_dim))

with per-head weights w(t) = weights_proj(x_t) / sqrt(index_n_heads), and keeps
its ``index_topk`` best positions among those it may see (s <= t). A query with
fewer tokens than that before it keeps them all.

The choice depends on the request alone, never on the step it runs in. Each
score is summed in an order fixed by its own query row (`index_scores`), so
other sequences in the step, the number of query rows and the length of the
context scored leave its bits alone. Exact ties are common with few indexer
heads (a token whose every head is closed by the ReLU scores exactly 0), and
torch.topk keeps one tied token or another depending on the row's length, so
ties are broken by a rule instead (`best_first`): of equal scores, the lower
position wins. transformers' torch.topk picks among ties as its row length
falls, so where its boundary meets a tie its choice is arbitrary. The chosen
positions come out best first, padded with -1 when the context is shorter
than index_topk.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from engine.attention.context import get_forward_context
from engine.attention.metadata import AttentionMetadata
from engine.kv.sparse_cache import IndexedLatentKV, gather_index_keys, store_index_keys
from engine.layers.rotary_embedding import RotaryEmbedding

KEY_NORM_EPS = 1e-6  # k_norm's: transformers' value, not the config's


SCORE_TILE = 1 << 22  # products (query rows x heads x keys x dims) formed at once


def pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over ``dim`` in a fixed order: the second half added elementwise to
    the first (an odd last element carried as it is), again and again until one is
    left. Elementwise additions only, so each result's order of terms depends on
    the length of ``dim`` alone, not on the other dimensions or the device."""
    x = x.movedim(dim, -1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        summed = x[..., :half] + x[..., half : 2 * half]
        x = torch.cat([summed, x[..., 2 * half :]], dim=-1) if x.shape[-1] % 2 else summed
    return x[..., 0]


def index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, heads, dim], weights [n, heads], keys [context, dim] -> I [n, context],
    in float32 whatever the model's dtype (as transformers computes it).

    Score (t, s) is relu(pairwise_sum_d(q[t, h, d] * k[s, d]) * scale) per head,
    times w[t, h], pairwise-summed over heads: elementwise products and additions
    in an order fixed by the row alone, formed SCORE_TILE products at a time. A
    matmul would choose its order from the number of rows and keys, and a row's
    score would then change in its last bits with the step around it."""
    q, weights, keys = q.float(), weights.float(), keys.float()
    n, heads, dim = q.shape
    rows = max(1, SCORE_TILE // max(1, heads * dim * len(keys)))
    cols = max(1, SCORE_TILE // (heads * dim * rows))
    out = q.new_empty((n, len(keys)))
    for i in range(0, n, rows):
        for j in range(0, len(keys), cols):
            dots = pairwise_sum(q[i : i + rows, :, None] * keys[None, None, j : j + cols], -1)
            scored = weights[i : i + rows, :, None] * torch.relu(dots * scale)
            out[i : i + rows, j : j + cols] = pairwise_sum(scored, 1)
    return out


def best_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` highest scores of each row and their indices [n, k], best first.

    Tie rule: of exactly equal scores, the lower index (the earlier position) wins.
    A stable sort by descending score gives it, whatever torch.topk's algorithm
    would keep among ties (which depends on the row's length), so a query keeps
    the same tokens however its prompt was cut into chunks."""
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    return values[:, :k], order[:, :k]


def top_positions(scores: torch.Tensor, first: int, k: int) -> torch.Tensor:
    """Each query's best ``k`` positions [n, k], best first, ties to the lower
    position (`best_first`). Row j is the query at position first + j; positions
    after it are never chosen, and when fewer than k are visible the rest of the
    row is -1."""
    n, context = scores.shape
    q_pos = first + torch.arange(n, device=scores.device)
    visible = torch.arange(context, device=scores.device) <= q_pos[:, None]
    values, chosen = best_first(scores.masked_fill(~visible, float("-inf")), min(k, context))
    chosen = chosen.masked_fill(values == float("-inf"), -1)
    out = chosen.new_full((n, k), -1)
    out[:, : chosen.shape[1]] = chosen
    return out


def select_tokens(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: IndexedLatentKV,
    meta: AttentionMetadata,
    scale: float,
    k: int,
) -> torch.Tensor:
    """The positions [tokens, k] each query of the step keeps: every sequence's
    queries score the indexer keys of its whole context, read through its block
    table (this step's keys are stored already)."""
    out = torch.full((len(q), k), -1, dtype=torch.int64, device=q.device)
    starts = list(accumulate(meta.query_lens_cpu, initial=0))  # on the host: no GPU wait
    for i, (n, context) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        rows = slice(starts[i], starts[i] + n)
        keys = gather_index_keys(cache, meta.block_tables[i], context)
        scores = index_scores(q[rows], weights[rows], keys, scale)
        out[rows] = top_positions(scores, context - n, k)
    return out


class Indexer(nn.Module):
    """The indexer's projections and its choice; its keys live in the MLA layer's
    cache, which the caller passes in."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        rope_dim: int,
        topk: int,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.rope_dim, self.topk = rope_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=KEY_NORM_EPS)
        # Kept in float32, as transformers keeps it, whatever the model's dtype.
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False, dtype=torch.float32)
        self.scale = head_dim**-0.5
        # MLA's rotary embedding: the same frequencies, applied here in split halves.
        self.rotary_emb = rotary_emb

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        cache: IndexedLatentKV,
    ) -> torch.Tensor:
        """x [tokens, hidden], q_latent [tokens, q_lora_rank] -> each token's chosen
        positions [tokens, index_topk], -1 past the ones it has."""
        q = self.wq_b(q_latent).view(len(x), self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        r, ctx = self.rope_dim, get_forward_context()
        q_rot, k_rot = ctx.backend.rotary_embedding(
            positions, q[..., :r], k[:, None, :r], self.rotary_emb.cos_sin_cache
        )
        q = torch.cat([q_rot, q[..., r:]], dim=-1)
        k = torch.cat([k_rot[:, 0], k[:, r:]], dim=-1)
        weights = self.weights_proj(x.float()) * self.num_heads**-0.5
        store_index_keys(k, cache, ctx.meta.slot_mapping)
        return select_tokens(q, weights, cache, ctx.meta, self.scale, self.topk)
