"""What the engine asks of a model, declared rather than probed.

Every architecture subclasses ``CausalLM``: the model runner reads these
capabilities as plain attributes, and a model that has no routed experts says
so by returning none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.layers.moe import Experts


class CausalLM(nn.Module):
    supports_compile: ClassVar[bool] = False  # its decode step can run through torch.compile
    supports_packed_linears: ClassVar[bool] = False  # nothing reads its linears' weights
    supports_cuda_graphs: ClassVar[bool] = True  # its decode step can be captured

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:
        """Every layer with a paged cache, in the order the KV pool allocates them."""
        raise NotImplementedError

    def experts(self) -> list[Experts]:
        """The routed experts of every MoE layer; none for a dense model."""
        return []
