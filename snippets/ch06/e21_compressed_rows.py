"""Experiment 21: compressed KV rows, one pooled row per m tokens, plus a recent window.

One attention head has cached OLD + WINDOW tokens. The newest WINDOW tokens
stay raw. The OLD tokens before them are cut into groups of m consecutive
tokens, and each group is kept as one row: the mean of its keys and the mean
of its values. A query attends over the pooled rows and the raw window
together, as DeepSeek-V4's compressed attention reads its compressed rows
beside a window of recent raw tokens (there with m = 4 and m = 128).

Keys and values have local structure: each channel is an AR(1) process along
the positions, x[t] = RHO * x[t-1] + sqrt(1 - RHO^2) * noise, so neighbouring
tokens are alike and tokens far apart are not. A pooled row then stands for
its group well when m is short against the run of alike tokens, about
1 / (1 - RHO) positions, and poorly when it is long. Each query is partly
the newest token's key (a share ALIGN of it) and partly random: recent tokens,
alike to the newest, score higher, as in real attention, and older ones still
draw some of the weight.

A pooled row is one row where the group had m, so the softmax gives it the
weight of one token. The counted variant adds ln(m) to each pooled row's
score, so that the row weighs as much as its m tokens would if their keys were
all equal to the mean. For each m the table gives the rows kept for every
cached token, and the error of QUERIES attention outputs against full
attention over every raw token (norm of the difference over norm of the
exact output, averaged over the queries), for the plain and counted rows.
Its last line is the window alone, every old token dropped.
"""

from __future__ import annotations

import math
import random

SEED = 21
HEAD_DIM = 32
OLD = 2048  # tokens before the window, pooled
WINDOW = 128  # recent tokens kept raw
RHO = 0.95  # correlation of neighbouring tokens' keys (and values)
QUERIES = 16
Q_SCALE = 2.5  # the query's size: its entries have this deviation
ALIGN = 0.5  # how much of the query is the newest token's key
POOLS = [1, 2, 4, 8, 16, 32, 64, 128]  # m, tokens per pooled row
CITED = [2, 4, 128]  # the rows the prose quotes (V4's two rates among them)
PLACES = 4
Matrix = list[list[float]]


def ar_sequence(rng: random.Random, length: int) -> Matrix:
    """`length` vectors whose channels each follow an AR(1) process."""
    noise = math.sqrt(1 - RHO * RHO)
    x = [rng.gauss(0, 1) for _ in range(HEAD_DIM)]
    rows = []
    for _ in range(length):
        x = [RHO * xi + noise * rng.gauss(0, 1) for xi in x]
        rows.append(x)
    return rows


def mean_rows(rows: Matrix, m: int) -> Matrix:
    """One row per m consecutive rows: their mean, channel by channel."""
    return [
        [sum(col) / m for col in zip(*rows[start : start + m])] for start in range(0, len(rows), m)
    ]


def compress(keys: Matrix, values: Matrix, m: int) -> tuple[Matrix, Matrix, int]:
    """Pooled rows for the old tokens, then the raw window; and how many
    of the rows are pooled."""
    old_k, old_v = mean_rows(keys[:OLD], m), mean_rows(values[:OLD], m)
    return old_k + keys[OLD:], old_v + values[OLD:], len(old_k)


def scores(q: list[float], keys: Matrix) -> list[float]:
    return [sum(a * b for a, b in zip(q, k)) / math.sqrt(HEAD_DIM) for k in keys]


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    weights = [math.exp(x - top) for x in xs]
    total = sum(weights)
    return [w / total for w in weights]


def attend(q: list[float], keys: Matrix, values: Matrix, bias: list[float]) -> list[float]:
    """Softmax over q . k / sqrt(HEAD_DIM) plus each row's bias, weighting v."""
    probs = softmax([s + extra for s, extra in zip(scores(q, keys), bias)])
    return [sum(p * v[c] for p, v in zip(probs, values)) for c in range(HEAD_DIM)]


def row_bias(m: int, pooled: int, counted: bool) -> list[float]:
    """What each row adds to its score. Counted, a pooled row gets ln(m):
    it then weighs as much as its m tokens would if their keys all
    equalled its mean. Plain, it weighs as one token."""
    extra = math.log(m) if counted else 0.0
    return [extra] * pooled + [0.0] * WINDOW


def relative_error(approx: list[float], exact: list[float]) -> float:
    error = sum((a - e) ** 2 for a, e in zip(approx, exact))
    return math.sqrt(error / sum(e * e for e in exact))


def mean_error(outs: Matrix, exact: Matrix) -> float:
    return sum(relative_error(o, e) for o, e in zip(outs, exact)) / len(exact)


def make_query(rng: random.Random, newest: list[float]) -> list[float]:
    """ALIGN of the newest key, the rest random, scaled to Q_SCALE."""
    rest = math.sqrt(1 - ALIGN * ALIGN)
    return [Q_SCALE * (ALIGN * k + rest * rng.gauss(0, 1)) for k in newest]


def main() -> dict:
    rng = random.Random(SEED)
    keys, values = ar_sequence(rng, OLD + WINDOW), ar_sequence(rng, OLD + WINDOW)
    queries = [make_query(rng, keys[-1]) for _ in range(QUERIES)]
    exact = [attend(q, keys, values, [0.0] * (OLD + WINDOW)) for q in queries]
    in_window = sum(sum(softmax(scores(q, keys))[OLD:]) for q in queries) / QUERIES
    print(f"{OLD} old tokens pooled, a raw window of {WINDOW}")
    print(f"neighbour correlation {RHO}, {QUERIES} queries")
    print(f"share of the newest key in a query: {ALIGN}")
    print(f"full attention's mass in the window: {in_window:.{PLACES}f}")
    print(f"{'m':>4} {'rows':>5} {'per token':>9} {'plain err':>9} {'counted err':>11}")
    results: dict = {"old": OLD, "window": WINDOW, "rho": RHO, "places": PLACES}
    results |= {"queries": QUERIES, "q_scale": Q_SCALE, "align": ALIGN, "pools": POOLS}
    results["largest_pool"] = max(POOLS)
    results["window_mass"] = round(in_window, PLACES)
    for m in POOLS:
        k_rows, v_rows, pooled = compress(keys, values, m)
        errs = [
            mean_error([attend(q, k_rows, v_rows, row_bias(m, pooled, c)) for q in queries], exact)
            for c in (False, True)
        ]
        per_token = len(k_rows) / (OLD + WINDOW)
        print(
            f"{m:>4} {len(k_rows):>5} {per_token:>9.{PLACES}f}"
            f" {errs[0]:>9.{PLACES}f} {errs[1]:>11.{PLACES}f}"
        )
        if m in CITED:
            results[f"rows_m{m}"] = len(k_rows)
            results[f"per_token_m{m}"] = round(per_token, PLACES)
            results[f"plain_err_m{m}"] = round(errs[0], PLACES)
            results[f"counted_err_m{m}"] = round(errs[1], PLACES)
    alone = [attend(q, keys[OLD:], values[OLD:], [0.0] * WINDOW) for q in queries]
    alone_err = mean_error(alone, exact)
    print(f"window alone: {WINDOW} rows, error {alone_err:.{PLACES}f}")
    results["alone_err"] = round(alone_err, PLACES)
    return results


if __name__ == "__main__":
    main()
