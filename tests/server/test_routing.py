"""The router's choice of worker, without any server: its key is the prefix
cache's own block hash, the ring sends a key to one worker and moves only a
lost worker's keys, and the load cap passes over a worker that is full."""

from __future__ import annotations

import random
from collections import Counter

from engine.entrypoints.routing import PrefixAffinity, RoundRobin, Worker, prefix_key
from engine.kv.block_manager import BlockManager
from engine.kv.hashing import chain_root
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BLOCK = 16
ROOT = chain_root("test", "", BLOCK)


def test_the_key_is_the_prefix_caches_hash_of_the_same_blocks() -> None:
    tokens = list(range(100, 100 + 5 * BLOCK + 3))
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    seq = Sequence("r", tokens, SamplingParams())
    assert manager.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    manager.cache_full_blocks(seq)
    for blocks in range(1, 6):
        assert prefix_key(tokens, BLOCK, blocks, manager.root) == seq.block_hashes[blocks - 1]
    assert prefix_key(tokens, BLOCK, 99, manager.root) == seq.block_hashes[-1]  # as many as it has
    assert prefix_key(tokens[:BLOCK], BLOCK, 4, manager.root) is None  # the last token never counts


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [
        prefix_key([rng.randrange(4096) for _ in range(BLOCK + 1)], BLOCK, 1, ROOT)
        for _ in range(n)
    ]


def test_the_ring_gives_each_key_one_owner_and_spreads_them() -> None:
    workers = [Worker(f"http://w{i}") for i in range(3)]
    ring = PrefixAffinity(workers, load_factor=1.25)
    owners = [ring.candidates(k)[0].url for k in keys(600)]
    assert owners == [ring.candidates(k)[0].url for k in keys(600)]  # stable
    shares = Counter(owners)
    assert len(shares) == 3 and min(shares.values()) > 600 / 3 / 2  # none starved


def test_a_lost_worker_moves_only_its_own_keys() -> None:
    workers = [Worker(f"http://w{i}") for i in range(3)]
    ring = PrefixAffinity(workers, load_factor=1.25)
    before = [ring.candidates(k)[0] for k in keys(300)]
    workers[1].healthy = False
    after = [ring.candidates(k)[0] for k in keys(300)]
    assert workers[1] not in after
    moved = [(b, a) for b, a in zip(before, after) if b is not a]
    assert moved and all(b is workers[1] for b, _ in moved)


def test_a_full_owner_is_passed_over() -> None:
    workers = [Worker("http://a"), Worker("http://b")]
    ring = PrefixAffinity(workers, load_factor=1.25)
    key = keys(1)[0]
    owner = ring.candidates(key)[0]
    owner.in_flight = 4  # the other holds none: the cap is ceil(1.25 * (4 + 1) / 2) = 4
    assert ring.candidates(key)[0] is not owner
    owner.in_flight = 1  # the cap is ceil(1.25 * (1 + 1) / 2) = 2
    assert ring.candidates(key)[0] is owner


def test_round_robin_takes_turns_among_the_healthy() -> None:
    workers = [Worker(f"http://w{i}") for i in range(3)]
    rr = RoundRobin(workers)
    assert [rr.candidates(None)[0].url for _ in range(4)] == [
        "http://w0",
        "http://w1",
        "http://w2",
        "http://w0",
    ]
    workers[1].healthy = False
    assert all(rr.candidates(None)[0] is not workers[1] for _ in range(4))


def test_health_probes_are_not_logged_but_other_requests_are() -> None:
    """The router probes every worker every few seconds: neither side logs a line
    for each probe (httpx's request log, uvicorn's access log)."""
    import logging
    import subprocess
    import sys

    from engine.entrypoints.logs import QuietProbes

    def line(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:5", "GET", path, "1.1", 200)
        fmt = '%s - "%s %s HTTP/%s" %d'
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, fmt, args, None)

    quiet = QuietProbes()
    assert not quiet.filter(line("/health"))
    assert quiet.filter(line("/v1/completions")) and quiet.filter(line("/healthz"))
    code = (
        "import logging; from engine.entrypoints import logs; logs.configure('info'); "
        "assert not logging.getLogger('httpx').isEnabledFor(logging.INFO); "
        "assert any(isinstance(f, logs.QuietProbes) for f in "
        "logging.getLogger('uvicorn.access').filters)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
