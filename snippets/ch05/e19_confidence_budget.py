"""Experiment 19: a verify length per request from its confidence, against one k for all.

A batch of requests decodes with speculation under a budget: at most BUDGET
draft tokens may be verified per step, across the whole batch. Each request's
drafts are accepted with its own probability alpha (easy text, hard text).
The fixed scheme gives every request BUDGET // BATCH drafts. The confidence
scheme, DSpark's question, spends the budget where it pays: the j-th draft of
a request survives with probability est^j, where est is the scheduler's
estimate of that request's alpha, and the budget goes to the (request, j)
pairs of highest survival, at most MAX_K drafts a request. Its estimate is
either exact (an oracle) or noisy: the truth plus Gaussian noise drawn afresh
each step, clipped to [CLIP_LOW, CLIP_HIGH]. Every step also yields each
request's own target token, so a request given no drafts still advances.
"""

from __future__ import annotations

import random

SEED = 19
BATCH = 16
ALPHA_LOW, ALPHA_HIGH = 0.3, 0.95  # acceptance rates: uniform in this range
BUDGETS = [16, 32, 64]  # draft tokens verified per step, batch-wide
MAX_K = 8  # the most drafts one request may have
NOISE = 0.15  # standard deviation of the noisy estimate
CLIP_LOW, CLIP_HIGH = 0.01, 0.99  # the noisy estimate is clipped to this range
STEPS = 4000
PLACES = 2
SCHEMES = ["fixed", "oracle", "noisy"]


def request_alphas() -> list[float]:
    rng = random.Random(SEED)
    return sorted(round(rng.uniform(ALPHA_LOW, ALPHA_HIGH), 2) for _ in range(BATCH))


def fixed_lengths(budget: int) -> list[int]:
    return [min(MAX_K, budget // BATCH)] * BATCH


def confident_lengths(conf: list[float], budget: int) -> list[int]:
    """Spend the budget on the drafts most likely to survive: draft j
    of request r survives with probability conf[r] ** j, which falls
    with j, so the best pairs take each request's drafts in order."""
    ks = range(1, MAX_K + 1)
    pairs = [(est**j, -j, r) for r, est in enumerate(conf) for j in ks]
    lengths = [0] * len(conf)
    for _, _, r in sorted(pairs, reverse=True)[:budget]:
        lengths[r] += 1
    return lengths


def expected_tokens(alphas: list[float], lengths: list[int]) -> float:
    """Tokens per step: each request's 1 + alpha + ... + alpha^k (Experiment 16)."""
    return sum(sum(a**j for j in range(k + 1)) for a, k in zip(alphas, lengths))


def step_tokens(
    rng: random.Random,
    alphas: list[float],
    lengths: list[int],
) -> int:
    """One simulated step: every request's accepted drafts, plus
    one token of the target's own."""
    total = 0
    for a, k in zip(alphas, lengths):
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        total += accepted + 1
    return total


def noisy(rng: random.Random, alphas: list[float]) -> list[float]:
    """The scheduler's estimate: the truth plus fresh noise, clipped."""
    guesses = (a + rng.gauss(0, NOISE) for a in alphas)
    return [min(CLIP_HIGH, max(CLIP_LOW, g)) for g in guesses]


def lengths_for(rng: random.Random, alphas: list[float], budget: int, scheme: str) -> list[int]:
    """This step's drafts per request, as the scheme allots them."""
    if scheme == "fixed":
        return fixed_lengths(budget)
    if scheme == "oracle":
        return confident_lengths(alphas, budget)
    return confident_lengths(noisy(rng, alphas), budget)


def simulate(alphas: list[float], budget: int, scheme: str) -> float:
    rng = random.Random(f"{SEED}-{budget}-{scheme}")
    total = 0
    for _ in range(STEPS):
        total += step_tokens(rng, alphas, lengths_for(rng, alphas, budget, scheme))
    return total / STEPS


def simulated_table(alphas: list[float]) -> dict:
    """Each scheme's mean tokens per step at each budget, and the gains."""
    print(f"tokens per step, mean of {STEPS} simulated steps")
    heads = "".join(f"{s:>8}" for s in SCHEMES)
    print(f"{'budget':>6} {'k':>2}{heads}  gain: oracle noisy")
    results: dict = {}
    for budget in BUDGETS:
        seen = {s: simulate(alphas, budget, s) for s in SCHEMES}
        gains = {s: seen[s] / seen["fixed"] - 1 for s in SCHEMES[1:]}
        row = "".join(f"{seen[s]:>8.{PLACES}f}" for s in SCHEMES)
        gain = f"{gains['oracle']:>+14.0%}{gains['noisy']:>+6.0%}"
        print(f"{budget:>6} {budget // BATCH:>2}{row}{gain}")
        if budget == BUDGETS[1]:  # the prose quotes the middle budget
            results.update({f"{s}_b{budget}": round(seen[s], PLACES) for s in SCHEMES})
            for s, g in gains.items():
                results[f"{s}_gain_b{budget}"] = round(g, PLACES)
    return results


def expected_table(alphas: list[float]) -> dict:
    """The same fixed and oracle allocations, by the closed form."""
    print()
    print("expected tokens per step, by the closed form")
    print(f"{'budget':>6} {'k':>2}{'fixed':>8}{'oracle':>8}")
    results: dict = {}
    for budget in BUDGETS:
        fixed = expected_tokens(alphas, fixed_lengths(budget))
        oracle = expected_tokens(alphas, confident_lengths(alphas, budget))
        print(f"{budget:>6} {budget // BATCH:>2}{fixed:>8.{PLACES}f}{oracle:>8.{PLACES}f}")
        if budget == BUDGETS[1]:
            results[f"expected_fixed_b{budget}"] = round(fixed, PLACES)
            results[f"expected_oracle_b{budget}"] = round(oracle, PLACES)
    return results


def allocation(alphas: list[float]) -> dict:
    """How the oracle spends the budgets: who gets none, and each request's k."""
    idle = [confident_lengths(alphas, b).count(0) for b in BUDGETS]
    print()
    print("requests the oracle gives no drafts:")
    print("  " + ", ".join(f"{n} at budget {b}" for n, b in zip(idle, BUDGETS)))
    shown = BUDGETS[1]
    lengths = confident_lengths(alphas, shown)
    print()
    print(f"oracle's drafts per request at budget {shown},")
    print("each request shown as alpha:drafts")
    for start in range(0, BATCH, 4):
        pairs = zip(alphas[start : start + 4], lengths[start : start + 4])
        print("  " + "  ".join(f"{a:.2f}:{k}" for a, k in pairs))
    return {
        "no_drafts_smallest": idle[0],
        "shown_budget": shown,
        "shown_k_min": min(lengths),
        "shown_k_max": max(lengths),
    }


def main() -> dict:
    alphas = request_alphas()
    print(f"{BATCH} requests, alpha drawn uniformly in [{ALPHA_LOW}, {ALPHA_HIGH}]")
    results: dict = {
        "batch": BATCH,
        "steps": STEPS,
        "max_k": MAX_K,
        "noise": NOISE,
        "clip_low": CLIP_LOW,
        "clip_high": CLIP_HIGH,
        "budgets": BUDGETS,
        "alpha_low": ALPHA_LOW,
        "alpha_high": ALPHA_HIGH,
        "alphas": alphas,
    }
    results.update(simulated_table(alphas))
    results.update(expected_table(alphas))
    results.update(allocation(alphas))
    return results


if __name__ == "__main__":
    main()
