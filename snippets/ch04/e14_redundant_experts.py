"""Experiment 14: balanced packing with redundant experts, as EPLB does it.

A small teaching model of the two policies DeepSeek's EPLB describes, written
from its README. Both first give the heaviest experts extra replicas (the
redundant experts), splitting an expert's load evenly among its replicas, and
then pack the replicas onto GPUs so that every GPU holds as many as any other
and the loads come out even.

- Hierarchical: pack the expert groups onto nodes, replicate experts within
  each node, then pack each node's replicas onto its GPUs. A group stays on
  one node, so node-limited routing still reaches at most 4 nodes.
- Global: replicate over all experts, then pack onto all GPUs, ignoring groups.

The load is DeepSeek-V3's shape: 256 experts in 8 groups, and the prefill
deployment's 4 nodes of 8 GPUs. Each expert's token count is drawn from a
seeded skewed popularity. A placement is fitted to one batch's counts and then
measured on each of the next NEXT_BATCHES batches, drawn from the same
popularity, and averaged: the recorded load only estimates the coming one.
Imbalance is the busiest GPU's tokens over the mean GPU's.
"""

from __future__ import annotations

import random

SEED = 14
EXPERTS = 256
GROUPS = 8
TOKENS = 16384  # tokens in each batch
TOP_K = 8
LOAD_SKEW = 0.6  # spread of the experts' log-popularity
GPUS_PER_NODE = 8
# nodes -> spare slots (redundant experts); 4 nodes and 32 spares are
# DeepSeek's prefill deployment, 9 experts to a GPU.
DEPLOYMENTS = {4: [0, 32, 64], 8: [0, 64]}
NEXT_BATCHES = 8  # batches after the fitted one, each measured, then averaged


def popularity(seed: int = SEED) -> list[float]:
    rng = random.Random(f"{seed}-popularity")
    return [2.718281828 ** (LOAD_SKEW * rng.gauss(0.0, 1.0)) for _ in range(EXPERTS)]


def batch_load(batch: int) -> list[int]:
    """Tokens per expert: TOKENS * TOP_K draws from the popularity."""
    rng = random.Random(f"{SEED}-batch-{batch}")
    loads = [0] * EXPERTS
    for e in rng.choices(range(EXPERTS), weights=popularity(), k=TOKENS * TOP_K):
        loads[e] += 1
    return loads


def balanced_packing(weights: list[float], packs: int) -> list[int]:
    """Heaviest first, each to the lightest pack that still has room."""
    per_pack = len(weights) // packs
    load, count, where = [0.0] * packs, [0] * packs, [0] * len(weights)
    for item in sorted(range(len(weights)), key=lambda i: -weights[i]):
        pack = min((p for p in range(packs) if count[p] < per_pack), key=lambda p: load[p])
        where[item] = pack
        load[pack] += weights[item]
        count[pack] += 1
    return where


def replicate(weights: list[float], slots: int) -> list[int]:
    """Replica counts: each spare slot goes to the highest load per replica."""
    counts = [1] * len(weights)
    for _ in range(slots - len(weights)):
        e = max(range(len(weights)), key=lambda i: weights[i] / counts[i])
        counts[e] += 1
    return counts


def place(experts: list[int], load: list[int], slots: int, gpus: list[int]) -> list[tuple]:
    """Replicate these experts into slots, pack the replicas onto these GPUs:
    (expert, gpu, share of the expert's load) for every replica."""
    counts = replicate([load[e] for e in experts], slots)
    replicas = [(e, c) for e, c in zip(experts, counts) for _ in range(c)]
    where = balanced_packing([load[e] / c for e, c in replicas], len(gpus))
    return [(e, gpus[w], 1 / c) for (e, c), w in zip(replicas, where)]


