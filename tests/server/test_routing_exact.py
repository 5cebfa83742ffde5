"""The router's placement decisions pinned to exact values (issue 49): the key at
the one-block boundary, the ring's points, the whole candidate order of either
policy, and the load cap's arithmetic. None of them changes a token, so only
an exact value shows one off by one."""

from __future__ import annotations

from engine.entrypoints.routing import (
    VIRTUAL_NODES,
    PrefixAffinity,
    RoundRobin,
    Worker,
    _point,
    prefix_key,
)
from engine.kv.hashing import chain_hash, chain_root
from tests.server.test_routing import keys

BLOCK = 16
ROOT = chain_root("test", "", BLOCK)


def urls(workers: list[Worker]) -> list[str]:
    return [w.url.removeprefix("http://") for w in workers]


def test_one_block_and_one_token_make_a_key_of_one_block() -> None:
    tokens = list(range(7, 7 + BLOCK + 1))  # the last token is never cached
    assert prefix_key(tokens, BLOCK, 4, ROOT) == chain_hash(ROOT, tokens[:BLOCK])
    assert prefix_key(tokens[:-1], BLOCK, 4, ROOT) is None


def test_a_ring_point_is_the_first_eight_bytes_of_sha256_big_endian() -> None:
    assert _point(b"http://w0#0") == 0x509D68B20B267744
    workers = [Worker(f"http://w{i}") for i in range(3)]
    ring = PrefixAffinity(workers, load_factor=1.25)
    assert len(ring.ring) == 3 * VIRTUAL_NODES == 192
    assert (_point(b"http://w0#0"), 0) in ring.ring and ring.points == sorted(ring.points)


def test_the_ring_orders_every_worker_clockwise_from_the_key() -> None:
    workers = [Worker(f"http://w{i}") for i in range(3)]
    ring = PrefixAffinity(workers, load_factor=1.25)
    assert [urls(ring.candidates(k)) for k in keys(6)] == [
        ["w1", "w0", "w2"],
        ["w1", "w0", "w2"],
        ["w2", "w0", "w1"],
        ["w1", "w0", "w2"],
        ["w1", "w2", "w0"],
        ["w1", "w0", "w2"],
    ]


def test_a_prompt_without_a_key_takes_round_robin_turns_over_every_worker() -> None:
    workers = [Worker(f"http://w{i}") for i in range(3)]
    ring = PrefixAffinity(workers, load_factor=1.25)
    assert [urls(ring.candidates(None)) for _ in range(3)] == [
        ["w0", "w1", "w2"],
        ["w1", "w2", "w0"],
        ["w2", "w0", "w1"],
    ]
    rr = RoundRobin(workers)
    workers[0].healthy = False
    assert [urls(rr.candidates(None)) for _ in range(2)] == [["w1", "w2"], ["w1", "w2"]]


def test_a_worker_at_the_cap_goes_last_and_is_not_dropped() -> None:
    workers = [Worker("http://a"), Worker("http://b")]
    ring = PrefixAffinity(workers, load_factor=1.25)
    key = keys(1)[0]
    owner, other = ring.candidates(key)
    owner.in_flight = 4  # the cap is ceil(1.25 * (4 + 0 + 1) / 2) = 4: the owner is at it
    assert ring.candidates(key) == [other, owner]
    owner.in_flight = 3  # the cap is ceil(1.25 * 4 / 2) = 3: still at it
    assert ring.candidates(key) == [other, owner]
    owner.healthy = other.healthy = False
    assert ring.candidates(key) == []


def test_the_cap_counts_the_request_being_placed() -> None:
    ring = PrefixAffinity([Worker("http://a")], load_factor=1.25)
    cases = [([], 0), ([0], 2), ([3, 0], 3), ([1, 1, 1], 2), ([6, 2], 6)]
    for loads, cap in cases:
        # [3, 0]: ceil(1.25 * 4 / 2) = 3; [6, 2]: ceil(1.25 * 9 / 2) = 6
        assert ring.capacity([Worker("http://w", in_flight=n) for n in loads]) == cap, loads
