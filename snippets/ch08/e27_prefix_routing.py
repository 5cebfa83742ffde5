"""Experiment 27: round-robin against prefix-affinity routing, and the load cap.

A router sends each request to one of WORKERS workers. Each worker has a
prefix cache of CACHE_BLOCKS blocks of BLOCK tokens, evicted least recently
used first. A request is one of DOCS shared prefixes (a system prompt or a
document of DOC_TOKENS tokens, chosen with Zipf popularity of exponent ZIPF)
followed by a suffix of its own. On arrival it is served from its worker's
cache for the leading run of its full blocks the cache holds, and all its full
blocks then enter that cache (the last token is never cached, as in the
engine). Its hit rate is cached prompt tokens over prompt tokens.

Requests arrive as a Poisson stream and stay in flight for an exponential
time, so that IN_FLIGHT requests are in flight per worker on average. The
policies see the workers' in-flight counts:

- round-robin: each worker in turn;
- random: a uniformly random worker;
- least-loaded: the worker with the fewest requests in flight;
- affinity: the engine's PrefixAffinity (engine/entrypoints/routing.py),
  modelled line by line. The key is the chain hash of the prompt's first
  PREFIX_BLOCKS full blocks (the router's defaults); it is placed on a ring
  of VIRTUAL_NODES points per worker; the candidates are the workers in ring
  order from the key, those under the cap first, where the cap is
  ceil(load_factor * (in flight + 1) / workers); the first one takes it.

The load imbalance is the busiest worker's requests over the mean, and the
peak is the most requests any one worker held in flight at once.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from bisect import bisect
from collections import OrderedDict

SEED = 27
WORKERS = 8
BLOCK = 16  # tokens per block: the router's block_size default
PREFIX_BLOCKS = 4  # leading blocks the key hashes: the router's prefix_blocks
VIRTUAL_NODES = 64  # ring points per worker, as in routing.py
CACHE_BLOCKS = 512  # each worker's prefix cache
DOCS = 64  # shared prefixes
DOC_TOKENS = 512  # each a whole number of blocks
ZIPF = 1.1  # popularity of the k-th prefix: 1 / k ** ZIPF
SUFFIX_MIN, SUFFIX_MAX = 32, 224  # each request's own tokens, uniform
VOCAB = 32000
REQUESTS = 20000
IN_FLIGHT = 16  # requests in flight per worker, on average
ENGINE_FACTOR = 1.25  # RouterConfig.load_factor's default
LOAD_FACTORS = [1.0, 1.1, ENGINE_FACTOR, 1.5, 2.0, math.inf]
PLACES = 3


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The engine's block identity (engine/kv/hashing.py)."""
    h = hashlib.sha256(parent)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


