"""Experiment 19: a verify length per request from its confidence, against one k for all.

A batch of requests decodes with speculation under a budget: at most BUDGET
draft tokens may be verified per step, across the whole batch. Each request's
drafts are accepted with its own probability alpha (easy text, hard text).
The fixed scheme gives every request BUDGET // BATCH drafts. The confidence
scheme, DSpark's question, spends the budget where it pays: the j-th draft of
a request survives with probability conf^j, where conf is the scheduler's
estimate of that request's alpha, and the budget goes to the (request, j)
pairs of highest survival. Its estimate is either exact (an oracle) or noisy,
drawn afresh each step around the truth. Every step also yields each
request's own target token, so a request given no drafts still advances.
"""

from __future__ import annotations

import random

SEED = 19
BATCH = 16
ALPHA_LOW, ALPHA_HIGH = 0.3, 0.95  # the spread of the requests' acceptance rates
BUDGETS = [16, 32, 64]  # draft tokens verified per step, batch-wide
MAX_K = 8  # the most drafts one request may have
NOISE = 0.15  # standard deviation of the noisy estimate
STEPS = 4000
PLACES = 2


def request_alphas() -> list[float]:
    rng = random.Random(SEED)
    return sorted(round(rng.uniform(ALPHA_LOW, ALPHA_HIGH), 2) for _ in range(BATCH))


def fixed_lengths(budget: int) -> list[int]:
    return [min(MAX_K, budget // BATCH)] * BATCH


def confident_lengths(conf: list[float], budget: int) -> list[int]:
    """Spend the budget on the drafts most likely to survive: draft j of request
    r survives with probability conf[r] ** j, which falls with j, so taking
    the best pairs always takes a request's drafts in order."""
    pairs = [(c**j, -j, r) for r, c in enumerate(conf) for j in range(1, MAX_K + 1)]
    lengths = [0] * len(conf)
    for _, _, r in sorted(pairs, reverse=True)[:budget]:
        lengths[r] += 1
    return lengths


def expected_tokens(alphas: list[float], lengths: list[int]) -> float:
    """Tokens per step: each request's 1 + alpha + ... + alpha^k (Experiment 16)."""
    return sum(sum(a**j for j in range(k + 1)) for a, k in zip(alphas, lengths))


def step_tokens(rng: random.Random, alphas: list[float], lengths: list[int]) -> int:
    """One simulated step: each request's accepted prefix plus its own token."""
    total = 0
    for a, k in zip(alphas, lengths):
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        total += accepted + 1
    return total


def noisy(rng: random.Random, alphas: list[float]) -> list[float]:
    return [min(0.99, max(0.01, a + rng.gauss(0, NOISE))) for a in alphas]


def simulate(alphas: list[float], budget: int, scheme: str) -> float:
    rng = random.Random(f"{SEED}-{budget}-{scheme}")
    total = 0
    for _ in range(STEPS):
        if scheme == "fixed":
            lengths = fixed_lengths(budget)
        elif scheme == "oracle":
            lengths = confident_lengths(alphas, budget)
        else:
            lengths = confident_lengths(noisy(rng, alphas), budget)
        total += step_tokens(rng, alphas, lengths)
    return total / STEPS


def main() -> dict:
    alphas = request_alphas()
    schemes = ["fixed", "oracle", "noisy"]
    print(f"{BATCH} requests, alpha from {min(alphas)} to {max(alphas)}")
    print(f"tokens per step, mean of {STEPS} steps")
    heads = "".join(f"{s:>8}" for s in schemes)
    print(f"{'budget':>6} {'k':>2}{heads}  gain: oracle noisy")
    results: dict = {"batch": BATCH, "steps": STEPS, "max_k": MAX_K, "noise": NOISE}
    for budget in BUDGETS:
        seen = {s: simulate(alphas, budget, s) for s in schemes}
        gains = {s: seen[s] / seen["fixed"] - 1 for s in schemes[1:]}
        row = "".join(f"{seen[s]:>8.{PLACES}f}" for s in schemes)
        print(
            f"{budget:>6} {budget // BATCH:>2}{row}{gains['oracle']:>+14.0%}{gains['noisy']:>+6.0%}"
        )
        if budget != BUDGETS[1]:
            continue  # the prose quotes the middle budget
        for s in schemes:
            results[f"{s}_b{budget}"] = round(seen[s], PLACES)
        results[f"expected_fixed_b{budget}"] = round(
            expected_tokens(alphas, fixed_lengths(budget)), PLACES
        )
        results[f"expected_oracle_b{budget}"] = round(
            expected_tokens(alphas, confident_lengths(alphas, budget)), PLACES
        )
        for s in gains:
            results[f"{s}_gain_b{budget}"] = round(gains[s], PLACES)
    idle = [confident_lengths(alphas, b).count(0) for b in BUDGETS]
    print("requests the oracle gives no drafts:")
    print("  " + ", ".join(f"{n} at budget {b}" for n, b in zip(idle, BUDGETS)))
    results["no_drafts_smallest"] = idle[0]
    shown = BUDGETS[1]
    lengths = confident_lengths(alphas, shown)
    print()
    print(f"oracle's k per request at budget {shown}:")
    for start in range(0, BATCH, 4):
        pairs = zip(alphas[start : start + 4], lengths[start : start + 4])
        print("  " + "  ".join(f"{a:.2f}:{k}" for a, k in pairs))
    results.update(
        budgets=BUDGETS,
        shown_budget=shown,
        alpha_min=min(alphas),
        alpha_max=max(alphas),
        shown_k_min=min(lengths),
        shown_k_max=max(lengths),
    )
    return results


if __name__ == "__main__":
    main()
