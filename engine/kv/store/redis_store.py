"""The cache store in Redis, shared by every engine that reaches the server.

Entries are framed as on disk (entry.py) and stored under ``deepinfer:kv:`` and
the key's hex, so that they are easy to find with redis-cli and cannot collide
with other users of the same server.

Redis evicts for itself: whoever runs the server bounds it and picks LRU, as in
``redis-server --maxmemory 4gb --maxmemory-policy allkeys-lru`` (the tests' own
server runs with 64mb). Without a bound Redis grows until the machine runs out
of memory; with ``noeviction`` a full server refuses puts, counted as errors.
Persistence is not needed (``--save "" --appendonly no``): a lost entry is a miss.

Redis may stop while engines run. Construction pings it, so a wrong URL fails at
start-up; after that every failure is counted in ``stats.errors`` and reads as
a miss, never raised, and the store works again once Redis is back (redis-py
reconnects on the next call). Short socket timeouts bound what a dead or hung
server costs a step: one attempt and one retry, each at most ``TIMEOUT_S``.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.kv.store.base import Outcome, StoreStats
from engine.kv.store.entry import frame, unframe

PREFIX = b"deepinfer:kv:"
TIMEOUT_S = 1.0


class RedisStore:
    """Entries in the Redis server at ``url`` (redis://host:port/db)."""

    def __init__(self, url: str) -> None:
        self.describe = without_password(url)
        self.stats = StoreStats()
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=TIMEOUT_S,
                socket_connect_timeout=TIMEOUT_S,
                retry=Retry(NoBackoff(), 1),  # once more: a restarted server's stale socket
            )
            self._client.ping()
        except (redis.RedisError, ValueError) as e:
            raise ValueError(f"cannot reach the KV store at {self.describe}: {e}") from e

    def get(self, key: bytes) -> bytes | None:
        start = time.perf_counter()
        outcome, value = self._read(key)
        self.stats.read(outcome, time.perf_counter() - start, len(value or b""))
        return value

    def _read(self, key: bytes) -> tuple[Outcome, bytes | None]:
        name = _name(key)
        try:
            data = self._client.get(name)
            if data is None:
                return "miss", None
            value = unframe(key, data)
            if value is None:  # removed, so the next get is a plain miss
                self._client.delete(name)
                return "corrupt", None
        except redis.RedisError:
            return "error", None
        return "hit", value

    def put(self, key: bytes, value: bytes) -> None:
        start = time.perf_counter()
        try:
            self._client.set(_name(key), frame(key, value))
            failed = False
        except redis.RedisError:
            failed = True
        self.stats.wrote(len(value), time.perf_counter() - start, failed)

    def contains(self, keys: list[bytes]) -> int:
        pipe = self._client.pipeline(transaction=False)  # one round trip for all
        for key in keys:
            pipe.exists(_name(key))
        try:
            found = pipe.execute() if keys else []
        except redis.RedisError:
            self.stats.add(errors=1)
            return 0
        present = 0
        while present < len(found) and found[present]:
            present += 1
        return present

    def evict(self, key: bytes) -> None:
        try:
            self.stats.add(evictions=self._client.delete(_name(key)))
        except redis.RedisError:
            self.stats.add(errors=1)

    def close(self) -> None:
        self._client.close()


def _name(key: bytes) -> bytes:
    return PREFIX + key.hex().encode()


def without_password(url: str) -> str:
    """``url`` as it may appear in a log: any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()
