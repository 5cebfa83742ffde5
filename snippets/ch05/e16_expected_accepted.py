"""Experiment 16: expected tokens per verify step, for acceptance alpha and draft length k.

A draft proposes k tokens; the target checks them all in one forward pass and
keeps them up to the first one it rejects. Whatever happens, the step also
yields one token of the target's own: the correction at the first rejection,
or a bonus token after k acceptances. If each draft token is accepted with
probability alpha, independently of the others, a step yields
1 + alpha + alpha^2 + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) tokens
on average. The simulation draws the steps and counts.
"""

from __future__ import annotations

import random

SEED = 16
ALPHAS = [0.5, 0.7, 0.8, 0.9]
LENGTHS = [1, 2, 4, 8]
STEPS = 20000  # simulated verify steps for each (alpha, k)
PLACES = 3  # decimal places printed and returned
CITED = [(0.5, 8), (0.8, 4), (0.8, 8), (0.9, 8)]  # the rows the chapter's prose quotes


def closed_form(alpha: float, k: int) -> float:
    """Expected tokens per verify step: 1 + alpha + ... + alpha^k."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def spread(alpha: float, k: int) -> float:
    """One sigma of the simulated mean: the standard deviation of one step's
    tokens, from its exact distribution, over the square root of STEPS."""
    probs = [alpha**j * (1 - alpha) for j in range(k)] + [alpha**k]
    mean = sum((j + 1) * p for j, p in enumerate(probs))
    var = sum((j + 1 - mean) ** 2 * p for j, p in enumerate(probs))
    return (var / STEPS) ** 0.5


def one_step(rng: random.Random, alpha: float, k: int) -> int:
    """Tokens one verify step yields: the accepted prefix, plus one
    token of the target's own."""
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted + 1


def simulate(alpha: float, k: int) -> float:
    rng = random.Random(f"{SEED}-{alpha}-{k}")
    return sum(one_step(rng, alpha, k) for _ in range(STEPS)) / STEPS


def main() -> dict:
    print(f"tokens per verify step, {STEPS} steps each")
    print(f"{'alpha':>5} {'k':>3} {'formula':>8} {'simulated':>10} {'gap':>7} {'sigmas':>6}")
    results: dict = {"steps": STEPS, "places": PLACES}
    worst = worst_sigmas = 0.0
    for alpha in ALPHAS:
        for k in LENGTHS:
            exact, seen = closed_form(alpha, k), simulate(alpha, k)
            gap = seen - exact
            sigmas = abs(gap) / spread(alpha, k)
            worst, worst_sigmas = max(worst, abs(gap)), max(worst_sigmas, sigmas)
            print(
                f"{alpha:>5} {k:>3} {exact:>8.{PLACES}f} {seen:>10.{PLACES}f}"
                f" {gap:>+7.{PLACES}f} {sigmas:>6.2f}"
            )
            if (alpha, k) in CITED:
                key = f"a{round(alpha * 100)}_k{k}"
                results[f"formula_{key}"] = round(exact, PLACES)
                results[f"simulated_{key}"] = round(seen, PLACES)
        print(f"{'':>5} {'inf':>3} {1 / (1 - alpha):>8.{PLACES}f}")
        if alpha in (a for a, _ in CITED):
            results[f"limit_a{round(alpha * 100)}"] = round(1 / (1 - alpha), PLACES)
    print(f"largest gap: {worst:.{PLACES}f} tokens")
    print(f"largest gap in sigmas: {worst_sigmas:.2f}")
    results["worst_gap"] = round(worst, PLACES)
    results["worst_sigmas"] = round(worst_sigmas, 2)
    results["alphas"] = ALPHAS
    results["lengths"] = LENGTHS
    return results


if __name__ == "__main__":
    main()
