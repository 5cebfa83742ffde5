"""Experiment 22: top-k attention chosen by a cheap indexer, against the exact top-k.

One query attends over TOKENS cached keys of HEAD_DIM channels. Sparse
attention keeps only k of them: ideally the k of highest score, whose share of
the softmax is the most mass any k tokens can hold. Finding those needs every
full score, so a cheap indexer chooses instead, as DeepSeek-V3.2's lightning
indexer does for its sparse attention (DSA).

The keys' variance is spread unevenly over the channels, as in real models,
whose keys are close to low-rank: channel c has standard deviation
proportional to DECAY^c (the channels stand already rotated so that the
leading ones carry the most). The indexer reads only the first `dim` channels
of q and k, and adds normal noise of deviation NOISE to each score it makes,
a stand-in for its low precision. It keeps its own top k.

For each k the table gives the attention mass the exact top k holds, and for
each indexer width the mass its top k holds (the softmax weights of full
attention, summed over the tokens it kept) and the overlap, the share of its
k tokens that are also in the exact top k, averaged over QUERIES queries.
"""

from __future__ import annotations

import math
import random

SEED = 22
TOKENS = 2048
HEAD_DIM = 64
DECAY = 0.9  # each channel's deviation over the one before
Q_SCALE = 3.0  # query entries are normal with this deviation
DIMS = [4, 8, 16]  # the indexer's widths: channels it reads
NOISE = 0.25  # deviation of the indexer's score noise
QUERIES = 16
KS = [16, 32, 64, 128, 256, 512]
CITED = [32, 128, 512]  # the rows the prose quotes
PLACES = 3


def spectrum() -> list[float]:
    """Each channel's deviation: DECAY^c, scaled so that the variances sum to 1
    (then a score q . k has about the deviation of one query entry)."""
    raw = [DECAY**c for c in range(HEAD_DIM)]
    norm = math.sqrt(sum(x * x for x in raw))
    return [x / norm for x in raw]


def indexer_scores(
    rng: random.Random,
    q: list[float],
    keys: list[list[float]],
    dim: int,
) -> list[float]:
    """The indexer's cheap score: q . k over the first `dim` channels
    only, plus its noise."""
    return [sum(a * b for a, b in zip(q[:dim], k[:dim])) + rng.gauss(0, NOISE) for k in keys]


def top(scores: list[float], k: int) -> set[int]:
    """The positions of the k highest scores."""
    return set(sorted(range(len(scores)), key=lambda i: -scores[i])[:k])


def softmax(scores: list[float]) -> list[float]:
    peak = max(scores)
    weights = [math.exp(s - peak) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


def recovered(probs: list[float], kept: set[int], best: set[int]) -> tuple[float, float]:
    """The attention mass of the kept tokens, and the share of them
    that the exact top k also holds."""
    return sum(probs[i] for i in kept), len(kept & best) / len(best)


def main() -> dict:
    rng = random.Random(SEED)
    scale = spectrum()
    keys = [[s * rng.gauss(0, 1) for s in scale] for _ in range(TOKENS)]
    exact = {k: 0.0 for k in KS}
    mass = {(d, k): 0.0 for d in DIMS for k in KS}
    overlap = dict(mass)
    for _ in range(QUERIES):
        q = [rng.gauss(0, Q_SCALE) for _ in range(HEAD_DIM)]
        scores = [sum(a * b for a, b in zip(q, k)) for k in keys]
        probs = softmax(scores)
        cheap = {d: indexer_scores(rng, q, keys, d) for d in DIMS}
        for k in KS:
            best = top(scores, k)
            exact[k] += sum(probs[i] for i in best) / QUERIES
            for d in DIMS:
                m, o = recovered(probs, top(cheap[d], k), best)
                mass[d, k] += m / QUERIES
                overlap[d, k] += o / QUERIES
    print(f"{TOKENS} keys of {HEAD_DIM} channels, {QUERIES} queries")
    print(f"indexer score noise: {NOISE}")
    shares = [sum(s * s for s in scale[:d]) for d in DIMS]
    for d, share in zip(DIMS, shares):
        print(f"width {d:>2}: {share:.0%} of the keys' variance")
    print(f"{'':>4} {'exact':>6}" + "".join(f" {'width ' + str(d):>13}" for d in DIMS))
    print(f"{'k':>4} {'mass':>6}" + f" {'mass':>5} {'overlap':>7}" * len(DIMS))
    results: dict = {"tokens": TOKENS, "head_dim": HEAD_DIM, "dims": DIMS, "places": PLACES}
    results |= {"noise": NOISE, "queries": QUERIES, "decay": DECAY, "ks": KS}
    results |= {f"variance_d{d}": round(v, PLACES) for d, v in zip(DIMS, shares)}
    for k in KS:
        cells = "".join(f" {mass[d, k]:>5.{PLACES}f} {overlap[d, k]:>7.{PLACES}f}" for d in DIMS)
        print(f"{k:>4} {exact[k]:>6.{PLACES}f}" + cells)
        if k in CITED:
            results[f"exact_k{k}"] = round(exact[k], PLACES)
            for d in DIMS:
                results[f"mass_d{d}_k{k}"] = round(mass[d, k], PLACES)
                results[f"overlap_d{d}_k{k}"] = round(overlap[d, k], PLACES)
    return results


if __name__ == "__main__":
    main()
