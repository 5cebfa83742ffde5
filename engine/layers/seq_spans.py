"""Each sequence of a step, as layers that work one sequence at a time see it."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class SeqSpan:
    seq: int  # its row of the step's block tables
    rows: slice  # its new tokens in the step's flattened batch
    start: int  # the position of its first new token
    end: int  # its tokens once this step is done (the context)

    def positions(self, device: torch.device) -> torch.Tensor:
        """The positions of its new tokens [n]."""
        return torch.arange(self.start, self.end, device=device)


def seq_spans(meta: AttentionMetadata) -> list[SeqSpan]:
    """The step's sequences, read from the host-side lengths (no GPU wait). Their
    contexts must be their real lengths: a kv_window's compacted tables are not."""
    starts = list(accumulate(meta.query_lens_cpu, initial=0))
    return [
        SeqSpan(i, slice(starts[i], starts[i] + n), context - n, context)
        for i, (n, context) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu))
    ]


def one_token_spans(spans: list[SeqSpan]) -> tuple[list[SeqSpan], list[SeqSpan]]:
    """The step's sequences with one new token (decodes), if there are two or
    more of them to batch, and the others."""
    decodes = [s for s in spans if s.end - s.start == 1]
    if len(decodes) < 2:
        return [], spans
    return decodes, [s for s in spans if s.end - s.start != 1]
