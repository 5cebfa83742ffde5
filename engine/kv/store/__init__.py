"""The KV cache store: KV blocks kept beyond one engine's pool, under their
block hashes, on local disk (the default) or in Redis; ``open_store`` picks one
from a command line's spec."""

from engine.kv.store.base import KVStore, StoreStats
from engine.kv.store.disk import DiskStore
from engine.kv.store.entry import frame, unframe
from engine.kv.store.factory import open_store
from engine.kv.store.redis_store import RedisStore

__all__ = ["DiskStore", "KVStore", "RedisStore", "StoreStats", "frame", "open_store", "unframe"]
