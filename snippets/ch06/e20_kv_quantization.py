"""Experiment 20: KV quantization error against bytes, and its effect on attention.

One attention head caches TOKENS keys and values of HEAD_DIM channels, in
paged blocks of BLOCK tokens. Values are standard normal. Keys are too, except
OUTLIERS channels that sit near OUTLIER_MEAN in every token, as a few channels
of real models' keys do. Each format stores every number in fewer bits, with
a float32 scale per group of numbers: x is stored as q(x / s) and read back as
s * q(x / s), where s maps the group's largest magnitude onto the format's
largest value. The groups are a whole block of one head, one channel of a
block, or GROUP consecutive channels of one token.

FP8 E4M3 is emulated exactly: 1 sign bit, 4 exponent bits with bias 7, and 3
mantissa bits, so the largest value is 448, the smallest normal 2^-6, and
below it subnormals in steps of 2^-9; rounding is to nearest, ties to even.
bf16 (8 significant bits, no scale) is the reference an unquantized cache
would hold. The integers are symmetric: int8 keeps -127..127, int4 -7..7.

For each format the table gives the bytes one cached number costs, scales
included; the error of the stored values and keys (root mean square error over
root mean square value); the error of the scores q . k / sqrt(HEAD_DIM) that
QUERIES queries give the keys (root mean square error over the scores' spread
across tokens); and the error of those queries' attention outputs, softmax of
the scores weighting the values, against the same computation on the exact
cache (norm of the difference over norm of the output, averaged over them).
"""

from __future__ import annotations

import math
import random

SEED = 20
TOKENS = 256  # cached tokens of one head
HEAD_DIM = 64  # channels per key or value
BLOCK = 16  # tokens per paged block (DeepInfer's default block size)
GROUP = 16  # channels per token group
OUTLIERS = [5, 37]  # key channels with a large mean
OUTLIER_MEAN = 20.0
QUERIES = 16
Q_SCALE = 2.5  # query entries are normal with this deviation
SCALE_BYTES = 4  # one float32 per scale
E4M3_MAX, E4M3_MIN_EXP, E4M3_MAN = 448.0, -6, 3
PLACES = 4  # decimal places of the errors, printed and returned
# (name, storage bits, grouping, largest stored value); bf16 has no scale
FORMATS = [
    ("bf16", 16, "none", 0.0),
    ("fp8", 8, "block", E4M3_MAX),
    ("fp8", 8, "channel", E4M3_MAX),
    ("int8", 8, "block", 127.0),
    ("int8", 8, "channel", 127.0),
    ("int4", 4, "block", 7.0),
    ("int4", 4, "token", 7.0),
    ("int4", 4, "channel", 7.0),
]
Matrix = list[list[float]]


def to_e4m3(x: float) -> float:
    """The FP8 E4M3 number nearest x, ties to even, clamped to +-448."""
    a = min(abs(x), E4M3_MAX)
    if a == 0.0:
        return 0.0
    exponent = max(math.frexp(a)[1] - 1, E4M3_MIN_EXP)  # subnormals share 2^-6
    step = 2.0 ** (exponent - E4M3_MAN)  # the gap between neighbours there
    return math.copysign(min(round(a / step) * step, E4M3_MAX), x)


def to_bf16(x: float) -> float:
    """x rounded to 8 significant bits, ties to even (bf16's precision)."""
    if x == 0.0:
        return 0.0
    step = 2.0 ** (math.frexp(x)[1] - 8)
    return round(x / step) * step


def quantize_group(xs: list[float], fmt: str, top: float) -> list[float]:
    """Store a group with one scale, and read it back: the group's largest
    magnitude maps onto the format's largest value, `top`."""
    if fmt == "bf16":
        return [to_bf16(x) for x in xs]
    amax = max(abs(x) for x in xs)
    scale = amax / top if amax > 0 else 1.0  # never zero, even for a zero group
    if fmt == "fp8":
        return [scale * to_e4m3(x / scale) for x in xs]
    return [scale * max(-top, min(top, round(x / scale))) for x in xs]


def groups(grouping: str) -> list[list[tuple[int, int]]]:
    """The (token, channel) cells that share each scale."""
    if grouping == "none":
        return [[(t, c) for c in range(HEAD_DIM)] for t in range(TOKENS)]
    if grouping == "token":
        return [
            [(t, c) for c in range(c0, c0 + GROUP)]
            for t in range(TOKENS)
            for c0 in range(0, HEAD_DIM, GROUP)
        ]
    found = []
    for t0 in range(0, TOKENS, BLOCK):
        block = range(t0, t0 + BLOCK)
        if grouping == "block":
            found.append([(t, c) for t in block for c in range(HEAD_DIM)])
        else:  # one channel of one block
            found += [[(t, c) for t in block] for c in range(HEAD_DIM)]
    return found


