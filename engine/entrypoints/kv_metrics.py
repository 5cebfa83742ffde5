"""The KV cache store's Prometheus metrics, named with the `deepinfer:` prefix (Chapter 8).

Counters, from the connector's cumulative stats: its hits (handed-on and
second-tier prefix hits apart), what failed its checks, bytes moved each way,
and time spent loading against the time computing the same tokens was estimated
to take. The store's own counts (hits, misses, corrupt entries, backend errors)
as `kv_store_backend_*`. And per request, from each load and save: histograms
of the bytes it moved, and of its transfer time over the estimated time to
compute the same tokens (below 1, moving them paid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from prometheus_client import Counter, Histogram

from engine.kv.store.base import StoreStats
from engine.stats import KVTransferRecord, KVTransferStats

HELP = {
    "loads": "Loads from the KV store begun (a preempted request loads again).",
    "hit_tokens": "Prompt tokens loaded from the KV store instead of computed.",
    "handoff_tokens": "Of those, tokens a prefill worker handed on.",
    "skipped_tokens": "Tokens the store held but that were recomputed, estimated cheaper.",
    "failed_blocks": "Blocks missing, corrupt or wrong when fetched, then recomputed.",
    "loaded_bytes": "Bytes loaded from the KV store.",
    "saved_bytes": "Bytes saved to the KV store.",
    "saved_blocks": "Blocks saved to the KV store.",
    "dropped_saves": "Finished requests not saved: too many bytes already waiting to be.",
    "load_seconds": "Seconds fetching, checking and writing blocks from the store.",
    "save_seconds": "Seconds saving blocks to the store.",
    "recompute_seconds_estimate": "Seconds computing the loaded tokens was estimated to take.",
}
BACKEND_HELP = {
    "hits": "Store reads that found a verified entry.",
    "misses": "Store reads that found nothing.",
    "corrupt": "Store reads that found a truncated, corrupt or misplaced entry (evicted).",
    "errors": "Store operations its backend failed (a miss, or a save lost).",
    "evictions": "Store entries this worker removed, for room or as corrupt.",
}
# A block of a tiny model is kilobytes; a long prompt of a large one, gigabytes.
BYTES_BUCKETS = tuple(float(4**k) for k in range(6, 17))  # 4 KiB .. 4 GiB
DIRECTIONS = ("load", "save")
RATIO_BUCKETS = (0.01, 0.03, 0.1, 0.3, 0.5, 1.0, 2.0, 3.0, 10.0, 30.0, 100.0)


class KVTransferMetrics:
    def __init__(self, make: Callable, labels: dict[str, str]) -> None:
        self.counters = {
            f.name: make(Counter, f"kv_store_{f.name}", HELP[f.name])
            for f in fields(KVTransferStats)
        }
        self.backend = {
            name: make(Counter, f"kv_store_backend_{name}", doc)
            for name, doc in BACKEND_HELP.items()
        }
        kind = ("direction",)  # "load" or "save"
        bytes_ = make(
            Histogram,
            "kv_store_request_bytes",
            "Bytes one request loaded from or saved to the store.",
            kind,
            buckets=BYTES_BUCKETS,
        )
        ratio = make(
            Histogram,
            "kv_store_request_transfer_to_recompute",
            "One request's transfer seconds over the estimated seconds to compute its tokens.",
            kind,
            buckets=RATIO_BUCKETS,
        )
        self.request_bytes = {d: bytes_.labels(**labels, direction=d) for d in DIRECTIONS}
        self.request_ratio = {d: ratio.labels(**labels, direction=d) for d in DIRECTIONS}
        self._seen, self._seen_backend = KVTransferStats(), StoreStats()

    def update(
        self, now: KVTransferStats, records: list[KVTransferRecord], store: StoreStats | None
    ) -> None:
        """Count what happened since the last update (the stats are cumulative),
        and observe each request's load or save."""
        for name, counter in self.counters.items():
            counter.inc(getattr(now, name) - getattr(self._seen, name))
        self._seen = now
        if store is not None:
            for name, counter in self.backend.items():
                counter.inc(getattr(store, name) - getattr(self._seen_backend, name))
            self._seen_backend = store
        for r in records:
            self.request_bytes[r.direction].observe(r.nbytes)
            if r.recompute_seconds_estimate > 0:
                ratio = r.seconds / r.recompute_seconds_estimate
                self.request_ratio[r.direction].observe(ratio)
