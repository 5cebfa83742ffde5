"""DeepSeek-V4's KV compressor: one row for every ``rate`` tokens of a layer.

Each token projects a kv and a gate. Compression unit w (tokens w*m .. w*m + m-1)
becomes one row when its last token is computed: a softmax over the unit's gates
(plus a learned bias for each position in the unit, ``ape``), channel by channel,
weights the kv, and the sum is normed and rotated at position w*m. (The unit is
not the attention's sliding window, which is longer.)

With ``overlap`` (CSA's rate-4 units), kv and gate are twice as wide: the
second half is the token's part in its own unit's row, the first half its
part in the next unit's. So row w pools 2m positions, unit w-1's first halves
then unit w's second halves; row 0 has no unit before it (those positions get
weight 0, as transformers gives them).

The token's projections are kept in the layer's paged cache (the ``state``), so
a unit may close in a later step than its first tokens ran in, after a chunk
boundary, a preemption or a prefix-cache hit, and read them back there.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.kv.compressed_cache import ROW_GROUP, read, row_slots, slots, write
from engine.layers.partial_rope import PartialRope
from engine.layers.seq_spans import SeqSpan
from engine.layers.v4_norm import Float32RMSNorm


class Compressor(nn.Module):
    """Checkpoint names wkv, wgate, ape, norm (under attn.compressor, or
    attn.indexer.compressor for the indexer's own)."""

    def __init__(
        self,
        hidden: int,
        dim: int,
        rate: int,
        overlap: bool,
        rope: PartialRope,
        eps: float,
    ) -> None:
        super().__init__()
        width = (2 if overlap else 1) * dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width, dtype=torch.float32))
        self.norm = Float32RMSNorm(dim, eps)
        self.rope = rope

    def update(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        spans: list[SeqSpan],
        state: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Cache this step's tokens' projections, then write the row of every unit
        whose last token is among them, at the slots row_slots gives."""
        write(state, meta.slot_mapping, torch.cat([self.wkv(x), self.wgate(x)], dim=-1))
        m, block_size = self.rate, state.shape[1]
        for span in spans:
            lo, hi = span.start // m, span.end // m  # the units that close now
            if hi <= lo:
                continue
            table = meta.block_tables[span.seq]
            first = lo - 1 if self.overlap and lo > 0 else lo
            where = torch.arange(first * m, hi * m, device=x.device)
            pooled = self.pool(read(state, slots(table, where, block_size)), lo - first)
            closed = torch.arange(lo, hi, device=x.device)
            rows_out = self.rope(self.norm(pooled), closed * m)
            at = row_slots(meta.group_tables[ROW_GROUP][span.seq], closed, rows)
            write(rows, at, rows_out)

    def pool(self, states: torch.Tensor, skip: int) -> torch.Tensor:
        """states [units * m, 2 * width] of consecutive whole units -> the rows
        [units - skip, dim] of all but the first ``skip`` (0, or 1: a unit read
        only for its first halves)."""
        m, d = self.rate, self.dim
        kv, gate = states.unflatten(0, (-1, m)).chunk(2, dim=-1)
        gate = gate + self.ape
        if not self.overlap:
            weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
            return (kv * weights).sum(dim=1)
        n = len(kv) - skip
        slots_kv = kv.new_zeros(n, 2 * m, d)
        slots_gate = gate.new_full((n, 2 * m, d), float("-inf"))
        slots_kv[:, m:], slots_gate[:, m:] = kv[skip:, :, d:], gate[skip:, :, d:]
        prev = 1 - skip  # rows whose previous unit was not read: row 0 of the sequence
        slots_kv[prev:, :m], slots_gate[prev:, :m] = kv[: n - prev, :, :d], gate[: n - prev, :, :d]
        weights = slots_gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return (slots_kv * weights).sum(dim=1)
