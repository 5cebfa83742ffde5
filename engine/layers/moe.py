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

from engine.layers import opaque
from engine.layers.activation import SiluAndMul
from engine.layers.gate import GroupedTopKRouter


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
    """The routed experts' weights, stacked: slot s is gate_up_proj[s], down_proj[s].

    Without expert parallelism slot e holds expert e. Under it, a rank holds only
    its slots, and slot_experts says which logical expert each one is a copy of.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts  # logical experts, whatever this rank holds
        self.slot_experts = list(range(num_experts))
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = SiluAndMul()
        # Tokens routed to each expert since the engine started; the model
        # runner binds this to a row of the engine's stats.
        self.token_counts = torch.zeros(num_experts, dtype=torch.int64)
        self.index = 0  # its place among the model's opaque layers (layers/opaque.py)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden]; weights, ids: [tokens, top_k] from the router."""
        if torch.compiler.is_compiling():  # opaque: its matmuls are sized on the host
            return torch.ops.deepinfer.moe_experts(x, weights, ids, self.index)
        return self.mix(x, weights, ids)

    def mix(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token through its experts, their outputs summed with its weights."""
        self.count(ids)
        # Pair p is token p // top_k with its (p % top_k)-th expert.
        out = self.run(x.repeat_interleave(ids.shape[1], dim=0), ids.flatten())
        return weighted_sum(out, weights)

    def count(self, ids: torch.Tensor) -> None:
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
        self.token_counts += counts.to(self.token_counts.device)

    def run(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Row i through the expert in slot slots[i]; outputs in the rows' order."""
        # Sort the rows by slot; a stable sort keeps token order within a slot.
        order = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=len(self.slot_experts))
        rows = rows[order]
        out = torch.empty_like(rows)
        start = 0
        for s, n in enumerate(counts.tolist()):  # each slot: one contiguous slice
            if n:
                h = self.act(self.project(rows[start : start + n], "gate_up_proj", s))
                out[start : start + n] = self.project(h, "down_proj", s)
            start += n
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return unsorted

    def project(self, x: torch.Tensor, stacked: str, slot: int) -> torch.Tensor:
        """x through one slot's gate_up_proj or down_proj (quantized experts, in
        layers/quantization/, read their own format here)."""
        return x @ self.get_parameter(stacked)[slot].T

    def place(self, slot_experts: list[int]) -> None:
        """Hold these logical experts' slots instead (weights to be loaded)."""
        self.slot_experts = list(slot_experts)
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(self, name)
            shape = (len(slot_experts), *old.shape[1:])
            new = torch.empty(shape, dtype=old.dtype, device=old.device)
            setattr(self, name, nn.Parameter(new, requires_grad=False))

    def slots_of(self, expert: int) -> list[int]:
        return [s for s, e in enumerate(self.slot_experts) if e == expert]


def weighted_sum(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[tokens * top_k, hidden] expert outputs in pair order -> [tokens, hidden]:
    each token's outputs summed with its router weights, in float32 at least."""
    pairs = out.view(len(weights), weights.shape[1], out.shape[-1])
    mixed = (pairs.to(weights.dtype) * weights[..., None]).sum(1)
    return mixed.to(out.dtype)


@torch.library.custom_op("deepinfer::moe_experts", mutates_args=())
def moe_experts_op(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: int
) -> torch.Tensor:
    """Experts.mix as one operator, for a compiled forward pass: each expert's
    matmul is sized from the routing, which a graph cannot know. It adds to the
    layer's token counts, unseen by the compiler, which nothing in the graph reads."""
    return opaque.layer(layer).mix(x, weights, ids)


@moe_experts_op.register_fake
def _(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


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
        self.ep = None  # an ExpertParallel once the experts are placed on ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:  # experts placed on ranks: engine/distributed/
            return self.ep.forward(self, x)
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x)

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) for each token of x; the token ids play no part."""
        return self.gate(x)
