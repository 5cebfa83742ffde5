"""Speculative decoding's Prometheus metrics, vLLM's spec_decode names under
`deepinfer:`: verify steps, drafted and accepted tokens, the accepted length
per verify step and the drafts chosen for verification per request and step
(histograms), and target forwards per output token."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from engine.entrypoints.engine_core import CoreStats
from engine.stats import SpecDecodeStats

# Accepted drafts per verify step: 0..k, k at most 16 here.
LENGTH_BUCKETS = tuple(float(n) for n in range(17))


class SpecDecodeMetrics:
    def __init__(self, make: Callable) -> None:
        self.num_drafts = make(Counter, "spec_decode_num_drafts", "Verify steps (with drafts).")
        self.draft_tokens = make(
            Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed and verified."
        )
        self.accepted_tokens = make(
            Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.accepted_length = make(
            Histogram,
            "spec_decode_accepted_length",
            "Drafts accepted per verify step.",
            buckets=LENGTH_BUCKETS,
        )
        self.chosen_length = make(
            Histogram,
            "spec_decode_chosen_length",
            "Drafts a request was scheduled to verify, per step that gave it drafts.",
            buckets=LENGTH_BUCKETS,
        )
        self.forwards_per_token = make(
            Gauge, "spec_decode_forwards_per_output_token", "Target forwards per output token."
        )
        self._seen = SpecDecodeStats()

    def update(self, stats: CoreStats) -> None:
        """Count what happened since the last update (the stats are cumulative)."""
        now, seen = stats.spec_decode, self._seen
        self.num_drafts.inc(now.num_drafts - seen.num_drafts)
        self.draft_tokens.inc(now.num_draft_tokens - seen.num_draft_tokens)
        self.accepted_tokens.inc(now.num_accepted_tokens - seen.num_accepted_tokens)
        observe_new(self.accepted_length, now.accepted_lengths, seen.accepted_lengths)
        observe_new(self.chosen_length, now.chosen_lengths, seen.chosen_lengths)
        self.forwards_per_token.set(stats.forwards_per_output_token)
        self._seen = now


def observe_new(histogram: Histogram, now: list[int], seen: list[int]) -> None:
    """Observe each length as often as its count grew since ``seen``."""
    for length, count in enumerate(now):
        before = seen[length] if length < len(seen) else 0
        for _ in range(count - before):
            histogram.observe(length)