def hierarchical(load: list[int], nodes: int, spares: int) -> list[tuple]:
    size = EXPERTS // GROUPS
    group_load = [sum(load[g * size : (g + 1) * size]) for g in range(GROUPS)]
    node_of_group = balanced_packing(group_load, nodes)
    placement = []
    for node in range(nodes):
        experts = [e for e in range(EXPERTS) if node_of_group[e // size] == node]
        gpus = list(range(node * GPUS_PER_NODE, (node + 1) * GPUS_PER_NODE))
        placement += place(experts, load, (EXPERTS + spares) // nodes, gpus)
    return placement


def node_floor(load: list[int], nodes: int) -> float:
    """Heaviest node over the mean once whole groups are packed onto nodes: no
    placement that keeps each group on one node can do better."""
    size = EXPERTS // GROUPS
    group_load = [sum(load[g * size : (g + 1) * size]) for g in range(GROUPS)]
    per_node = [0] * nodes
    for g, node in enumerate(balanced_packing(group_load, nodes)):
        per_node[node] += group_load[g]
    return max(per_node) / (sum(per_node) / nodes)


def global_policy(load: list[int], nodes: int, spares: int) -> list[tuple]:
    gpus = list(range(nodes * GPUS_PER_NODE))
    return place(list(range(EXPERTS)), load, EXPERTS + spares, gpus)


def identity(load: list[int], nodes: int, spares: int) -> list[tuple]:
    per_gpu = EXPERTS // (nodes * GPUS_PER_NODE)
    return [(e, e // per_gpu, 1.0) for e in range(EXPERTS)]


def imbalance(placement: list[tuple], load: list[int]) -> float:
    """Busiest GPU over the mean, replicas sharing their expert's tokens evenly."""
    per_gpu = [0.0] * (1 + max(gpu for _, gpu, _ in placement))
    for e, gpu, share in placement:
        per_gpu[gpu] += load[e] * share
    return max(per_gpu) / (sum(per_gpu) / len(per_gpu))


def nodes_per_group(placement: list[tuple]) -> int:
    """The most nodes any group's replicas are spread over."""
    size = EXPERTS // GROUPS
    spans = [
        {gpu // GPUS_PER_NODE for e, gpu, _ in placement if e // size == g} for g in range(GROUPS)
    ]
    return max(len(s) for s in spans)


def main() -> dict:
    fit = batch_load(0)
    tests = [batch_load(b) for b in range(1, NEXT_BATCHES + 1)]
    print(f"{EXPERTS} experts in {GROUPS} groups; {GPUS_PER_NODE} GPUs a node")
    print(f"{TOKENS:,} tokens x top-{TOP_K} a batch; fitted on one batch,")
    print(f"measured on it and, averaged, on the next {NEXT_BATCHES}")
    print("batches; busiest GPU / mean")
    policies = {"identity": identity, "hierarchical": hierarchical, "global": global_policy}
    results: dict = {"experts": EXPERTS, "groups": GROUPS, "tokens": TOKENS}
    results["gpus_per_node"] = GPUS_PER_NODE
    results["next_batches"] = NEXT_BATCHES
    for nodes, spares_list in DEPLOYMENTS.items():
        gpus = nodes * GPUS_PER_NODE
        print()
        floor = node_floor(fit, nodes)
        print(f"EP{gpus}: {nodes} nodes, {EXPERTS // gpus} experts a GPU")
        print(f"groups packed on nodes: heaviest node {floor:.3f}")
        results[f"ep{gpus}_node_floor"] = floor
        print(f"{'policy':<13} {'spares':>6} {'fitted':>7} {'next':>6} {'nodes/grp':>10}")
        for name, policy in policies.items():
            for spares in spares_list[:1] if name == "identity" else spares_list:
                placement = policy(fit, nodes, spares)
                assert len(placement) == EXPERTS + spares
                after = sum(imbalance(placement, t) for t in tests) / NEXT_BATCHES
                row = (imbalance(placement, fit), after)
                span = nodes_per_group(placement)
                print(f"{name:<13} {spares:>6} {row[0]:>7.3f} {row[1]:>6.3f} {span:>10}")
                key = f"ep{gpus}_{name}_{spares}"
                results.update({f"{key}_fitted": row[0], f"{key}_next": row[1]})
                results[f"{key}_nodes_per_group"] = span
    return results


if __name__ == "__main__":
    main()
