"""Where each MoE layer's experts live across the expert-parallel ranks.

A layer has num_slots physical expert slots; slot s holds a copy of logical expert
phy2log[layer, s]. Rank r holds slots [r * per_rank, (r + 1) * per_rank). With more
slots than experts some experts have several replicas (redundant experts), and
their tokens are shared among the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.distributed.eplb import logical_maps, rebalance_experts


@dataclass
class ExpertPlacement:
    phy2log: torch.Tensor  # [moe layers, slots], int64
    num_ranks: int
    num_experts: int
    log2phy: torch.Tensor = field(init=False)  # [moe layers, experts, most replicas]; -1 pads
    logcnt: torch.Tensor = field(init=False)  # [moe layers, experts]: replicas of each

    def __post_init__(self) -> None:
        slots = self.phy2log.shape[1]
        if slots % self.num_ranks:
            raise ValueError(f"{slots} expert slots do not divide among {self.num_ranks} ranks")
        self.log2phy, self.logcnt = logical_maps(self.phy2log, self.num_experts)
        if (self.logcnt == 0).any():
            raise ValueError("a placement must give every logical expert at least one slot")

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_ranks: int) -> ExpertPlacement:
        """No redundant experts: expert e in slot e, consecutive experts on a rank."""
        return cls(torch.arange(num_experts).repeat(num_layers, 1), num_ranks, num_experts)

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.shape[1] // self.num_ranks

    def local_experts(self, rank: int) -> list[list[int]]:
        """For each layer, the logical expert in each of this rank's slots."""
        n = self.slots_per_rank
        return self.phy2log[:, rank * n : (rank + 1) * n].tolist()


def replica_slots(
    ids: torch.Tensor, turns: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor
) -> torch.Tensor:
    """The physical slot of each (token, expert) pair; ids: [tokens, top_k] logical
    experts. Replicas take an expert's tokens in turn: the n-th token this rank
    ever sends to expert e goes to replica n % logcnt[e]. turns[e] counts them."""
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # pairs by expert, in token order within each
    counts = torch.bincount(flat, minlength=len(turns))
    first = counts.cumsum(0) - counts  # where each expert's pairs start in that order
    nth = torch.empty_like(flat)
    nth[order] = torch.arange(len(flat), device=flat.device) - first[flat[order]]
    replica = (turns[flat] + nth) % logcnt[flat]
    turns += counts
    return log2phy[flat, replica].view_as(ids)


def rank_imbalance(slot_tokens: torch.Tensor, num_ranks: int) -> list[float]:
    """Per layer, from [layers, slots] rows each slot ran: the busiest rank's rows
    over the mean rank's (1.0 is perfect balance)."""
    per_rank = slot_tokens.double().view(len(slot_tokens), num_ranks, -1).sum(-1)
    mean = per_rank.mean(-1)
    ratio = per_rank.max(-1).values / mean.clamp(min=1e-12)
    return torch.where(mean > 0, ratio, 1.0).tolist()  # a layer with no load: balanced


def initial_placement(config) -> ExpertPlacement | None:
    """The placement a model starts with: None (every expert here, no slots) for one
    rank and no redundant experts; else one slot per expert in order, or, with
    redundant slots, EPLB's choice for an even load until one is recorded."""
    moe = config.hf_config.routed_experts()
    ranks, extra = config.expert_parallel_size, config.num_redundant_experts
    if moe is None or (ranks == 1 and extra == 0):
        return None
    layers = moe.num_layers
    if extra == 0:
        return ExpertPlacement.identity(layers, moe.num_experts, ranks)
    even = torch.ones(layers, moe.num_experts)
    phy2log, _, _ = rebalance_experts(even, moe.num_experts + extra, moe.num_groups, 1, ranks)
    return ExpertPlacement(phy2log, ranks, moe.num_experts)
