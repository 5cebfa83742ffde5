"""The KV cache store's Prometheus metrics under `deepinfer:` (Chapter 8): its
hits (handed-on and second-tier prefix hits apart), what failed its checks,
bytes moved each way, and time spent loading against the time computing the
same tokens was estimated to take. All counters, from cumulative stats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from prometheus_client import Counter

from engine.core.stats import KVTransferStats

HELP = {
    "loads": "Loads from the KV store begun (a preempted request loads again).",
    "hit_tokens": "Prompt tokens loaded from the KV store instead of computed.",
    "handoff_tokens": "Of those, tokens a prefill worker handed on.",
    "skipped_tokens": "Tokens the store held but that were recomputed, estimated cheaper.",
    "failed_blocks": "Blocks missing, corrupt or wrong when fetched, then recomputed.",
    "loaded_bytes": "Bytes loaded from the KV store.",
    "saved_bytes": "Bytes saved to the KV store.",
    "saved_blocks": "Blocks saved to the KV store.",
    "load_seconds": "Seconds fetching, checking and writing blocks from the store.",
    "save_seconds": "Seconds saving blocks to the store.",
    "recompute_seconds_estimate": "Seconds computing the loaded tokens was estimated to take.",
}


class KVTransferMetrics:
    def __init__(self, make: Callable) -> None:
        self.counters = {
            f.name: make(Counter, f"kv_store_{f.name}", HELP[f.name])
            for f in fields(KVTransferStats)
        }
        self._seen = KVTransferStats()

    def update(self, now: KVTransferStats) -> None:
        """Count what happened since the last update (the stats are cumulative)."""
        for name, counter in self.counters.items():
            counter.inc(getattr(now, name) - getattr(self._seen, name))
        self._seen = now
