"""EPLB in a running engine: the load recorded by every rank, a clock that
re-places the experts every eplb_interval steps, and the move itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.distributed.eplb import imbalance, rebalance_experts
from engine.distributed.expert_parallel import ExpertLoad
from engine.distributed.placement import ExpertPlacement, initial_placement, rank_imbalance
from engine.stats import EngineStats


class ExpertHost(Protocol):
    """What the balancer needs of the executor (engine/executor/): every rank's
    recorded load, a move to a new placement, and a call after each step."""

    after_step: Callable[[], None] | None

    def expert_load(self) -> ExpertLoad | None: ...

    def apply_placement(self, placement: ExpertPlacement) -> None: ...


@dataclass
class RebalanceReport:
    """One EPLB re-balance: per MoE layer, the busiest rank's tokens over the mean
    rank's, on the load recorded so far, with the old placement and the new."""

    imbalance_before: list[float]
    imbalance_after: list[float]
    placement: ExpertPlacement


@dataclass
class ExpertBalancer:
    config: EngineConfig
    executor: ExpertHost
    stats: EngineStats
    placement: ExpertPlacement | None = None  # where the routed experts are
    reports: list[RebalanceReport] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.placement = initial_placement(self.config)
        if self.config.enable_eplb:
            self.executor.after_step = self.clock

    def clock(self) -> None:
        """With enable_eplb, after each step's forward pass: re-place the experts
        every eplb_interval steps, before the next step runs."""
        if self.stats.steps % self.config.eplb_interval == 0:
            self.rebalance()

    def sync_stats(self) -> None:
        """Under expert parallelism each rank records its own share: sum them into
        stats.expert_tokens, and list each rank's bytes sent."""
        load = self.executor.expert_load()
        if load is None:
            return
        self.stats.expert_tokens = load.expert_tokens
        self.stats.expert_slot_tokens = load.slot_tokens
        self.stats.ep_dispatch_bytes = load.dispatch_bytes
        self.stats.ep_combine_bytes = load.combine_bytes

    def rank_imbalance(self) -> list[float] | None:
        """Per MoE layer, measured since the current placement began: the busiest
        rank's rows over the mean rank's. None without placed experts."""
        self.sync_stats()
        if self.placement is None:
            return None
        return rank_imbalance(self.stats.expert_slot_tokens, self.placement.num_ranks)

    def rebalance(self, num_redundant: int | None = None) -> RebalanceReport:
        """EPLB between steps: place the experts anew for the load recorded so far,
        with num_redundant slots per layer beyond one per expert (default: the
        config's), and move every rank to the new placement."""
        self.sync_stats()
        load = self.stats.expert_tokens
        if load is None:
            raise ValueError("this model has no experts to re-balance")
        moe, ranks = self.config.hf_config.routed_experts(), self.config.expert_parallel_size
        extra = self.config.num_redundant_experts if num_redundant is None else num_redundant
        old = self.placement or ExpertPlacement.identity(len(load), moe.num_experts, ranks)
        phy2log, _, _ = rebalance_experts(
            placed_load(load, moe.fixed_layers), moe.num_experts + extra, moe.num_groups, 1, ranks
        )
        new = ExpertPlacement(phy2log, ranks, moe.num_experts)
        self.executor.apply_placement(new)
        self.placement = new
        report = RebalanceReport(
            imbalance(load, old.phy2log, ranks), imbalance(load, phy2log, ranks), new
        )
        self.reports.append(report)
        return report


def placed_load(load: torch.Tensor, fixed_layers: tuple[int, ...]) -> torch.Tensor:
    """The load EPLB places experts for: the recorded one, but an even one for each
    layer whose routing is a fixed table of token ids (DeepSeek-V4's hash layers).
    Such a layer's experts are a function of each token's id alone, so its load
    moves only with which words the traffic holds, never with what the model
    computes, and re-placing it for one interval's traffic would move weights to
    chase the words that interval happened to use. It keeps the placement an even
    load gets, the one it started with."""
    placed = load.clone().float()
    placed[list(fixed_layers)] = 1.0
    return placed
