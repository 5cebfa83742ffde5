"""How the router picks a worker: round-robin, or prefix affinity.

Prefix affinity sends prompts that begin alike to the same worker, whose
prefix cache then already holds their common blocks. The key is the chain hash
of the prompt's leading blocks, the hash the prefix cache itself files blocks
under (from the router's own root), so two prompts get one key exactly when
their first blocks would hit the same cache entries. Keys are placed on a consistent-hash ring, so that a
worker going away moves only its own keys; and no worker takes more than
`load_factor` times the mean load in flight (consistent hashing with bounded
loads, Mirrokni, Thorup and Zadimoghaddam, 2018), so one hot prefix cannot
swamp a worker while the others idle.
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect
from dataclasses import dataclass

from engine.kv.hashing import chain_hash

VIRTUAL_NODES = 64  # points per worker on the ring: an even share of the keys each


@dataclass
class Worker:
    url: str
    healthy: bool = True
    in_flight: int = 0


def prefix_key(token_ids: list[int], block_size: int, max_blocks: int, root: bytes) -> bytes | None:
    """The chain hash of the prompt's first full blocks (at most ``max_blocks``),
    counting blocks as the prefix cache does: the last token is never cached.
    None for a prompt too short to share a block."""
    full = min((len(token_ids) - 1) // block_size, max_blocks)
    if full < 1:
        return None
    key = root
    for i in range(full):
        key = chain_hash(key, token_ids[i * block_size : (i + 1) * block_size])
    return key


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class RoundRobin:
    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.next = 0

    def candidates(self, key: bytes | None) -> list[Worker]:
        """Every healthy worker, the one whose turn it is first."""
        n = len(self.workers)
        start, self.next = self.next, (self.next + 1) % n
        order = [self.workers[(start + i) % n] for i in range(n)]
        return [w for w in order if w.healthy]


class PrefixAffinity:
    def __init__(self, workers: list[Worker], load_factor: float) -> None:
        self.workers = workers
        self.load_factor = load_factor
        self.fallback = RoundRobin(workers)  # for prompts shorter than a block
        self.ring = sorted(
            (_point(f"{w.url}#{i}".encode()), j)
            for j, w in enumerate(workers)
            for i in range(VIRTUAL_NODES)
        )
        self.points = [p for p, _ in self.ring]

    def candidates(self, key: bytes | None) -> list[Worker]:
        """Healthy workers in ring order from the key, those under the load cap
        first: the first is the key's owner unless it is down or full."""
        if key is None:
            return self.fallback.candidates(None)
        order: list[Worker] = []
        start = bisect(self.points, _point(key))
        for k in range(len(self.ring)):
            worker = self.workers[self.ring[(start + k) % len(self.ring)][1]]
            if worker not in order:
                order.append(worker)
        healthy = [w for w in order if w.healthy]
        cap = self.capacity(healthy)
        return [w for w in healthy if w.in_flight < cap] + [
            w for w in healthy if w.in_flight >= cap
        ]

    def capacity(self, healthy: list[Worker]) -> int:
        """The most requests one worker may hold, counting the one being placed."""
        if not healthy:
            return 0
        total = sum(w.in_flight for w in healthy) + 1
        return math.ceil(self.load_factor * total / len(healthy))
