"""DeepSeek-V4's mixture of experts: two routers, and SwiGLU clipped at swiglu_limit.

Every V4 layer is MoE. A top-k layer scores each expert (sqrt(softplus(logit))
by default, V4's scoring_func) and picks the top_k by score plus a balancing
bias; a hash layer picks a fixed set per token id (the frozen ``tid2eid`` table),
and only the weights come from the scores. Either way the chosen scores are
normalised to sum to 1 and scaled by routed_scaling_factor.

The routed experts and the shared one clip their gate at swiglu_limit (above
only) and their up projection at +-swiglu_limit before silu(gate) * up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.moe import Experts, GatedMLP


class ClippedSiluAndMul(nn.Module):
    """silu(min(gate, limit)) * clamp(up, -limit, limit) on [gate | up]."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)


def score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.sigmoid()


class V4Router(nn.Module):
    """The gate: ``weight`` scores experts; a top-k layer has ``bias`` (to choose
    only), a hash layer ``tid2eid`` [vocab, top_k] (the choice itself)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring_func: str,
        scaling: float,
        vocab_size: int | None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring_func, self.scaling = scoring_func, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.hashed = vocab_size is not None
        if self.hashed:
            table = torch.zeros(vocab_size, top_k, dtype=torch.int64)
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        else:
            bias = torch.zeros(num_experts, dtype=torch.float32)
            self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (weights, expert ids), each [tokens, top_k]."""
        scores = score(F.linear(x, self.weight), self.scoring_func)
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = (scores + self.bias).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class V4MoE(nn.Module):
    """Routed experts plus one shared expert, on every token."""

    def __init__(self, hidden_size: int, intermediate_size: int, gate: V4Router, limit: float):
        super().__init__()
        self.gate = gate
        self.experts = Experts(gate.num_experts, hidden_size, intermediate_size)
        self.experts.act = ClippedSiluAndMul(limit)
        self.shared_experts = GatedMLP(hidden_size, intermediate_size)
        self.shared_experts.act = ClippedSiluAndMul(limit)
        self.ep = None  # an ExpertParallel once the experts are placed on ranks

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:  # experts placed on ranks: engine/distributed/
            return self.ep.forward(self, x, input_ids)
        weights, ids = self.gate(x, input_ids)
        return self.experts(x, weights, ids) + self.shared_experts(x)

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) for each token of x, whose ids a hash layer reads."""
        if input_ids is None:
            raise ValueError("a DeepSeek-V4 MoE layer routes by token id: pass input_ids")
        return self.gate(x, input_ids)
