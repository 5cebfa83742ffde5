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
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    context_lens_cpu: list[int] = field(default_factory=list)
    query_lens_cpu: list[int] = field(default_factory=list)
