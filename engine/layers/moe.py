"""A mixture-of-experts feed-forward layer, dropless, as DeepSeek-V3 runs it.

Every token goes through the shared experts, and through the top_k routed
experts its router picks. Dispatch is dropless: no expert has a capacity, so no
token is ever turned away, whatever the skew. The (token, expert) pairs are
sorted by expert, so that each expert runs one matmul on a contiguous slice of
rows; then every token sums its experts' outputs with the router's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.router import GroupedTopKRouter


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Experts(nn.Module):
    """The routed experts' weights, stacked: expert e is gate_up_proj[e], down_proj[e]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = SiluAndMul()
        # Tokens routed to each expert since the engine started; the model
        # runner binds this to a row of the engine's stats.
        self.token_counts = torch.zeros(num_experts, dtype=torch.int64)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden]; weights, ids: [tokens, top_k] from the router."""
        top_k = ids.shape[1]
        # Sort the (token, expert) pairs by expert; a stable sort keeps token order.
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
        self.token_counts += counts.to(self.token_counts.device)
        rows = x[order // top_k]  # a token appears once for each of its experts
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts.tolist()):  # each expert: one contiguous slice
            if n:
                h = self.act(rows[start : start + n] @ self.gate_up_proj[e].T)
                out[start : start + n] = h @ self.down_proj[e].T
            start += n
        # Unsort, then sum each token's top_k outputs with their weights.
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        mixed = (unsorted.view(len(x), top_k, -1).float() * weights[..., None]).sum(1)
        return mixed.to(x.dtype)


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_shared_experts: int,
        gate: GroupedTopKRouter,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = Experts(gate.num_experts, hidden_size, intermediate_size)
        self.shared_experts = GatedMLP(hidden_size, intermediate_size * num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x)