def prefix_key(tokens: list[int], root: bytes) -> bytes:
    """routing.prefix_key: the chain hash of the first full blocks."""
    full = min((len(tokens) - 1) // BLOCK, PREFIX_BLOCKS)
    key = root
    for i in range(full):
        key = chain_hash(key, tokens[i * BLOCK : (i + 1) * BLOCK])
    return key


def point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def ring_orders(keys: list[bytes]) -> list[list[int]]:
    """For each key, the workers in ring order from it: the key's owner
    first, then whoever its load would spill to."""
    ring = sorted(
        (point(f"w{j}#{i}".encode()), j) for j in range(WORKERS) for i in range(VIRTUAL_NODES)
    )
    points = [p for p, _ in ring]
    orders = []
    for key in keys:
        start, order = bisect(points, point(key)), []
        for k in range(len(ring)):
            worker = ring[(start + k) % len(ring)][1]
            if worker not in order:
                order.append(worker)
        orders.append(order)
    return orders


def affinity_pick(order: list[int], in_flight: list[int], factor: float) -> int:
    """PrefixAffinity.candidates()[0]: the first worker in ring order
    under the cap, or the key's owner if every one is at it."""
    if math.isinf(factor):
        return order[0]
    cap = math.ceil(factor * (sum(in_flight) + 1) / WORKERS)
    return next((w for w in order if in_flight[w] < cap), order[0])


def zipf_weights() -> list[float]:
    return [1 / (k + 1) ** ZIPF for k in range(DOCS)]


def workload(rng: random.Random) -> list[tuple[float, float, int, int]]:
    """(arrival, time in flight, prefix, suffix tokens) for every request."""
    rate = WORKERS * IN_FLIGHT  # arrivals per unit of mean time in flight
    docs = rng.choices(range(DOCS), weights=zipf_weights(), k=REQUESTS)
    now, out = 0.0, []
    for doc in docs:
        now += rng.expovariate(rate)
        out.append((now, rng.expovariate(1.0), doc, rng.randint(SUFFIX_MIN, SUFFIX_MAX)))
    return out


class PrefixCache:
    """One worker's cache: block ids in least-recently-used order."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[tuple[int, int], None] = OrderedDict()

    def serve(self, blocks: list[tuple[int, int]]) -> int:
        """Blocks of the leading run already here; then all are cached."""
        hit = 0
        while hit < len(blocks) and blocks[hit] in self.blocks:
            hit += 1
        for b in blocks:
            self.blocks[b] = None
            self.blocks.move_to_end(b)
        while len(self.blocks) > CACHE_BLOCKS:
            self.blocks.popitem(last=False)
        return hit


def prompt_blocks(req: int, doc: int, suffix: int) -> list[tuple[int, int]]:
    """The full blocks of the prompt, named by what they hold: a shared
    block by its prefix, a block with the request's own tokens by the
    request (the chain hash makes every later block unique too)."""
    shared = DOC_TOKENS // BLOCK
    full = (DOC_TOKENS + suffix - 1) // BLOCK
    return [(-1 - doc, i) if i < shared else (req, i) for i in range(full)]


def choose(policy: str, factor: float, order: list[int], in_flight: list[int], state: dict) -> int:
    if policy == "round-robin":
        state["next"] = (state["next"] + 1) % WORKERS
        return state["next"]
    if policy == "random":
        return state["rng"].randrange(WORKERS)
    if policy == "least-loaded":
        return min(range(WORKERS), key=lambda w: in_flight[w])
    return affinity_pick(order, in_flight, factor)


def simulate(
    policy: str, factor: float, reqs: list, orders: list[list[int]], own_blocks: bool = True
) -> dict:
    """Route every request; count hits, requests and the peak in flight.
    Without ``own_blocks``, a request's own blocks are not cached."""
    caches = [PrefixCache() for _ in range(WORKERS)]
    in_flight, served, peak = [0] * WORKERS, [0] * WORKERS, 0
    ends: list[tuple[float, int]] = []
    state = {"next": -1, "rng": random.Random(SEED + 1)}
    hit_tokens = prompt_tokens = 0
    for req, (now, stay, doc, suffix) in enumerate(reqs):
        while ends and ends[0][0] <= now:
            in_flight[heapq.heappop(ends)[1]] -= 1
        w = choose(policy, factor, orders[doc], in_flight, state)
        blocks = prompt_blocks(req, doc, suffix)
        if not own_blocks:  # only the shared blocks, named by their prefix
            blocks = [b for b in blocks if b[0] < 0]
        hit_tokens += caches[w].serve(blocks) * BLOCK
        prompt_tokens += DOC_TOKENS + suffix
        in_flight[w] += 1
        served[w] += 1
        peak = max(peak, in_flight[w])
        heapq.heappush(ends, (now + stay, w))
    imbalance = max(served) / (len(reqs) / WORKERS)
    return {"hit": hit_tokens / prompt_tokens, "imbalance": imbalance, "peak": peak}


def label(policy: str, factor: float) -> str:
    if policy != "affinity":
        return policy
    return "affinity, no cap" if math.isinf(factor) else f"affinity {factor}"


def describe(reqs: list, orders: list[list[int]]) -> dict:
    """Print the workload; return the shares the prose quotes."""
    weights = zipf_weights()
    hot = weights[0] / sum(weights)
    owner = sum(w for d, w in enumerate(weights) if orders[d][0] == orders[0][0]) / sum(weights)
    ceiling = sum(DOC_TOKENS for *_, s in reqs) / sum(DOC_TOKENS + s for *_, s in reqs)
    print(f"{WORKERS} workers, {CACHE_BLOCKS} blocks of {BLOCK} tokens each")
    print(f"{DOCS} prefixes of {DOC_TOKENS} tokens, Zipf {ZIPF}")
    print(f"own suffix: {SUFFIX_MIN} to {SUFFIX_MAX} tokens")
    print(f"{REQUESTS:,} requests, {IN_FLIGHT} in flight per worker")
    print(f"hottest prefix: {hot:.1%} of requests;")
    print(f"  all its ring owner's keys: {owner:.1%}")
    print(f"shared tokens over prompt tokens: {ceiling:.1%}")
    return {
        "hot_share": round(hot, PLACES),
        "hot_owner_share": round(owner, PLACES),
        "ceiling": round(ceiling, PLACES),
    }


def main() -> dict:
    rng = random.Random(SEED)
    doc_tokens = [[rng.randrange(VOCAB) for _ in range(DOC_TOKENS)] for _ in range(DOCS)]
    root = hashlib.sha256(f"router\0\0{BLOCK}".encode()).digest()  # chain_root's form
    orders = ring_orders([prefix_key(t, root) for t in doc_tokens])
    reqs = workload(rng)
    results: dict = {"workers": WORKERS, "cache_blocks": CACHE_BLOCKS, "block": BLOCK}
    results |= {"docs": DOCS, "doc_tokens": DOC_TOKENS, "zipf": ZIPF, "requests": REQUESTS}
    results |= {"suffix_min": SUFFIX_MIN, "suffix_max": SUFFIX_MAX, "in_flight": IN_FLIGHT}
    results |= {"prefix_blocks": PREFIX_BLOCKS, "engine_factor": ENGINE_FACTOR}
    results["cache_prefixes"] = CACHE_BLOCKS * BLOCK // DOC_TOKENS
    results["load_factors"] = [f for f in LOAD_FACTORS if not math.isinf(f)]
    results |= describe(reqs, orders)
    print()
    print(f"{'policy':<17} {'hit rate':>8} {'max/mean':>8} {'peak':>5}")
    runs = [(p, 0.0) for p in ("round-robin", "random", "least-loaded")]
    runs += [("affinity", f) for f in LOAD_FACTORS]
    for policy, factor in runs:
        r = simulate(policy, factor, reqs, orders)
        name = label(policy, factor)
        print(f"{name:<17} {r['hit']:>8.1%} {r['imbalance']:>8.2f} {r['peak']:>5}")
        slug = name.replace("affinity, no cap", "nocap").replace("affinity ", "lf")
        slug = slug.replace("-", "_").replace(".", "_")
        results[f"hit_{slug}"] = round(r["hit"], PLACES)
        results[f"imbalance_{slug}"] = round(r["imbalance"], 2)
        results[f"peak_{slug}"] = r["peak"]
        if policy == "affinity" and not math.isinf(factor):
            results[f"factor_{slug}"] = factor
    alone = simulate("affinity", math.inf, reqs, orders, own_blocks=False)
    print("no cap, if requests' own blocks were not cached:")
    print(f"{'':<17} {alone['hit']:>8.1%}")
    results["hit_nocap_shared_only"] = round(alone["hit"], PLACES)
    return results


if __name__ == "__main__":
    main()
