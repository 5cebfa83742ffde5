"""The KV cache store's interface: bytes in, bytes out, under a block's hash.

A store keeps KV blocks beyond one engine's pool: on local disk, or in Redis
that several engines share. Its keys are the prefix cache's block hashes
(32-byte sha256 digests, namespaced by model), so identical prefixes share an
entry whoever computed them; its values are opaque bytes, one block of every
layer. A store is only a cache: whatever it cannot give back (missing, corrupt,
or its backend down) the engine recomputes, so no method raises for a backend's
failure. It counts each outcome instead (`StoreStats`), for /metrics.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Literal, Protocol

# One lock for every store's counters: get and put may run in two threads at
# once (the connector loads in the background), and `+=` on an attribute is not
# atomic. Held for a few additions, so one lock for all is no contention.
_COUNTING = threading.Lock()

Outcome = Literal["hit", "miss", "corrupt", "error"]  # what one get() found


@dataclass
class StoreStats:
    """Counters since this store was opened, in this process only, never reset."""

    hits: int = 0  # get() returned a verified entry
    misses: int = 0  # get() found nothing
    corrupt: int = 0  # get() found an entry that failed its check, and evicted it
    errors: int = 0  # the backend failed (Redis down, disk full): a miss, or a put lost
    bytes_read: int = 0  # value bytes of the hits
    bytes_written: int = 0  # value bytes of the puts that stored
    read_seconds: float = 0.0  # time in get(), whatever it found: a miss costs a lookup
    write_seconds: float = 0.0  # time in put()
    evictions: int = 0  # entries this process removed: for room, or by evict()

    def read(self, outcome: Outcome, seconds: float, nbytes: int = 0) -> None:
        """Count one get(), which found ``outcome`` (``nbytes`` of value, on a hit)."""
        with _COUNTING:
            self.hits += outcome == "hit"
            self.misses += outcome == "miss"
            self.corrupt += outcome == "corrupt"
            self.errors += outcome == "error"
            self.bytes_read += nbytes
            self.read_seconds += seconds

    def wrote(self, nbytes: int, seconds: float, failed: bool = False) -> None:
        """Count one put(), which stored ``nbytes`` unless it ``failed``."""
        with _COUNTING:
            self.errors += failed
            self.bytes_written += 0 if failed else nbytes
            self.write_seconds += seconds

    def add(self, *, errors: int = 0, evictions: int = 0) -> None:
        """Count what happened outside get and put (contains, evict)."""
        with _COUNTING:
            self.errors += errors
            self.evictions += evictions

    def snapshot(self) -> StoreStats:
        """A copy, consistent at one moment (for a metrics scrape)."""
        with _COUNTING:
            return replace(self)


class KVStore(Protocol):
    """What the connector needs of a store. Every method is safe to call from
    two threads at once, and none raises for its backend's failure."""

    stats: StoreStats

    @property
    def describe(self) -> str:
        """Where the store is, for logs: "disk:/path" or "redis://host:port/0"."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The value stored under ``key``, verified against its checksum; None if
        it is missing, corrupt (then evicted) or the backend is down."""
        ...

    def put(self, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any entry); a failure is counted."""
        ...

    def contains(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are present: the length of the
        stored prefix of a hash chain. A hint: an entry can still go before get()."""
        ...

    def evict(self, key: bytes) -> None:
        """Remove ``key``'s entry, if there is one."""
        ...

    def close(self) -> None:
        """Release connections; the store is not used after."""
        ...
