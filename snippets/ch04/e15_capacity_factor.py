"""Experiment 15: capacity factors against dropless dispatch.

Some MoE implementations give every expert a fixed capacity: the capacity
factor times its fair share of the batch, T * k / E tokens. Tokens routed
beyond it are dropped (they skip the expert, and only the residual carries
them on), and rows left empty are padding, computed for nothing. Dropless
dispatch, which DeepSeek-V3 and this engine use, drops no token: each expert
runs on exactly the rows it was sent, however many.

Each expert's token count is drawn from a seeded popularity, as in Experiment
14: once with every expert equally popular, as a well-balanced router would
make them, and once skewed. The first table counts dropped tokens and padding
rows at each capacity factor for one batch. The second asks what capacity
factor a batch needs to drop nothing, for batches from decode's size up to
prefill's: the capacity a fixed buffer needs, which dropless dispatch makes
unnecessary.
"""

from __future__ import annotations

import math
import random

SEED = 15
EXPERTS = 256
TOP_K = 8
TOKENS = 4096  # the batch of the first table
FACTORS = [1.0, 1.25, 1.5, 2.0]
SKEWS = {"even": 0.0, "skewed": 0.6}  # spread of the log-popularity
BATCHES = [32, 256, 4096, 32768]


def popularity(skew: float) -> list[float]:
    rng = random.Random(f"{SEED}-popularity")
    return [math.exp(skew * rng.gauss(0.0, 1.0)) for _ in range(EXPERTS)]


def loads(skew: float, tokens: int) -> list[int]:
    rng = random.Random(f"{SEED}-{skew}-{tokens}")
    counts = [0] * EXPERTS
    for e in rng.choices(range(EXPERTS), weights=popularity(skew), k=tokens * TOP_K):
        counts[e] += 1
    return counts


def capacity(factor: float, tokens: int) -> int:
    return math.ceil(factor * tokens * TOP_K / EXPERTS)


def dropped_and_padding(counts: list[int], cap: int) -> tuple[float, float]:
    """Share of routed tokens dropped; share of the E * cap rows left empty."""
    kept = sum(min(n, cap) for n in counts)
    return 1 - kept / sum(counts), 1 - kept / (EXPERTS * cap)


def dropless(counts: list[int]) -> tuple[float, float]:
    """Each expert gets exactly the rows it was sent: as many rows as tokens."""
    rows = list(counts)  # each expert's rows: one per token it was sent
    return 1 - sum(rows) / sum(counts), 1 - sum(counts) / sum(rows)


def needed_factor(counts: list[int], tokens: int) -> float:
    """The capacity factor at which the busiest expert drops nothing."""
    return max(counts) / (tokens * TOP_K / EXPERTS)


def main() -> dict:
    fair = TOKENS * TOP_K / EXPERTS
    print(f"{TOKENS:,} tokens x top-{TOP_K} over {EXPERTS} experts:")
    print(f"a fair share is {fair:g} tokens an expert")
    print()
    print(f"{'':<9} {'even router':>17}  {'skewed router':>17}")
    print(f"{'factor':<9} {'dropped':>8} {'padding':>8}  {'dropped':>8} {'padding':>8}")
    results: dict = {"tokens": TOKENS, "fair_share": fair, "experts": EXPERTS}
    batch = {name: loads(skew, TOKENS) for name, skew in SKEWS.items()}
    for factor in FACTORS:
        cells = []
        for name, counts in batch.items():
            dropped, padding = dropped_and_padding(counts, capacity(factor, TOKENS))
            cells.append(f"{dropped:>8.1%} {padding:>8.1%}")
            key = f"{name}_{int(factor * 100)}"
            results.update({f"{key}_dropped": dropped, f"{key}_padding": padding})
        print(f"{factor:<9.2f} " + "  ".join(cells))
    cells = []
    for name, counts in batch.items():
        dropped, padding = dropless(counts)
        cells.append(f"{dropped:>8.1%} {padding:>8.1%}")
        results.update({f"{name}_dropless_dropped": dropped, f"{name}_dropless_padding": padding})
    print(f"{'dropless':<9} " + "  ".join(cells))
    print()
    print("capacity factor that drops nothing")
    print(f"{'batch':>7} {'even':>7} {'skewed':>7}")
    for tokens in BATCHES:
        factors = [needed_factor(loads(skew, tokens), tokens) for skew in SKEWS.values()]
        print(f"{tokens:>7,} {factors[0]:>7.2f} {factors[1]:>7.2f}")
        for name, f in zip(SKEWS, factors):
            results[f"{name}_needed_{tokens}"] = f
    results["smallest_batch"], results["largest_batch"] = BATCHES[0], BATCHES[-1]
    results["factor_low"], results["factor_high"] = FACTORS[0], FACTORS[-1]
    return results


if __name__ == "__main__":
    main()
