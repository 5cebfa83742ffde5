"""Every counter and gauge /metrics exports, pinned to its exact value on a
constructed case: the server's metrics fed known engine stats (cumulative, as
the core sends them after each step), then read back from their registry. A
counter off by one, counted twice, or fed the total instead of the difference
fails here; the end-to-end tests (test_metrics.py, test_spec_metrics.py) only
check that the live numbers agree with one another."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.entrypoints.engine_core import CoreStats
from engine.entrypoints.kv_metrics import BACKEND_HELP, HELP
from engine.entrypoints.metrics import ServerMetrics
from engine.kv.store.base import StoreStats
from engine.stats import KVTransferRecord, KVTransferStats, SpecDecodeStats

MODEL = "tiny"
LABELS = {"model_name": MODEL}


def value(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"deepinfer:{name}", {**LABELS, **labels})


def spec(accepted: list[int], chosen: list[int]) -> SpecDecodeStats:
    """The counts of verify steps that accepted ``accepted`` drafts, and the
    lengths ``chosen`` for requests given drafts."""
    stats = SpecDecodeStats()
    for n in chosen:
        stats.observe_chosen(n)
    for n in accepted:
        stats.observe(max(chosen), n)
    return stats


def test_spec_decode_stats_count_exactly() -> None:
    stats = SpecDecodeStats()
    stats.observe(3, 2)
    stats.observe(3, 3)
    stats.observe(2, 0)
    stats.observe_chosen(3)
    stats.observe_chosen(0)
    stats.observe_chosen(3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 5)
    assert stats.accepted_lengths == [1, 0, 1, 1]
    assert stats.chosen_lengths == [1, 0, 0, 2]
    assert stats.acceptance_rate == 5 / 8
    assert stats.mean_accepted_length == 1 + 5 / 3
    assert SpecDecodeStats().acceptance_rate == 0.0
    assert SpecDecodeStats().mean_accepted_length == 0.0


def test_core_counters_and_gauges_take_exact_values() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.core_stats(CoreStats(3, 2, 0.25, 4))
    metrics.core_stats(CoreStats(1, 0, 0.5, 7))  # cumulative: 3 more preemptions
    assert value(metrics, "num_requests_running") == 1
    assert value(metrics, "num_requests_waiting") == 0
    assert value(metrics, "kv_cache_usage_perc") == 0.5
    assert value(metrics, "num_preemptions_total") == 7
    metrics.prefix_lookup(10, 4)
    metrics.prefix_lookup(6, 0)
    assert value(metrics, "prefix_cache_queries_total") == 16
    assert value(metrics, "prefix_cache_hits_total") == 4
    assert value(metrics, "prefix_cache_hit_rate") == 4 / 16
    for reason in ("stop", "length", "stop"):
        metrics.finished(reason)
    assert value(metrics, "request_success_total", finished_reason="stop") == 2
    assert value(metrics, "request_success_total", finished_reason="length") == 1
    for path, status in [("/v1/models/x", 200), ("/v1/models/y", 404), ("/nope", 404),
                         ("/metrics", 200), ("/metrics", 200)]:  # fmt: skip
        metrics.answered(path, status)
    assert value(metrics, "http_requests_total", handler="/v1/models/{id}", status="200") == 1
    assert value(metrics, "http_requests_total", handler="/v1/models/{id}", status="404") == 1
    assert value(metrics, "http_requests_total", handler="other", status="404") == 1
    assert value(metrics, "http_requests_total", handler="/metrics", status="200") == 2


def test_a_fresh_server_reports_zero_hit_rate() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.prefix_lookup(0, 0)
    assert value(metrics, "prefix_cache_hit_rate") == 0.0


def test_spec_decode_counters_and_histograms_count_only_what_is_new() -> None:
    metrics = ServerMetrics(MODEL)
    first = CoreStats(1, 0, 0.0, 0, spec([2, 0], [3, 2]), forwards_per_output_token=0.75)
    metrics.core_stats(first)
    second = spec([2, 0, 3, 3], [3, 2, 3, 0, 3])  # two more steps, each of three accepted
    metrics.core_stats(CoreStats(1, 0, 0.0, 0, second, forwards_per_output_token=0.5))
    assert value(metrics, "spec_decode_num_drafts_total") == 4
    assert value(metrics, "spec_decode_num_draft_tokens_total") == 12
    assert value(metrics, "spec_decode_num_accepted_tokens_total") == 8
    assert value(metrics, "spec_decode_accepted_length_count") == 4
    assert value(metrics, "spec_decode_accepted_length_sum") == 8
    assert value(metrics, "spec_decode_accepted_length_bucket", le="0.0") == 1
    assert value(metrics, "spec_decode_accepted_length_bucket", le="2.0") == 2
    assert value(metrics, "spec_decode_accepted_length_bucket", le="3.0") == 4
    assert value(metrics, "spec_decode_chosen_length_count") == 5
    assert value(metrics, "spec_decode_chosen_length_sum") == 11
    assert value(metrics, "spec_decode_chosen_length_bucket", le="0.0") == 1
    assert value(metrics, "spec_decode_chosen_length_bucket", le="2.0") == 2
    assert value(metrics, "spec_decode_forwards_per_output_token") == 0.5


def transfer(scale: int) -> KVTransferStats:
    """Cumulative traffic whose every field is distinct: field i is scale * (i + 1)."""
    stats = KVTransferStats()
    for i, name in enumerate(HELP):
        setattr(stats, name, scale * (i + 1))
    return stats


def test_kv_store_counters_count_the_difference_since_the_last_step() -> None:
    metrics = ServerMetrics(MODEL)
    store = StoreStats(hits=5, misses=3, corrupt=1, errors=2, evictions=4)
    metrics.core_stats(CoreStats(0, 0, 0.0, 0, kv_transfer=transfer(1), kv_store=store))
    later = replace(store, hits=9, misses=4, corrupt=1, errors=6, evictions=11)
    metrics.core_stats(CoreStats(0, 0, 0.0, 0, kv_transfer=transfer(3), kv_store=later))
    metrics.core_stats(CoreStats(0, 0, 0.0, 0, kv_transfer=transfer(3)))  # no store's counts
    for i, name in enumerate(HELP):
        assert value(metrics, f"kv_store_{name}_total") == 3 * (i + 1), name
    for name in BACKEND_HELP:
        assert value(metrics, f"kv_store_backend_{name}_total") == getattr(later, name), name


@pytest.mark.parametrize("direction", ["load", "save"])
def test_kv_store_request_histograms_observe_each_record(direction: str) -> None:
    metrics = ServerMetrics(MODEL)
    records = [
        KVTransferRecord(direction, 16, 4096, 0.02, 0.01),  # ratio 2: moving lost
        KVTransferRecord(direction, 32, 4097, 0.01, 0.04),  # ratio 0.25
        KVTransferRecord(direction, 8, 100, 0.5, 0.0),  # no estimate: no ratio
    ]
    metrics.core_stats(CoreStats(0, 0, 0.0, 0, kv_records=records))
    on = {"direction": direction}
    other = {"direction": "save" if direction == "load" else "load"}
    assert value(metrics, "kv_store_request_bytes_count", **on) == 3
    assert value(metrics, "kv_store_request_bytes_sum", **on) == 4096 + 4097 + 100
    assert value(metrics, "kv_store_request_bytes_bucket", le="4096.0", **on) == 2
    assert value(metrics, "kv_store_request_bytes_bucket", le="16384.0", **on) == 3
    assert value(metrics, "kv_store_request_bytes_count", **other) == 0
    assert value(metrics, "kv_store_request_transfer_to_recompute_count", **on) == 2
    assert value(metrics, "kv_store_request_transfer_to_recompute_sum", **on) == 2.25
    assert value(metrics, "kv_store_request_transfer_to_recompute_bucket", le="0.3", **on) == 1
    assert value(metrics, "kv_store_request_transfer_to_recompute_bucket", le="2.0", **on) == 2
