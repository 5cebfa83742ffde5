"""Experiment 1: multiply-adds per generated token, with and without a KV cache.

A one-layer, one-head toy decoder in pure Python generates the same 32 tokens
twice. The first run recomputes the whole sequence at every step, as a model's
forward pass over the full context does. The second keeps every position's key
and value, and computes only the newest position. A counter tallies each
multiply-add, so the two costs can be compared step by step.

Both runs turn a hidden state into logits only where a token is sampled: for
the last position of the step, as an engine does. The earlier positions still
go through the whole layer, because in a model of many layers their outputs
are the next layer's inputs.
"""

from __future__ import annotations

import math
import random

D = 16  # model width
VOCAB = 64
PROMPT = 8  # prompt tokens
STEPS = 32  # generated tokens
SHOWN = (1, 2, 4, 8, 16, 32)  # the steps the table prints

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


def layer(x: list[float], keys: list[list[float]], values: list[list[float]]) -> list[float]:
    """The position's output: attention over the keys so far, plus the residual."""
    return [a + b for a, b in zip(x, matvec(WO, attend(matvec(WQ, x), keys, values)))]


def next_token(h: list[float]) -> int:
    """Logits for one position only, the one whose next token is sampled."""
    logits = matvec(UNEMBED, h)
    return max(range(VOCAB), key=logits.__getitem__)


def step_without_cache(tokens: list[int]) -> int:
    """A full forward over every position, as if no state were kept."""
    xs = [embed(tokens, i) for i in range(len(tokens))]
    keys = [matvec(WK, x) for x in xs]
    values = [matvec(WV, x) for x in xs]
    hs = [layer(x, keys[: i + 1], values[: i + 1]) for i, x in enumerate(xs)]  # causal
    return next_token(hs[-1])


def step_with_cache(tokens: list[int], cache: tuple[list, list]) -> int:
    """Only the positions not yet in the cache are computed; their K and V are kept."""
    keys, values = cache
    h: list[float] = []
    for i in range(len(keys), len(tokens)):
        x = embed(tokens, i)
        keys.append(matvec(WK, x))
        values.append(matvec(WV, x))
        h = layer(x, keys, values)
    return next_token(h)


def generate(step, *state) -> tuple[list[int], list[int]]:
    """Greedy generation; returns the tokens and the multiply-adds each step cost."""
    prompt_rng = random.Random(1)
    tokens = [prompt_rng.randrange(VOCAB) for _ in range(PROMPT)]
    costs = []
    for _ in range(STEPS):
        before = macs
        tokens.append(step(tokens, *state))
        costs.append(macs - before)
    return tokens, costs


def formula(context: int, cached: bool) -> int:
    """The multiply-adds of one step by the prose's formula, to check the counter."""
    if cached:  # one new position reads `context` cached keys and values
        return 4 * D * D + 2 * context * D + VOCAB * D
    return 4 * D * D * context + context * (context + 1) * D + VOCAB * D


def main() -> dict:
    plain_tokens, plain = generate(step_without_cache)
    cached_tokens, cached = generate(step_with_cache, ([], []))
    same = plain_tokens == cached_tokens
    contexts = [PROMPT + i for i in range(STEPS)]  # tokens in the context at each step
    assert plain == [formula(n, cached=False) for n in contexts]
    assert cached[1:] == [formula(n, cached=True) for n in contexts[1:]]

    print(f"toy decoder: width {D}, vocabulary {VOCAB}")
    print(f"prompt {PROMPT} tokens, then {STEPS} generated")
    print(f"same tokens with and without the cache: {same}")
    print()
    print(f"{'step':>4} {'context':>7} {'no cache':>10} {'KV cache':>10} {'ratio':>6}")
    results: dict = {}
    for step in SHOWN:
        a, b, n = plain[step - 1], cached[step - 1], contexts[step - 1]
        print(f"{step:>4} {n:>7} {a:>10,} {b:>10,} {a / b:>6.1f}")
        results.update(
            {f"context_step_{step}": n, f"uncached_step_{step}": a, f"cached_step_{step}": b}
        )
        results[f"ratio_step_{step}"] = a / b
    print()
    print(f"multiply-adds over all {STEPS} steps:")
    print(f"  without the cache {sum(plain):>10,}")
    print(f"  with the cache    {sum(cached):>10,}")
    print("(the first cached step fills the cache")
    print(" with the whole prompt)")
    return {
        "width": D,
        "vocab": VOCAB,
        "prompt_tokens": PROMPT,
        "steps": STEPS,
        "same_tokens": same,
        "ratios": [plain[s - 1] / cached[s - 1] for s in SHOWN],
        **results,
        "uncached_total": sum(plain),
        "cached_total": sum(cached),
        "total_ratio": sum(plain) / sum(cached),
        # The whole cached run against the single uncached step at the end.
        "cached_total_over_last_uncached": sum(cached) / plain[-1],
    }


if __name__ == "__main__":
    main()
