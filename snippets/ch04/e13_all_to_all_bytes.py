"""Experiment 13: all-to-all bytes per token, with and without node-limited routing.

Expert parallelism puts DeepSeek-V3's 256 routed experts on 8 nodes of 8 GPUs,
4 experts to a GPU, so that each of the router's 8 groups is one node. A
token's hidden state starts on one GPU. Dispatch sends it to the GPUs of its 8
experts, and combine sends their outputs back. Traffic between nodes crosses
the slower network (RDMA); traffic within a node uses NVLink.

What crosses nodes depends on how copies are counted: one copy per expert, one
per destination GPU, or one per destination node, forwarded inside that node
(DeepEP's normal kernels dispatch this way: RDMA to the node, then NVLink to the
GPUs). The tokens are synthetic, from a router with Experiment 12's middle skew
but this experiment's own seed, so they are not Experiment 12's tokens. The
experiment routes the same tokens twice: top-8 anywhere, and node-limited, the
best 4 groups (nodes) first. Dispatch is FP8 with a float32 scale per 128
values, and combine is BF16, as in DeepEP's published tests (its V1 docs).
"""

from __future__ import annotations

import math
import random

SEED = 13
EXPERTS = 256
GROUPS = 8
TOP_K = 8
NODES = GROUPS  # one group per node
GPUS_PER_NODE = 8
TOKENS = 2048
SKEW = 0.25  # Experiment 12's middle router
HIDDEN = 7168  # DeepSeek-V3's hidden_size
SCALE_BLOCK = 128  # values per FP8 scale
DISPATCH_BYTES = HIDDEN + HIDDEN // SCALE_BLOCK * 4  # FP8 values and fp32 scales
COMBINE_BYTES = HIDDEN * 2  # bf16
RDMA_GB_PER_S = 50  # one CX7 400 Gb/s card per GPU, as DeepEP's V1 docs put it
BATCH_PER_GPU = 4096  # tokens on each GPU in one prefill micro-batch
ROUTINGS = {"anywhere": GROUPS, "node-limited": 4}  # groups a token may use
TIME_LABEL = "RDMA ms"  # time on the network cards only: no NVLink, no compute


def popularity(seed: int = SEED) -> list[float]:
    rng = random.Random(f"{seed}-popularity")
    return [SKEW * rng.gauss(0.0, 1.0) for _ in range(EXPERTS)]


def route(scores: list[float], topk_groups: int) -> list[int]:
    """Grouped top-k, as in Experiment 12 (no bias)."""
    size = EXPERTS // GROUPS
    groups = [scores[g * size : (g + 1) * size] for g in range(GROUPS)]
    group_score = [sum(sorted(g)[-2:]) for g in groups]
    kept = sorted(range(GROUPS), key=lambda g: -group_score[g])[:topk_groups]
    candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
    return sorted(candidates, key=lambda e: -scores[e])[:TOP_K]


def gpu_of(expert: int) -> int:
    return expert // (EXPERTS // (NODES * GPUS_PER_NODE))


def node_of_gpu(gpu: int) -> int:
    return gpu // GPUS_PER_NODE


def remote_copies(experts: list[int], home_gpu: int) -> dict[str, int]:
    """Copies that leave the home node, counted three ways."""
    home = node_of_gpu(home_gpu)
    gpus = {gpu_of(e) for e in experts}
    return {
        "expert": sum(1 for e in experts if node_of_gpu(gpu_of(e)) != home),
        "gpu": sum(1 for g in gpus if node_of_gpu(g) != home),
        "node": len({node_of_gpu(g) for g in gpus} - {home}),
    }


def simulate(topk_groups: int) -> dict[str, float]:
    rng = random.Random(f"{SEED}-tokens")  # the same tokens for every routing
    offsets = popularity()
    totals = {"expert": 0, "gpu": 0, "node": 0}
    most_nodes = distinct = 0
    for _ in range(TOKENS):
        home_gpu = rng.randrange(NODES * GPUS_PER_NODE)
        scores = [1 / (1 + math.exp(-(o + rng.gauss(0.0, 1.0)))) for o in offsets]
        experts = route(scores, topk_groups)
        nodes = len({node_of_gpu(gpu_of(e)) for e in experts})
        most_nodes, distinct = max(most_nodes, nodes), distinct + nodes
        for way, n in remote_copies(experts, home_gpu).items():
            totals[way] += n
    out = {way: n / TOKENS for way, n in totals.items()}
    out["most_nodes"] = most_nodes
    out["distinct_nodes"] = distinct / TOKENS  # home node included
    return out


def kb(copies: float) -> float:
    """Cross-node kilobytes for this many copies: dispatch there, combine back."""
    return copies * (DISPATCH_BYTES + COMBINE_BYTES) / 1e3


def main() -> dict:
    print(f"{TOKENS} tokens, top-{TOP_K} of {EXPERTS} experts")
    print(f"on {NODES} nodes x {GPUS_PER_NODE} GPUs; a group is a node")
    print(f"one copy: {DISPATCH_BYTES:,} B there, {COMBINE_BYTES:,} B back")
    print()
    print("copies that leave the home node, per token")
    print(f"{'routing':<13} {'/expert':>7} {'/GPU':>6} {'/node':>6} {'max nodes':>10}")
    results: dict = {"tokens": TOKENS, "dispatch_bytes": DISPATCH_BYTES}
    results.update(combine_bytes=COMBINE_BYTES, nodes=NODES, rdma_gb_per_s=RDMA_GB_PER_S)
    results.update(batch_per_gpu=BATCH_PER_GPU, scale_block=SCALE_BLOCK)
    runs = {name: simulate(groups) for name, groups in ROUTINGS.items()}
    for name, r in runs.items():
        print(
            f"{name:<13} {r['expert']:>7.2f} {r['gpu']:>6.2f} {r['node']:>6.2f}"
            f" {r['most_nodes']:>10}"
        )
    print("distinct nodes per token, home included:")
    for name, r in runs.items():
        print(f"{name:<13} {r['distinct_nodes']:>7.2f}")
    print()
    print("cross-node KB per token; RDMA time alone")
    print("per MoE layer, in ms, for")
    print(f"{BATCH_PER_GPU:,} tokens a GPU at {RDMA_GB_PER_S} GB/s of RDMA")
    print(f"{'routing':<13} {'/expert':>7} {'/node':>6} {TIME_LABEL:>9}")
    for name, r in runs.items():
        ms = BATCH_PER_GPU * kb(r["node"]) * 1e3 / (RDMA_GB_PER_S * 1e9) * 1e3
        print(f"{name:<13} {kb(r['expert']):>7.1f} {kb(r['node']):>6.1f} {ms:>9.2f}")
        key = name.split("-")[0]
        results.update({f"{key}_{way}": value for way, value in r.items()})
        results[f"{key}_kb_expert"] = kb(r["expert"])
        results[f"{key}_kb_node"] = kb(r["node"])
        results[f"{key}_ms_node"] = ms
    saved = 1 - runs["node-limited"]["node"] / runs["anywhere"]["node"]
    print(f"node-limited routing sends {saved:.1%} fewer node copies")
    results["node_copies_saved"] = saved
    results["node_limit"] = ROUTINGS["node-limited"]
    return results


if __name__ == "__main__":
    main()
