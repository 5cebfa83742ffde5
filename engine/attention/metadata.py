"""One step's batch, as every attention backend sees it: built once per step
by the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """One step's batch, as attention sees it. The batch is flattened: the
    tokens of every scheduled sequence sit end to end, decodes first."""

    slot_mapping: torch.Tensor  # [tokens] cache slot for each new token's K and V
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, padded with -1
    context_lens: torch.Tensor  # [seqs] int32: tokens in the cache after this step
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32: where each sequence's queries start
    # The first num_decodes sequences have exactly one query token: the step's
    # decodes when decode_query_len is 1. Decodes with drafts have more, and go
    # through the backends' prompt path, which attends any query over a cached
    # context: then num_decodes is 0, though the decodes still come first.
    num_decodes: int
    context_lens_cpu: list[int] = field(default_factory=list)
    query_lens_cpu: list[int] = field(default_factory=list)
    decode_query_len: int = 1  # of this step's decodes (see decode_query_len()); 1 without drafts
    # With more than one KV-cache group (config/cache_groups.py): every group's
    # table by group index, each [seqs, max_blocks] int32 padded with -1, group 0's
    # being block_tables; empty for a cache of one group.
    group_tables: tuple[torch.Tensor, ...] = ()

    def decodes_only(self) -> bool:
        """Is every sequence of the step a decode (what CUDA graphs and the compiled
        decode replay), and of one query token each?"""
        return self.decode_query_len == 1 and self.num_decodes == len(self.query_lens_cpu)


def decode_query_len(num_drafts: int) -> int:
    """The one definition of a decode: a sequence whose step computes its newest
    token and its ``num_drafts`` drafts, so 1 + num_drafts query tokens. The
    scheduler counts decodes by it, the model runner orders the batch by it, and
    graphs and the compiled decode run only steps whose decodes have length 1."""
    return 1 + num_drafts


def for_decodes(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    context_lens_cpu: list[int],
    cu_seqlens_q: torch.Tensor | None = None,
) -> AttentionMetadata:
    """A step of decodes alone, one query token each: what a warm-up, a CUDA
    graph's capture or the compiled decode's first compile runs. Pass
    ``cu_seqlens_q`` to keep a static buffer; by default it is 0, 1, ..., n."""
    n = len(context_lens_cpu)
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=block_tables.device)
    return AttentionMetadata(
        slot_mapping,
        block_tables,
        context_lens,
        cu_seqlens_q,
        num_decodes=n,
        context_lens_cpu=list(context_lens_cpu),
        query_lens_cpu=[1] * n,
    )


def one_query_per_row(meta: AttentionMetadata) -> AttentionMetadata:
    """The step's attention as one-token decodes: every query token becomes a row
    with its sequence's block table and a context that ends at its own position.

    A prompt chunk's token at position p then attends over keys 0..p exactly as
    a decode at position p would, through the same kernel, whatever chunk or
    batch it came in. Causality is the context length: the step's keys are
    already in the cache, and each row stops at its own.

    A step of decodes alone is that already, and is returned as it is: a CUDA
    graph captured over static buffers must go on reading those buffers.
    """
    if meta.num_decodes == len(meta.query_lens_cpu):
        return meta
    contexts = [
        ctx - n + 1 + j
        for ctx, n in zip(meta.context_lens_cpu, meta.query_lens_cpu)
        for j in range(n)
    ]
    repeats = torch.tensor(meta.query_lens_cpu, device=meta.block_tables.device)
    tables = meta.block_tables.repeat_interleave(repeats, dim=0, output_size=len(contexts))
    lens = torch.tensor(contexts, dtype=torch.int32, device=tables.device)
    return for_decodes(meta.slot_mapping, tables, lens, contexts)
