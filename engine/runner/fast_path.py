"""The seam the two fast paths for decode steps share: CUDA graphs on a GPU
(cuda_graph.py) and the compiled decode on a CPU (compiled_decode.py). A runner
has at most one; a step it cannot run goes through the model as it is."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.attention.metadata import AttentionMetadata


class DecodeFastPath(Protocol):
    # True: it replays kernels captured over buffers of its own, so the backend
    # need not build this step's metadata.
    builds_own_metadata: bool

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Can this step (decodes alone, one token each, of a size it serves) take it?"""
        ...

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """The step's last hidden states, as the model's forward would give them."""
        ...
