"""Experiment 18: speedup against draft length k, for a draft-to-target cost ratio c.

The standard model (Leviathan et al., 2023): one verify step costs one target
forward pass plus k draft forward passes, each c times as expensive as the
target's, so (1 + c*k) in units of a target forward. It yields
(1 - alpha^(k+1)) / (1 - alpha) tokens on average (Experiment 16), where plain
decoding yields one token per target forward. The speedup is the ratio.
A verify pass over k+1 tokens is taken to cost the same as a decode of one:
true while the target is memory-bound, and the first thing to fail at scale.
"""

from __future__ import annotations

ALPHA = 0.8  # each draft token's acceptance probability
RATIOS = [0.05, 0.2, 0.5]  # draft forward cost / target forward cost
MAX_K = 10
PLACES = 3


def expected_tokens(alpha: float, k: int) -> float:
    """Experiment 16's closed form: tokens per verify step."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def speedup(alpha: float, k: int, c: float) -> float:
    """Tokens per target-forward time, over plain decoding's one."""
    return expected_tokens(alpha, k) / (1 + c * k)


def best_k(alpha: float, c: float) -> int:
    """The draft length of the largest speedup, among 1..MAX_K."""
    return max(range(1, MAX_K + 1), key=lambda k: speedup(alpha, k, c))


def curve(alpha: float, c: float) -> list[float]:
    """Speedup at k = 1..MAX_K (the plot draws these)."""
    return [speedup(alpha, k, c) for k in range(1, MAX_K + 1)]


def main() -> dict:
    print(f"speedup over plain decoding, alpha = {ALPHA}")
    print(f"{'k':>3} {'tokens':>7}" + "".join(f"{'c=' + str(c):>9}" for c in RATIOS))
    for k in range(1, MAX_K + 1):
        row = "".join(f"{speedup(ALPHA, k, c):>9.{PLACES}f}" for c in RATIOS)
        print(f"{k:>3} {expected_tokens(ALPHA, k):>7.{PLACES}f}{row}")
    print()
    results: dict = {"alpha": ALPHA, "ratios": RATIOS, "max_k": MAX_K}
    for c in RATIOS:
        k = best_k(ALPHA, c)
        losing = [j for j in range(1, MAX_K + 1) if speedup(ALPHA, j, c) < 1]
        first_loss = f"slower from k = {losing[0]}" if losing else "never slower"
        print(f"c = {c}: best k = {k}, speedup {speedup(ALPHA, k, c):.{PLACES}f},")
        print(f"  {first_loss}")
        key = f"c{round(c * 100)}"
        results[f"best_k_{key}"] = k
        results[f"best_speedup_{key}"] = round(speedup(ALPHA, k, c), PLACES)
        results[f"first_loss_{key}"] = losing[0] if losing else 0
        results[f"speedup_kmax_{key}"] = round(speedup(ALPHA, MAX_K, c), PLACES)
    print(f"ceiling with free drafts: {1 / (1 - ALPHA):.{PLACES}f}")
    results["limit"] = round(1 / (1 - ALPHA), PLACES)
    return results


if __name__ == "__main__":
    main()
