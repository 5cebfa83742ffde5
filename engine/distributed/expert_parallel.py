"""Expert parallelism: a MoE layer whose experts are spread over ranks.

Attention and the dense layers are replicated, so every rank holds the whole
batch. Each rank takes a contiguous share of the batch's tokens, routes them,
and sends each (token, expert) pair to the rank holding the expert's slot:
first the counts, then the rows, with torch.distributed's all_to_all_single.
Each rank runs its experts on what it received and sends the outputs back with
a second all-to-all; the sender weights and sums them in its tokens' order,
adds the shared experts, and an all-gather gives every rank the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed.placement import ExpertPlacement, replica_slots
from engine.layers.moe import Experts, weighted_sum


class RoutedMoE(Protocol):
    """A MoE layer as expert parallelism sees it: a router, routed experts, and
    shared experts that run on every token (engine/layers/moe.py's MoE, and
    DeepSeek-V4's V4MoE, whose router also reads the token ids)."""

    experts: Experts
    shared_experts: nn.Module

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class TrafficCounters:
    """Bytes this rank sent to other ranks, over all layers and steps (the
    all-gather that rebuilds the replicated batch is not counted: it belongs to
    replicated attention, not to expert parallelism)."""

    dispatch_bytes: int = 0  # counts, slot ids and hidden rows, to the experts
    combine_bytes: int = 0  # expert outputs, back to their tokens' ranks


@dataclass
class ExpertLoad:
    """What the MoE layers recorded, for one rank or summed over ranks."""

    expert_tokens: torch.Tensor  # [moe layers, logical experts]: (token, expert) pairs
    slot_tokens: torch.Tensor | None  # [moe layers, slots] rows each ran; None: no slots
    dispatch_bytes: list[int]  # per rank: bytes it sent to other ranks' experts
    combine_bytes: list[int]  # per rank: expert outputs it sent back

    @staticmethod
    def merge(loads: list[ExpertLoad]) -> ExpertLoad:
        """Every rank's, rank 0 first: tokens summed, bytes listed by rank."""
        slots = [ld.slot_tokens for ld in loads]
        return ExpertLoad(
            sum(ld.expert_tokens for ld in loads),
            None if slots[0] is None else sum(slots),
            [b for ld in loads for b in ld.dispatch_bytes],
            [b for ld in loads for b in ld.combine_bytes],
        )


@dataclass
class Route:
    """How one layer's pairs left this rank, so that their outputs can come back."""

    order: torch.Tensor  # pairs sorted by destination rank
    send_counts: list[int]  # pairs sent to each rank
    recv_counts: list[int]  # pairs received from each rank


def token_share(num_tokens: int, rank: int, world: int) -> tuple[int, int]:
    """This rank's contiguous slice [lo, hi) of the batch; the first ranks take one
    more token when the batch does not divide."""
    base, extra = divmod(num_tokens, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


class ExpertParallel:
    """One MoE layer's part in the expert-parallel group, on one rank."""

    def __init__(
        self,
        layer: int,
        placement: ExpertPlacement,
        rank: int,
        traffic: TrafficCounters,
        device: torch.device,
    ) -> None:
        self.rank, self.world = rank, placement.num_ranks
        self.per_rank = placement.slots_per_rank
        self.log2phy = placement.log2phy[layer].to(device)
        self.logcnt = placement.logcnt[layer].to(device)
        # Rows each of this layer's slots ran, since this placement: its load.
        self.slot_tokens = torch.zeros(placement.phy2log.shape[1], dtype=torch.int64)
        self.turns = torch.zeros(placement.num_experts, dtype=torch.int64, device=device)
        self.traffic = traffic

    def forward(
        self, moe: RoutedMoE, x: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The layer's output for the whole batch x, every rank alike: this rank
        routes its share of the tokens, its pairs go to their experts' ranks and
        come back, and the shares are gathered."""
        lo, hi = token_share(len(x), self.rank, self.world)
        mine = x[lo:hi]
        weights, ids = moe.route(mine, None if input_ids is None else input_ids[lo:hi])
        moe.experts.count(ids)
        slots = replica_slots(ids, self.turns, self.log2phy, self.logcnt)
        rows, local_slots, route = self.dispatch(mine, slots)
        out = self.combine(moe.experts.run(rows, local_slots), route)
        y = weighted_sum(out, weights) + moe.shared_experts(mine)
        return self.all_gather(y, len(x))

    def dispatch(
        self, x: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Route]:
        """Send each (token, slot) pair's row to the slot's rank. Returns the rows
        this rank received, the local slot of each, and the route they took."""
        top_k, flat = slots.shape[1], slots.flatten()
        dest = flat // self.per_rank
        order = dest.argsort(stable=True)  # grouped by rank, in token order within each
        send = torch.bincount(dest, minlength=self.world)
        recv = self.exchange(send, [1] * self.world, [1] * self.world)  # counts first
        route = Route(order, send.tolist(), recv.tolist())
        rows = self.exchange(x[order // top_k], route.recv_counts, route.send_counts)
        local = self.exchange(flat[order] % self.per_rank, route.recv_counts, route.send_counts)
        first = self.rank * self.per_rank
        self.slot_tokens[first : first + self.per_rank] += torch.bincount(
            local, minlength=self.per_rank
        ).cpu()
        self.traffic.dispatch_bytes += self.sent_bytes(send, x, flat)
        return rows, local, route

    def combine(self, out: torch.Tensor, route: Route) -> torch.Tensor:
        """Send the expert outputs back where their rows came from; returns them in
        the sender's pair order: [tokens * top_k, hidden]."""
        back = self.exchange(out, route.send_counts, route.recv_counts)
        pairs = torch.empty_like(back)
        pairs[route.order] = back
        others = sum(n for r, n in enumerate(route.recv_counts) if r != self.rank)
        self.traffic.combine_bytes += others * out.shape[1] * out.element_size()
        return pairs

    def exchange(
        self, t: torch.Tensor, recv_counts: list[int], send_counts: list[int]
    ) -> torch.Tensor:
        """all_to_all_single: send_counts[r] rows of t to rank r, recv_counts[r] from it."""
        out = t.new_empty(sum(recv_counts), *t.shape[1:])
        if self.world == 1:
            out.copy_(t)
        else:
            dist.all_to_all_single(out, t.contiguous(), recv_counts, send_counts)
        return out

    def all_gather(self, y: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every rank's share of the layer's output, joined in token order."""
        if self.world == 1:
            return y
        width = token_share(num_tokens, 0, self.world)[1]  # rank 0's share is the largest
        padded = y.new_zeros(width, *y.shape[1:])
        padded[: len(y)] = y
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        shares = [token_share(num_tokens, r, self.world) for r in range(self.world)]
        sizes = [hi - lo for lo, hi in shares]
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    def sent_bytes(self, send: torch.Tensor, x: torch.Tensor, flat: torch.Tensor) -> int:
        """Dispatch bytes bound for other ranks: a count, a slot id and a row per pair."""
        pairs = int(send.sum()) - int(send[self.rank])
        row = x.shape[1] * x.element_size() + flat.element_size()
        return (self.world - 1) * send.element_size() + pairs * row


def attach(
    model: torch.nn.Module, placement: ExpertPlacement, rank: int, device
) -> TrafficCounters:
    """Give every MoE layer of ``model`` its part of ``placement``; the traffic
    counters they share."""
    traffic = TrafficCounters()
    for layer, moe in enumerate(model.moe_layers()):
        moe.ep = ExpertParallel(layer, placement, rank, traffic, device)
    return traffic


def broadcast_from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` on every rank of the expert-parallel group (every rank passes
    a tensor of the same shape and dtype); ``t`` itself outside a group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    t = t.contiguous()
    dist.broadcast(t, src=0)
    return t
