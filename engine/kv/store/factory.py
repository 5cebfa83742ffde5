"""The store a command line names: ``redis://...`` is a Redis server, anything
else a directory on local disk (a path, or ``file://path``)."""

from __future__ import annotations

from engine.kv.store.base import KVStore
from engine.kv.store.disk import DiskStore
from engine.kv.store.redis_store import RedisStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(spec: str, max_bytes: int = 1 << 30) -> KVStore:
    """The store ``spec`` names. ``max_bytes`` bounds a disk store only: a Redis
    server is bounded by its own ``maxmemory``. ValueError if it cannot be used."""
    if not spec:
        raise ValueError("the KV store spec is empty: give a directory or a redis:// URL")
    if spec.startswith(REDIS_SCHEMES):
        return RedisStore(spec)
    return DiskStore(spec.removeprefix("file://"), max_bytes)
