"""Experiment 11: future-token placeholders. What does scheduling ahead waste?

And what makes it wait? With one-step-ahead scheduling, step N+1 is scheduled
before step N's tokens are known. A placeholder stands for each such token, and
the device fills it in, so building step N+1 needs nothing from the host;
without placeholders, every step would wait for the one before. Some things
are still known late:

- a request that ends on step N's token, by EOS or by a stop string in its
  text, has already been scheduled for step N+1, and that token is wasted;
- a request that ends by max_tokens is known to end before its token arrives,
  so it is not scheduled again (a naive engine would schedule it);
- a request preempted while a token of it is in flight keeps that token when
  it arrives (a naive engine would drop it, and compute it again);
- a request with a grammar needs its newest token on the host to build its next
  mask: while that token is in flight, the step must wait for the one before,
  and nothing overlaps.

The trace: REQUESTS requests arriving over the first ARRIVALS steps, one token
per request per step, each with an ending drawn from ENDINGS, one preemption
with probability PREEMPT_SHARE, and a grammar with probability GRAMMAR_SHARE.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SEED = 11
REQUESTS = 64
ARRIVALS = 32  # requests arrive at steps 1 to ARRIVALS
MAX_TOKENS = 128
MEAN_EOS = 48  # the mean length of a request that ends on EOS (geometric)
ENDINGS = {"EOS": 0.5, "stop string": 0.25, "max_tokens": 0.25}
PREEMPT_SHARE = 0.125
GRAMMAR_SHARE = 0.0625


@dataclass
class Request:
    arrival: int  # the step it is first scheduled in
    length: int  # the tokens it generates, the one that ends it included
    ending: str  # a key of ENDINGS
    preempted_at: int  # preempted while this token of it is in flight; 0: never
    grammar: bool


def trace(seed: int = SEED) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(REQUESTS):
        arrival = rng.randint(1, ARRIVALS)
        ending = rng.choices(list(ENDINGS), weights=list(ENDINGS.values()))[0]
        length = MAX_TOKENS
        if ending == "EOS":  # each token is EOS with probability 1 / MEAN_EOS
            length = 1
            while rng.random() >= 1 / MEAN_EOS and length < MAX_TOKENS:
                length += 1
        elif ending == "stop string":
            length = rng.randint(1, MAX_TOKENS)
        if length == MAX_TOKENS:
            ending = "max_tokens"  # whatever else would have ended it later
        preempted = rng.randint(1, length) if rng.random() < PREEMPT_SHARE else 0
        requests.append(Request(arrival, length, ending, preempted, rng.random() < GRAMMAR_SHARE))
    return requests


@dataclass
class Engine:
    """What the engine does about what it learns late."""

    lookahead: bool = True  # skip a request whose max_tokens-th token is in flight
    keep: bool = True  # a request preempted with a token in flight keeps it
    grammars: bool = False  # requests with a grammar make the step wait


def simulate(requests: list[Request], engine: Engine) -> dict:
    """The async engine's loop, one step at a time: schedule step N, and only
    then fold in step N-1's tokens, unless a grammar makes it fold them first."""
    next_token = [1] * len(requests)  # the next token of each request to compute
    folded = [0] * len(requests)  # how many of its tokens are known
    wasted = dict.fromkeys([*ENDINGS, "preempted"], 0)
    steps = waits = computed = 0
    in_flight: list[tuple[int, int]] = []  # (request, token) the step before computed
    hit: set[int] = set()  # the requests preempted so far: each is preempted once
    while in_flight or any(f < r.length for f, r in zip(folded, requests)):
        steps += 1
        preempted = {i for i, t in in_flight if t == requests[i].preempted_at and i not in hit}
        hit |= preempted
        drop = set() if engine.keep else preempted
        if engine.grammars and any(requests[i].grammar for i, _ in in_flight):
            waits += 1  # its mask needs the token: fold the step before in first
            in_flight = fold(requests, in_flight, folded, next_token, wasted, drop)
        now = []
        for i, r in enumerate(requests):
            if i in preempted or not runs(r, steps, next_token[i], folded[i], engine):
                continue
            computed += 1
            if next_token[i] > r.length:  # it ended on the token before: too late
                wasted[r.ending] += 1
            now.append((i, next_token[i]))
            next_token[i] += 1
        fold(requests, in_flight, folded, next_token, wasted, drop)
        in_flight = now
    return dict(steps=steps, waits=waits, computed=computed, wasted=wasted)


def runs(r: Request, step: int, token: int, folded: int, engine: Engine) -> bool:
    """Is the request scheduled in this step? Not before it arrives, not once its
    end is known, and, with lookahead, not past max_tokens."""
    if step < r.arrival or folded >= r.length:
        return False
    return not (engine.lookahead and r.ending == "max_tokens" and token > r.length)


def fold(requests, in_flight, folded, next_token, wasted, drop) -> list:
    """Step N-1's tokens arrive. A request that has ended takes no more; a token
    dropped at a preemption is computed again."""
    for i, token in in_flight:
        if i in drop:
            wasted["preempted"] += 1
            next_token[i] = token
        elif token <= requests[i].length:
            folded[i] = token
    return []


def main() -> dict:
    requests = trace()
    run = simulate(requests, Engine())
    naive = simulate(requests, Engine(lookahead=False, keep=False))
    waiting = simulate(requests, Engine(grammars=True))
    count = {e: sum(r.ending == e for r in requests) for e in ENDINGS}
    count["preempted"] = sum(r.preempted_at > 0 for r in requests)
    wasted, naive_wasted = sum(run["wasted"].values()), sum(naive["wasted"].values())
    grammars = sum(r.grammar for r in requests)
    print(f"{REQUESTS} requests over {ARRIVALS} steps, seed {SEED},")
    print(f"  max_tokens {MAX_TOKENS}, one token a request a step")
    print(f"steps: {run['steps']}, tokens computed: {run['computed']:,}")
    print()
    print(f"{'event':<12} {'requests':>8} {'wasted':>7} {'naive engine':>13}")
    for event, n in count.items():
        if event == "preempted":  # an event on the way, not a fourth way to end
            print(f"{'':-<43}")
            print("  a preempted request also ends as above:")
        print(f"{event:<12} {n:>8} {run['wasted'][event]:>7} {naive['wasted'][event]:>13}")
    print(f"{'':-<43}")
    print(f"{'in all':<12} {len(requests):>8} {wasted:>7} {naive_wasted:>13}")
    print(f"wasted: {wasted / run['computed']:.2%} of the tokens computed")
    print()
    print(f"{grammars} of the requests with a grammar:")
    print(f"  steps that waited: {waiting['waits']} of {waiting['steps']}")
    print(f"  tokens wasted: {sum(waiting['wasted'].values())}")
    print(f"without placeholders, every step waits: {run['steps']}")
    results = {
        "requests": REQUESTS,
        "steps": run["steps"],
        "computed": run["computed"],
        "wasted": wasted,
        "wasted_share": wasted / run["computed"],
        "naive_wasted": naive_wasted,
        "grammar_requests": grammars,
        "grammar_waits": waiting["waits"],
        "grammar_steps": waiting["steps"],
        "grammar_wasted": sum(waiting["wasted"].values()),
    }
    for event, n in count.items():
        key = event.replace(" ", "_").lower()
        results[f"{key}_requests"] = n
        results[f"{key}_wasted"] = run["wasted"][event]
        results[f"{key}_naive_wasted"] = naive["wasted"][event]
    return results


if __name__ == "__main__":
    main()
