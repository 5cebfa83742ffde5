"""One rank's share of the routed experts: where they are placed, what its MoE
layers counted, and the bytes it sent. The model runner holds one, so that the
runner itself knows nothing of placements."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.distributed.expert_parallel import ExpertLoad, TrafficCounters, attach
from engine.distributed.placement import ExpertPlacement, initial_placement
from engine.models.base import CausalLM
from engine.models.loader import model_weights
from engine.stats import EngineStats


class RankExperts:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.placement = initial_placement(config)  # None: every expert in one slot, here
        self.traffic = TrafficCounters()
        self.expert_tokens: torch.Tensor | None = None  # [MoE layers, experts] this rank's

    def local_experts(self) -> list[list[int]] | None:
        """The logical expert of each slot this rank holds, per MoE layer; None: all."""
        return self.placement.local_experts(self.rank) if self.placement else None

    def bind(self, model: CausalLM, stats: EngineStats, device: torch.device) -> None:
        """Every MoE layer counts its tokens into a row of one tensor in the stats;
        under expert parallelism each layer also exchanges rows with the other ranks."""
        self.model, self.device = model, device
        experts = model.experts()
        if experts:
            counts = torch.zeros(
                len(experts), experts[0].num_experts, dtype=torch.int64, device=device
            )
            for row, layer in zip(counts, experts):
                layer.token_counts = row
            # This rank's routing; under expert parallelism the engine's stats get
            # the sum over ranks (ExpertBalancer.sync_stats).
            self.expert_tokens = stats.expert_tokens = counts
        if self.placement is not None:
            self.traffic = attach(model, self.placement, self.rank, device)

    def load(self) -> ExpertLoad | None:
        """What this rank's MoE layers recorded: tokens routed per logical expert,
        rows run per physical slot, and bytes sent to other ranks."""
        if self.expert_tokens is None:
            return None
        slots = None
        if self.placement is not None:
            slots = torch.stack([moe.ep.slot_tokens for moe in self.model.moe_layers()])
        return ExpertLoad(
            self.expert_tokens.cpu(),
            slots,
            [self.traffic.dispatch_bytes],
            [self.traffic.combine_bytes],
        )

    def apply(self, placement: ExpertPlacement) -> None:
        """Between steps: hold this rank's slots of a new placement, read their
        experts' weights from the checkpoint, and count slot loads afresh."""
        self.placement = placement
        self.model.place_experts(placement.local_experts(self.rank))
        names = model_weights(Path(self.config.model), self.model, self.model.wants_weight)
        with torch.no_grad():
            self.model.load_weights(names, only_experts=True)
        traffic = self.traffic
        self.traffic = attach(self.model, placement, self.rank, self.device)
        self.traffic.dispatch_bytes = traffic.dispatch_bytes  # bytes are since start-up
        self.traffic.combine_bytes = traffic.combine_bytes
