"""Experiment 24: a shared random stream against per-request counter-based seeds.

Every step, each request in the batch draws its next token from its own
distribution over a toy vocabulary. With one shared stream, each row takes
the next numbers from it, so a request's draws depend on how many rows come
before it. With counter-based draws, the uniform for (seed, step, token) is a
hash of those three numbers alone, derived as DeepInfer's sampler derives it
(engine/sample/sampler.py, exponential_noise), and the token is the winner of
an exponential race: argmax of p / E, E = -log(uniform).
"""

from __future__ import annotations

import math
import random

SEED = 24
VOCAB = 8
STEPS = 12
TARGET_SEED = 7
COMPANY = [0, 1, 3, 7]  # requests ahead of the target in the batch
TRIALS = 20000
MASK32 = 0xFFFFFFFF


def probs(step: int) -> list[float]:
    """The target's next-token distribution at ``step`` (a fixed toy model)."""
    w = [math.exp(math.sin(step * 1.3 + i * 0.7) * 1.5) for i in range(VOCAB)]
    return [x / sum(w) for x in w]


def mix32(x: int) -> int:
    """The sampler's 32-bit integer hash: two multiply-xorshift rounds."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & MASK32
    x ^= x >> 15
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def uniform(seed: int, step: int, token: int) -> float:
    """A number in (0, 1) from (seed, step, token) alone, keyed as the engine's
    sampler keys it: both halves of the seed, then the step, then the token."""
    key = mix32(mix32(seed & MASK32) ^ (seed >> 32))
    key = mix32(key ^ (step & MASK32))
    bits = mix32(key ^ mix32(token ^ 0x5BD1E995)) >> 9  # the top 23 of 32 bits
    return (bits + 0.5) * 2.0**-23


def race(p: list[float], seed: int, step: int) -> int:
    """The exponential race: token i wins with probability p[i]."""
    scores = [pi / -math.log(uniform(seed, step, i)) for i, pi in enumerate(p)]
    return max(range(len(p)), key=scores.__getitem__)


def inverse_cdf(p: list[float], u: float) -> int:
    for i, pi in enumerate(p):
        u -= pi
        if u < 0:
            return i
    return len(p) - 1


def shared_stream(ahead: int) -> list[int]:
    """The target's tokens when ``ahead`` rows draw from the stream before it."""
    rng = random.Random(SEED)
    tokens = []
    for step in range(STEPS):
        for _ in range(ahead):
            rng.random()  # the rows in front take their numbers first
        tokens.append(inverse_cdf(probs(step), rng.random()))
    return tokens


def counter_based(ahead: int) -> list[int]:
    """The target's tokens with counter-based draws (company plays no part)."""
    return [race(probs(step), TARGET_SEED, step) for step in range(STEPS)]


def main() -> dict:
    alone_shared, alone_counter = shared_stream(0), counter_based(0)
    print(f"target's {STEPS} tokens, vocabulary of {VOCAB}")
    print(f"{'ahead':>5}  {'shared stream':<16} counter-based")
    changed_shared = changed_counter = 0
    for ahead in COMPANY:
        s, c = shared_stream(ahead), counter_based(ahead)
        changed_shared += s != alone_shared
        changed_counter += c != alone_counter
        row = "".join(map(str, s)), "".join(map(str, c))
        print(f"{ahead:>5}  {row[0]:<16} {row[1]}")
    counts = [0] * VOCAB
    p = probs(0)
    for seed in range(TRIALS):
        counts[race(p, seed, 0)] += 1
    worst = max(abs(n / TRIALS - pi) for n, pi in zip(counts, p))
    # Each frequency is a mean of TRIALS coin flips: its sampling error
    # has standard deviation sqrt(p (1 - p) / TRIALS) (one sigma).
    sigmas = max(
        abs(n / TRIALS - pi) / math.sqrt(pi * (1 - pi) / TRIALS) for n, pi in zip(counts, p)
    )
    print()
    print(f"runs that differ from alone: shared {changed_shared},")
    print(f"  counter-based {changed_counter} (of {len(COMPANY)})")
    print(f"race over {TRIALS} seeds: frequencies within {worst:.4f}")
    print("  of the probabilities")
    print(f"  (worst token: {sigmas:.2f} sigma of sampling error)")
    return {
        "steps": STEPS,
        "vocab": VOCAB,
        "company_runs": len(COMPANY),
        "changed_shared": changed_shared,
        "changed_counter": changed_counter,
        "trials": TRIALS,
        "worst_deviation": worst,
        "worst_sigmas": sigmas,
    }


if __name__ == "__main__":
    main()
