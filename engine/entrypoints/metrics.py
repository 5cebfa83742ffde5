"""The server's Prometheus metrics, with vLLM's names under a `deepinfer:` prefix.

Latencies are measured in the front end, where the tokens reach the clients:
time to first token from the request's arrival, inter-token latency between a
request's successive outputs, end-to-end latency to its last; and, from the
times of the scheduler's events, queue time (arrival to first scheduled),
prefill time (scheduled to first token) and decode time (first token to last). The engine core's
state (running, waiting, cache usage, preemptions, speculative decoding's
counts) comes with each step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from engine.entrypoints.engine_core import CoreStats
from engine.entrypoints.kv_metrics import KVTransferMetrics
from engine.entrypoints.spec_metrics import SpecDecodeMetrics

disable_created_metrics()  # no *_created series: a scrape shows only what was measured

# CPU steps of a tiny model take milliseconds; a large model's prefill, seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


HANDLERS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model}

        def make(kind, name: str, doc: str, extra: tuple[str, ...] = (), **kw):
            metric = kind(f"deepinfer:{name}", doc, [*labels, *extra], registry=self.registry, **kw)
            return metric if extra else metric.labels(**labels)

        self.ttft = make(
            Histogram,
            "time_to_first_token_seconds",
            "Time to first token.",
            buckets=LATENCY_BUCKETS,
        )
        self.itl = make(
            Histogram,
            "inter_token_latency_seconds",
            "Time between tokens.",
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = make(
            Histogram,
            "e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=LATENCY_BUCKETS,
        )
        self.queue_time = make(
            Histogram,
            "request_queue_time_seconds",
            "Arrival to first scheduled.",
            buckets=LATENCY_BUCKETS,
        )
        self.prefill_time = make(
            Histogram,
            "request_prefill_time_seconds",
            "Last scheduled before the first token, to the first token.",
            buckets=LATENCY_BUCKETS,
        )
        self.decode_time = make(
            Histogram,
            "request_decode_time_seconds",
            "First token to last token.",
            buckets=LATENCY_BUCKETS,
        )
        self.running = make(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "Share of KV blocks in use (0-1).")
        self.prefix_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up.")
        self.prefix_hits = make(Counter, "prefix_cache_hits", "Prompt tokens found cached.")
        self.prefix_hit_rate = make(
            Gauge, "prefix_cache_hit_rate", "Prompt tokens found cached / looked up, since start."
        )
        self.preemptions = make(Counter, "num_preemptions", "Requests preempted.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated.")
        self._success = make(Counter, "request_success", "Finished requests.", ("finished_reason",))
        self.aborted = make(Counter, "request_aborted", "Requests aborted by their clients.")
        self.rejected = make(Counter, "request_rejected", "Requests refused: too many waiting.")
        self.failed = make(Counter, "request_failed", "Requests failed by the engine.")
        self.http = make(Counter, "http_requests", "HTTP requests answered.", ("handler", "status"))
        self.spec = SpecDecodeMetrics(make)
        self.kv_store = KVTransferMetrics(make, labels)
        self._labels = labels
        self._preemptions_seen = 0
        self._queried = self._hit = 0

    def prefix_lookup(self, queried: int, hit: int) -> None:
        """A request's first token: how much of its prompt the prefix cache held."""
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)
        self._queried, self._hit = self._queried + queried, self._hit + hit
        self.prefix_hit_rate.set(self._hit / self._queried if self._queried else 0.0)

    def answered(self, path: str, status: int) -> None:
        """One HTTP response; paths the server does not serve count as one, so
        that a scan of random URLs cannot grow the label set."""
        if path.startswith("/v1/models/"):
            handler = "/v1/models/{id}"
        else:
            handler = path if path in HANDLERS else "other"
        self.http.labels(**self._labels, handler=handler, status=str(status)).inc()

    def finished(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def core_stats(self, stats: CoreStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = stats.num_preemptions
        self.spec.update(stats)
        self.kv_store.update(stats.kv_transfer, stats.kv_records, stats.kv_store)