def quantize(m: Matrix, fmt: str, grouping: str, top: float) -> Matrix:
    out = [row[:] for row in m]
    for cells in groups(grouping):
        stored = quantize_group([m[t][c] for t, c in cells], fmt, top)
        for (t, c), x in zip(cells, stored):
            out[t][c] = x
    return out


def bytes_per_number(bits: int, grouping: str) -> float:
    """Storage per cached number, its share of the group's scale included."""
    shared = {"none": 0, "block": BLOCK * HEAD_DIM, "channel": BLOCK, "token": GROUP}
    size = shared[grouping]
    return bits / 8 + (SCALE_BYTES / size if size else 0.0)


def scores(q: list[float], keys: Matrix) -> list[float]:
    return [sum(a * b for a, b in zip(q, k)) / math.sqrt(HEAD_DIM) for k in keys]


def attend(q: list[float], keys: Matrix, values: Matrix) -> list[float]:
    """One query's attention output: softmax over q . k, weighting v."""
    s = scores(q, keys)
    top = max(s)
    weights = [math.exp(x - top) for x in s]
    total = sum(weights)
    return [sum(w * v[c] for w, v in zip(weights, values)) / total for c in range(HEAD_DIM)]


def relative_error(approx: Matrix, exact: Matrix) -> float:
    """Root mean square error over root mean square value."""
    pairs = [(a, e) for ra, re in zip(approx, exact) for a, e in zip(ra, re)]
    error = sum((a - e) ** 2 for a, e in pairs)
    return math.sqrt(error / sum(e * e for _, e in pairs))


def score_error(queries: Matrix, approx: Matrix, exact: Matrix) -> float:
    """Root mean square error of the scores over their spread across tokens."""
    error = spread = 0.0
    for q in queries:
        s, s_hat = scores(q, exact), scores(q, approx)
        mean = sum(s) / TOKENS
        error += sum((a - e) ** 2 for a, e in zip(s_hat, s))
        spread += sum((e - mean) ** 2 for e in s)
    return math.sqrt(error / spread)


def make_cache(rng: random.Random) -> tuple[Matrix, Matrix]:
    keys = [[rng.gauss(0, 1) for _ in range(HEAD_DIM)] for _ in range(TOKENS)]
    for k in keys:
        for c in OUTLIERS:
            k[c] += OUTLIER_MEAN
    values = [[rng.gauss(0, 1) for _ in range(HEAD_DIM)] for _ in range(TOKENS)]
    return keys, values


def label(name: str, grouping: str) -> str:
    return f"{name}/{grouping}" if grouping != "none" else name


def main() -> dict:
    rng = random.Random(SEED)
    keys, values = make_cache(rng)
    queries = [[rng.gauss(0, Q_SCALE) for _ in range(HEAD_DIM)] for _ in range(QUERIES)]
    exact = [attend(q, keys, values) for q in queries]
    print(f"{TOKENS} tokens, {HEAD_DIM} channels, blocks of {BLOCK} tokens")
    print(f"key outlier channels: {len(OUTLIERS)}, mean {OUTLIER_MEAN:g}")
    print(f"token groups of {GROUP} channels; {QUERIES} queries")
    print(f"{'format':<13} {'bytes':>5} {'V err':>6} {'K err':>6} {'score':>6} {'output':>6}")
    results: dict = {"places": PLACES, "tokens": TOKENS, "head_dim": HEAD_DIM}
    results |= {"block": BLOCK, "group": GROUP, "outliers": len(OUTLIERS)}
    results |= {"outlier_mean": OUTLIER_MEAN, "queries": QUERIES, "q_scale": Q_SCALE}
    for name, bits, grouping, top in FORMATS:
        k_hat = quantize(keys, name, grouping, top)
        v_hat = quantize(values, name, grouping, top)
        outs = [attend(q, k_hat, v_hat) for q in queries]
        out_err = sum(relative_error([o], [e]) for o, e in zip(outs, exact)) / QUERIES
        row = {
            "bytes": round(bytes_per_number(bits, grouping), PLACES),
            "v_err": round(relative_error(v_hat, values), PLACES),
            "k_err": round(relative_error(k_hat, keys), PLACES),
            "score_err": round(score_error(queries, k_hat, keys), PLACES),
            "out_err": round(out_err, PLACES),
        }
        cells = [f"{row[f]:>6.{PLACES}f}" for f in ("v_err", "k_err", "score_err", "out_err")]
        print(f"{label(name, grouping):<13} {row['bytes']:>5.3f} " + " ".join(cells))
        key = label(name, grouping).replace("/", "_")
        results |= {f"{field}_{key}": value for field, value in row.items()}
    return results


if __name__ == "__main__":
    main()
