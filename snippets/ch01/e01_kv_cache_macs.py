"""Experiment 1: multiply-adds per generated token, with and without a KV cache.

A one-layer, one-head toy decoder in pure Python generates the same 32 tokens
twice. The first run recomputes the whole sequence at every step, as a model's
forward pass over the full context does. The second keeps every position's key
and value, and computes only the newest position. A counter tallies each
multiply-add, so the two costs can be compared step by step.
"""

import math
import random

D = 16  # model width
VOCAB = 64
PROMPT = 8  # prompt tokens
STEPS = 32  # generated tokens

rng = random.Random(0)


def matrix(rows: int, cols: int) -> list[list[float]]:
    return [[rng.gauss(0.0, 1.0 / math.sqrt(cols)) for _ in range(cols)] for _ in range(rows)]


EMBED = matrix(VOCAB, D)
POS = matrix(PROMPT + STEPS, D)
WQ, WK, WV, WO = (matrix(D, D) for _ in range(4))
UNEMBED = matrix(VOCAB, D)

macs = 0  # every multiply-add, counted where it happens


def dot(a: list[float], b: list[float]) -> float:
    global macs
    macs += len(a)
    return sum(x * y for x, y in zip(a, b))


def matvec(m: list[list[float]], v: list[float]) -> list[float]:
    return [dot(row, v) for row in m]


def embed(tokens: list[int], pos: int) -> list[float]:
    return [e + p for e, p in zip(EMBED[tokens[pos]], POS[pos])]


def attend(q: list[float], keys: list[list[float]], values: list[list[float]]) -> list[float]:
    global macs
    scores = [dot(q, k) / math.sqrt(D) for k in keys]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    out = [0.0] * D
    for w, v in zip(weights, values):
        macs += D
        out = [o + (w / total) * x for o, x in zip(out, v)]
    return out


def position_logits(x: list[float], q: list[float], keys, values) -> list[float]:
    h = [a + b for a, b in zip(x, matvec(WO, attend(q, keys, values)))]
    return matvec(UNEMBED, h)


def step_without_cache(tokens: list[int]) -> int:
    """A full forward over every position, as if no state were kept; use the last logits."""
    xs = [embed(tokens, i) for i in range(len(tokens))]
    keys = [matvec(WK, x) for x in xs]
    values = [matvec(WV, x) for x in xs]
    logits = None
    for i, x in enumerate(xs):  # causal: position i sees keys 0..i
        logits = position_logits(x, matvec(WQ, x), keys[: i + 1], values[: i + 1])
    return max(range(VOCAB), key=logits.__getitem__)


def step_with_cache(tokens: list[int], cache: tuple[list, list]) -> int:
    """Only the positions not yet in the cache are computed; their K and V are kept."""
    keys, values = cache
    logits = None
    for i in range(len(keys), len(tokens)):
        x = embed(tokens, i)
        keys.append(matvec(WK, x))
        values.append(matvec(WV, x))
        logits = position_logits(x, matvec(WQ, x), keys, values)
    return max(range(VOCAB), key=logits.__getitem__)


def generate(step, *state) -> tuple[list[int], list[int]]:
    """Greedy generation; returns the tokens and the multiply-adds each step cost."""
    global macs
    tokens = [rng_prompt.randrange(VOCAB) for _ in range(PROMPT)]
    costs = []
    for _ in range(STEPS):
        before = macs
        tokens.append(step(tokens, *state))
        costs.append(macs - before)
    return tokens, costs


rng_prompt = random.Random(1)
plain_tokens, plain = generate(step_without_cache)
rng_prompt = random.Random(1)
cached_tokens, cached = generate(step_with_cache, ([], []))

print(f"toy decoder: width {D}, vocabulary {VOCAB}, prompt {PROMPT} tokens, {STEPS} generated")
print(f"same tokens with and without the cache: {plain_tokens == cached_tokens}")
print()
print(f"{'step':>4} {'context':>7} {'no cache':>10} {'KV cache':>10} {'ratio':>6}")
for step in (1, 2, 4, 8, 16, 32):
    a, b = plain[step - 1], cached[step - 1]
    print(f"{step:>4} {PROMPT + step - 1:>7} {a:>10,} {b:>10,} {a / b:>6.1f}")
print()
print(f"all {STEPS} steps: {sum(plain):,} multiply-adds without the cache, {sum(cached):,} with it")
print("(the first cached step still has to fill the cache with the whole prompt)")
