"""Experiment 17: rejection sampling keeps the target's distribution; naive checks do not.

A draft model proposes a token x drawn from its distribution q; the target's
distribution at the same position is p. Four ways of deciding what to emit
are run many times each, over a vocabulary of six tokens, and the frequencies
of the emitted tokens are compared with p by a chi-square test:

- rejection: accept x with probability min(1, p(x)/q(x)); on rejection, draw
  from the residual max(0, p - q), normalised (Leviathan et al., Chen et al.);
- top-token: accept x if it is the target's most likely token, as greedy
  verification would, else draw from p;
- redraw-p: rejection's test, but on rejection draw from p itself;
- match: draw the target's own token y from p, accept x if x == y,
  else emit y.
"""

from __future__ import annotations

import random

SEED = 17
P = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]  # the target's distribution
Q = [0.10, 0.40, 0.25, 0.05, 0.15, 0.05]  # the draft's, at the same position
DRAWS = 20000  # emitted tokens per sampler
# Chi-square critical value for 5 degrees of freedom (six tokens) at a
# significance level of 0.001: a correct sampler exceeds it once in 1,000 runs.
CRITICAL = 20.515
PLACES = 3


def draw(rng: random.Random, dist: list[float]) -> int:
    """One token from ``dist`` by inverting its cumulative sum."""
    u = rng.random()
    for token, prob in enumerate(dist):
        u -= prob
        if u < 0:
            return token
    return len(dist) - 1


def residual(p: list[float], q: list[float]) -> list[float]:
    """max(0, p - q), normalised: what p has that q under-proposes."""
    r = [max(0.0, pi - qi) for pi, qi in zip(p, q)]
    return [x / sum(r) for x in r]


def rejection(rng: random.Random) -> tuple[int, bool]:
    """The standard way: (emitted token, whether the draft was kept)."""
    x = draw(rng, Q)
    if rng.random() < min(1.0, P[x] / Q[x]):
        return x, True
    return draw(rng, residual(P, Q)), False


def top_token(rng: random.Random) -> tuple[int, bool]:
    x = draw(rng, Q)
    if x == max(range(len(P)), key=P.__getitem__):
        return x, True
    return draw(rng, P), False


def redraw_p(rng: random.Random) -> tuple[int, bool]:
    x = draw(rng, Q)
    if rng.random() < min(1.0, P[x] / Q[x]):
        return x, True
    return draw(rng, P), False


def match(rng: random.Random) -> tuple[int, bool]:
    x, y = draw(rng, Q), draw(rng, P)
    return y, x == y


SAMPLERS = {
    "rejection": rejection,
    "top-token": top_token,
    "redraw-p": redraw_p,
    "match": match,
}


def chi_square(counts: list[int], dist: list[float]) -> float:
    """Pearson's statistic of the observed counts against ``dist``."""
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, dist))


def run(sampler) -> tuple[list[int], int]:
    rng = random.Random(SEED)
    counts, accepted = [0] * len(P), 0
    for _ in range(DRAWS):
        token, ok = sampler(rng)
        counts[token] += 1
        accepted += ok
    return counts, accepted


def main() -> dict:
    runs = {name: run(sampler) for name, sampler in SAMPLERS.items()}
    names = list(SAMPLERS)
    print(f"emitted-token frequencies, {DRAWS} draws each")
    print(f"{'tok':>3} {'p':>4} {'q':>4} " + "".join(f"{n:>10}" for n in names))
    for t in range(len(P)):
        freqs = "".join(f"{runs[n][0][t] / DRAWS:>10.{PLACES}f}" for n in names)
        print(f"{t:>3} {P[t]:>4.2f} {Q[t]:>4.2f} {freqs}")
    print()
    print(f"chi-square against p (fails above {CRITICAL})")
    print(f"{'sampler':<13} {'chi-sq':>8} {'TV':>6} {'verdict':>7} {'accept':>7}")
    results: dict = {"draws": DRAWS, "critical": CRITICAL, "vocab": len(P)}
    for name in names:
        counts, accepted = runs[name]
        stat = chi_square(counts, P)
        tv = sum(abs(c / DRAWS - p) for c, p in zip(counts, P)) / 2
        verdict = "pass" if stat <= CRITICAL else "FAIL"
        rate = accepted / DRAWS
        print(f"{name:<13} {stat:>8.1f} {tv:>6.{PLACES}f} {verdict:>7} {rate:>7.{PLACES}f}")
        key = name.replace("-", "_")
        results[f"{key}_chisq"] = round(stat, 1)
        results[f"{key}_tv"] = round(tv, PLACES)
        results[f"{key}_passes"] = verdict == "pass"
        results[f"{key}_accept"] = round(rate, PLACES)
        results[f"{key}_top"] = round(counts[0] / DRAWS, PLACES)  # token 0, p's likeliest
    overlap = sum(min(p, q) for p, q in zip(P, Q))
    print()
    print(f"rejection's acceptance, sum of min(p, q): {overlap:.{PLACES}f}")
    print(f"match's, sum of p * q: {sum(p * q for p, q in zip(P, Q)):.{PLACES}f}")
    results["overlap"] = round(overlap, PLACES)
    results["match_expected"] = round(sum(p * q for p, q in zip(P, Q)), PLACES)
    results.update(p=P, q=Q)
    results["top_token_p"] = P[0]
    results["top_token_q"] = Q[0]
    return results


if __name__ == "__main__":
    main()
