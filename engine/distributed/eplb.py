"""The expert-parallel load balancer (EPLB): which experts to copy, and where.

Written from the policy DeepSeek published with its EPLB (github.com/deepseek-ai/EPLB,
README), behind the same signature. Given each layer's recorded load per logical
expert, it chooses num_replicas physical slots, num_replicas // num_gpus on each
GPU. A heavy expert gets several slots (redundant experts), and the replicas are
packed so that the GPUs' loads come out as even as a greedy packing can make them.

Two policies:
- hierarchical, when the nodes divide the expert groups: pack whole groups onto
  nodes, so that group-limited routing keeps each token on few nodes; replicate
  the heaviest experts within each node; pack the node's replicas onto its GPUs;
- global, otherwise: replicate over all experts and pack onto all GPUs.
"""

from __future__ import annotations

import torch


def balanced_packing(loads: list[float], num_packs: int) -> list[int]:
    """Put loads.size // num_packs items in each pack, heaviest item first, each
    into the lightest pack that still has room. Returns each item's pack."""
    per_pack = len(loads) // num_packs
    pack_load, pack_size = [0.0] * num_packs, [0] * num_packs
    where = [0] * len(loads)
    for item in sorted(range(len(loads)), key=lambda i: -loads[i]):  # stable on ties
        open_packs = [p for p in range(num_packs) if pack_size[p] < per_pack]
        p = min(open_packs, key=lambda p: pack_load[p])
        where[item] = p
        pack_load[p] += loads[item]
        pack_size[p] += 1
    return where


def replicate(loads: list[float], num_slots: int) -> list[int]:
    """Replica counts: one each, then every spare slot to the expert whose
    replicas carry the most load each."""
    counts = [1] * len(loads)
    for _ in range(num_slots - len(loads)):
        e = max(range(len(loads)), key=lambda e: loads[e] / counts[e])
        counts[e] += 1
    return counts


def place_layer(
    loads: list[float], num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> list[int]:
    """One layer's physical-to-logical map: slot s holds logical expert result[s];
    GPU g holds slots [g * per_gpu, (g + 1) * per_gpu)."""
    group_size = len(loads) // num_groups
    group_loads = [sum(loads[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_of_group = balanced_packing(group_loads, num_nodes)  # 1. groups onto nodes
    gpus_per_node = num_gpus // num_nodes
    phy2log: list[int] = []
    for node in range(num_nodes):
        # 2. replicate the heaviest experts within the node
        experts = [e for e in range(len(loads)) if node_of_group[e // group_size] == node]
        counts = replicate([loads[e] for e in experts], num_replicas // num_nodes)
        count = dict(zip(experts, counts))
        replicas = [e for e in experts for _ in range(count[e])]
        shares = [loads[e] / count[e] for e in replicas]
        gpu_of = balanced_packing(shares, gpus_per_node)  # 3. replicas onto GPUs
        for gpu in range(gpus_per_node):
            phy2log += sorted(e for e, g in zip(replicas, gpu_of) if g == gpu)
    return phy2log


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight: [layers, logical experts], the recorded load. Returns phy2log
    [layers, num_replicas], log2phy [layers, logical experts, most replicas] (-1
    pads), and logcnt [layers, logical experts], each expert's replica count."""
    layers, num_experts = weight.shape
    if num_replicas % num_gpus or num_gpus % num_nodes:
        raise ValueError("num_replicas must be a multiple of num_gpus, and num_gpus of num_nodes")
    if num_replicas < num_experts or num_experts % num_groups:
        raise ValueError("every expert needs a slot, and the groups must divide the experts")
    if num_groups % num_nodes:  # groups cannot stay whole on nodes: the global policy
        num_groups, num_nodes = 1, 1
    if (num_replicas // num_nodes) < num_experts // num_nodes:
        raise ValueError("each node needs a slot for every expert of its groups")
    loads = weight.double().tolist()
    phy2log = torch.tensor(
        [place_layer(row, num_replicas, num_groups, num_nodes, num_gpus) for row in loads]
    ).view(layers, num_replicas)
    log2phy, logcnt = logical_maps(phy2log, num_experts)
    return phy2log, log2phy, logcnt


def logical_maps(phy2log: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From [layers, slots] physical-to-logical: log2phy [layers, experts, most
    replicas], each expert's slots in increasing order (-1 pads), and logcnt."""
    logcnt = torch.stack([torch.bincount(row, minlength=num_experts) for row in phy2log])
    log2phy = torch.full((*logcnt.shape, int(logcnt.max())), -1, dtype=torch.int64)
    for layer, row in enumerate(phy2log.tolist()):
        seen = [0] * num_experts
        for slot, e in enumerate(row):
            log2phy[layer, e, seen[e]] = slot
            seen[e] += 1
    return log2phy, logcnt


def imbalance(loads: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> list[float]:
    """Per layer, the busiest GPU's tokens over the mean GPU's, when each expert's
    tokens are shared evenly by its replicas: 1.0 is perfect balance."""
    out = []
    for row, slots in zip(loads.double(), phy2log):
        counts = torch.bincount(slots, minlength=len(row)).double()
        per_gpu = (row / counts)[slots].view(num_gpus, -1).sum(1)
        out.append(float(per_gpu.max() / per_gpu.mean()) if per_gpu.sum() > 0 else 1.0)
    return out
