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


# What /metrics exports, by name under `deepinfer:`: its type and its help line,
# as a scrape shows them. A metric renamed, retyped or dropped changes a client's
# dashboard, so each is named here.
CATALOGUE = {
    "time_to_first_token_seconds": ("histogram", "Time to first token."),
    "inter_token_latency_seconds": ("histogram", "Time between tokens."),
    "e2e_request_latency_seconds": ("histogram", "Arrival to last token."),
    "request_queue_time_seconds": ("histogram", "Arrival to first scheduled."),
    "request_prefill_time_seconds": (
        "histogram",
        "Last scheduled before the first token, to the first token.",
    ),
    "request_decode_time_seconds": ("histogram", "First token to last token."),
    "num_requests_running": ("gauge", "Requests in the running batch."),
    "num_requests_waiting": ("gauge", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("gauge", "Share of KV blocks in use (0-1)."),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up."),
    "prefix_cache_hits": ("counter", "Prompt tokens found cached."),
    "prefix_cache_hit_rate": ("gauge", "Prompt tokens found cached / looked up, since start."),
    "num_preemptions": ("counter", "Requests preempted."),
    "prompt_tokens": ("counter", "Prompt tokens of started requests."),
    "generation_tokens": ("counter", "Tokens generated."),
    "request_success": ("counter", "Finished requests."),
    "request_aborted": ("counter", "Requests aborted by their clients."),
    "request_rejected": ("counter", "Requests refused: too many waiting."),
    "request_failed": ("counter", "Requests failed by the engine."),
    "http_requests": ("counter", "HTTP requests answered."),
    "spec_decode_num_drafts": ("counter", "Verify steps (with drafts)."),
    "spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed and verified."),
    "spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted."),
    "spec_decode_accepted_length": ("histogram", "Drafts accepted per verify step."),
    "spec_decode_chosen_length": (
        "histogram",
        "Drafts a request was scheduled to verify, per step that gave it drafts.",
    ),
    "spec_decode_forwards_per_output_token": ("gauge", "Target forwards per output token."),
    "kv_store_loads": (
        "counter",
        "Loads from the KV store begun (a preempted request loads again).",
    ),
    "kv_store_hit_tokens": (
        "counter",
        "Prompt tokens loaded from the KV store instead of computed.",
    ),
    "kv_store_handoff_tokens": ("counter", "Of those, tokens a prefill worker handed on."),
    "kv_store_skipped_tokens": (
        "counter",
        "Tokens the store held but that were recomputed, estimated cheaper.",
    ),
    "kv_store_failed_blocks": (
        "counter",
        "Blocks missing, corrupt or wrong when fetched, then recomputed.",
    ),
    "kv_store_loaded_bytes": ("counter", "Bytes loaded from the KV store."),
    "kv_store_saved_bytes": ("counter", "Bytes saved to the KV store."),
    "kv_store_saved_blocks": ("counter", "Blocks saved to the KV store."),
    "kv_store_dropped_saves": (
        "counter",
        "Finished requests not saved: too many bytes already waiting to be.",
    ),
    "kv_store_load_seconds": (
        "counter",
        "Seconds fetching, checking and writing blocks from the store.",
    ),
    "kv_store_save_seconds": ("counter", "Seconds saving blocks to the store."),
    "kv_store_recompute_seconds_estimate": (
        "counter",
        "Seconds computing the loaded tokens was estimated to take.",
    ),
    "kv_store_backend_hits": ("counter", "Store reads that found a verified entry."),
    "kv_store_backend_misses": ("counter", "Store reads that found nothing."),
    "kv_store_backend_corrupt": (
        "counter",
        "Store reads that found a truncated, corrupt or misplaced entry (evicted).",
    ),
    "kv_store_backend_errors": (
        "counter",
        "Store operations its backend failed (a miss, or a save lost).",
    ),
    "kv_store_backend_evictions": (
        "counter",
        "Store entries this worker removed, for room or as corrupt.",
    ),
    "kv_store_request_bytes": ("histogram", "Bytes one request loaded from or saved to the store."),
    "kv_store_request_transfer_to_recompute": (
        "histogram",
        "One request's transfer seconds over the estimated seconds to compute its tokens.",
    ),
}
LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BUCKETS = {
    **dict.fromkeys([n for n, (t, _) in CATALOGUE.items() if n.endswith("_seconds")], LATENCY),
    "spec_decode_accepted_length": tuple(range(17)),
    "spec_decode_chosen_length": tuple(range(17)),
    "kv_store_request_bytes": tuple(4**k for k in range(6, 17)),
    "kv_store_request_transfer_to_recompute": (0.01, 0.03, 0.1, 0.3, 0.5, 1, 2, 3, 10, 30, 100),
}


def test_every_metric_is_exported_under_its_name_type_help_and_buckets() -> None:
    metrics = ServerMetrics(MODEL)
    families = {f.name.removeprefix("deepinfer:"): f for f in metrics.registry.collect()}
    assert {n: (f.type, f.documentation) for n, f in families.items()} == CATALOGUE
    for name, family in families.items():
        bounds = [float(s.labels["le"]) for s in family.samples if "le" in s.labels]
        if family.type == "histogram":
            per_series = len(bounds) // len({s.labels.get("direction") for s in family.samples})
            assert bounds[:per_series] == [*map(float, BUCKETS[name]), float("inf")], name
        else:
            assert bounds == [], name
