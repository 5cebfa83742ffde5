"""Experiment 12: routing skew. How unevenly do tokens spread over 256 experts?

DeepSeek-V3 routes every token to 8 of its 256 routed experts, chosen within
the 4 best of 8 groups of 32 experts (n_routed_experts, num_experts_per_tok,
n_group and topk_group in its config.json). A seeded synthetic router stands in
for the trained one: every expert has a fixed popularity, drawn once, and every
token adds its own noise to it. The score is the sigmoid of the sum, and the
choice is the engine's: a group scores the sum of its two best experts, the
best groups are kept, and the top experts among them win.

The experiment counts each expert's tokens, and each GPU's when the experts sit
in id order on 32 GPUs, 8 to a GPU, as in a 4-node deployment of 8 GPUs each.
It then gives the most skewed router DeepSeek-V3's auxiliary-loss-free bias:
after every batch, each expert's bias moves by a fixed step towards the mean
load, and the bias steers the choice only.
"""

from __future__ import annotations

import math
import random

SEED = 12
EXPERTS = 256
GROUPS = 8
TOPK_GROUPS = 4
TOP_K = 8
GPUS = 32
TOKENS = 2048  # routed and counted for each row
SKEWS = [0.0, 0.25, 0.5]  # spread of the experts' popularity, in units of the noise
BIAS_STEP = 0.02  # how far a bias moves after each batch
BIAS_BATCHES = 40  # batches that train the bias
BIAS_BATCH = 256  # tokens in each of them


def popularity(skew: float, seed: int = SEED) -> list[float]:
    """Each expert's fixed offset: skew times a standard normal draw."""
    rng = random.Random(f"{seed}-popularity")
    return [skew * rng.gauss(0.0, 1.0) for _ in range(EXPERTS)]


def route(scores: list[float], bias: list[float]) -> list[int]:
    """Grouped top-k, as the engine's GroupedTopKRouter chooses."""
    biased = [s + b for s, b in zip(scores, bias)]
    size = EXPERTS // GROUPS
    groups = [biased[g * size : (g + 1) * size] for g in range(GROUPS)]
    group_score = [sum(sorted(g)[-2:]) for g in groups]
    kept = sorted(range(GROUPS), key=lambda g: -group_score[g])[:TOPK_GROUPS]
    candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
    return sorted(candidates, key=lambda e: -biased[e])[:TOP_K]


def token_scores(offsets: list[float], rng: random.Random) -> list[float]:
    return [1 / (1 + math.exp(-(o + rng.gauss(0.0, 1.0)))) for o in offsets]


def expert_loads(offsets: list[float], bias: list[float], tokens: int, rng: random.Random):
    loads = [0] * EXPERTS
    for _ in range(tokens):
        for e in route(token_scores(offsets, rng), bias):
            loads[e] += 1
    return loads


def train_bias(offsets: list[float], rng: random.Random) -> list[float]:
    """Auxiliary-loss-free balancing: nudge each bias towards the mean load."""
    bias = [0.0] * EXPERTS
    for _ in range(BIAS_BATCHES):
        loads = expert_loads(offsets, bias, BIAS_BATCH, rng)
        mean = sum(loads) / EXPERTS
        bias = [b + BIAS_STEP * ((n < mean) - (n > mean)) for b, n in zip(bias, loads)]
    return bias


def gpu_loads(loads: list[int]) -> list[int]:
    per_gpu = EXPERTS // GPUS
    return [sum(loads[g * per_gpu : (g + 1) * per_gpu]) for g in range(GPUS)]


def summary(loads: list[int]) -> dict[str, float]:
    mean = sum(loads) / len(loads)
    hot = sorted(loads, reverse=True)[:TOP_K]
    return {
        "expert_max": max(loads) / mean,
        "idle": sum(1 for n in loads if n == 0),
        "hot_share": sum(hot) / sum(loads),
        "gpu_max": max(gpu_loads(loads)) / (sum(loads) / GPUS),
    }


def row_loads(skew: float, balanced: bool) -> list[int]:
    """One row of the table: each expert's tokens, with or without a trained bias."""
    rng = random.Random(f"{SEED}-{skew}-{balanced}")
    offsets = popularity(skew)
    bias = train_bias(offsets, rng) if balanced else [0.0] * EXPERTS
    return expert_loads(offsets, bias, TOKENS, rng)


ROWS = [(skew, False) for skew in SKEWS] + [(SKEWS[-1], True)]


def main() -> dict:
    print(f"{TOKENS} tokens, top-{TOP_K} of {EXPERTS} experts")
    print(f"in the best {TOPK_GROUPS} of {GROUPS} groups; {GPUS} GPUs")
    print(f"uniform share of the {TOP_K} hottest: {TOP_K / EXPERTS:.1%}")
    print()
    header = f"{'skew':>6} {'bias':>5} {'max/mean':>9} {'idle':>5}"
    print(header + f" {'hot ' + str(TOP_K):>7} {'GPU max':>8}")
    results: dict = {"tokens": TOKENS, "experts": EXPERTS, "top_k": TOP_K, "gpus": GPUS}
    results.update(groups=GROUPS, topk_groups=TOPK_GROUPS, uniform_hot_share=TOP_K / EXPERTS)
    for skew, balanced in ROWS:
        s = summary(row_loads(skew, balanced))
        mark = "yes" if balanced else "no"
        print(
            f"{skew:>6.2f} {mark:>5} {s['expert_max']:>9.2f} {s['idle']:>5}"
            f" {s['hot_share']:>7.1%} {s['gpu_max']:>8.2f}"
        )
        key = f"skew_{int(skew * 100)}" + ("_bias" if balanced else "")
        results.update({f"{key}_{name}": value for name, value in s.items()})
    results["skew_largest"] = SKEWS[-1]
    results["bias_tokens"] = BIAS_BATCHES * BIAS_BATCH
    return results


if __name__ == "__main__":
    main()
