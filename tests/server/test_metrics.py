"""/metrics reports what the issue lists, measured: latency histograms (time to
first token, inter-token, end to end) that count every request, the running
and waiting requests and the cache's use, prefix-cache lookups and hits,
preemptions, and generated tokens. A cache too small for three requests at
once preempts them, and they are resumed with their text unchanged."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from tests.server.conftest import TINY, in_thread, metric

# Three requests that each grow to about seven 16-token blocks: one alone fits
# in twelve blocks, three at once do not.
NUM_BLOCKS = 12
MAX_TOKENS = 80
PROMPTS = [
    f"The {part} of the engine keeps its state in blocks of sixteen tokens, and every "
    "step of the engine reads them"
    for part in ("scheduler", "block manager", "model runner")
]


@pytest.fixture(scope="module")
def url():
    config = EngineConfig(
        model=str(TINY), dtype="float32", num_kv_blocks=NUM_BLOCKS, max_model_len=128
    )
    with in_thread(build_app(ServerConfig(config))) as url:
        yield url


def complete(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": "deepinfer-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def m(url: str, name: str) -> float:
    return metric(url, "deepinfer:" + name)


def test_preempted_requests_resume_unchanged_and_every_metric_counts(url) -> None:
    # The same prompt twice: the second finds the first's full blocks cached.
    first, second = (complete(url, PROMPTS[0], 1)["usage"] for _ in range(2))
    hits = second["prompt_tokens_details"]["cached_tokens"]
    assert hits >= 16 and first["prompt_tokens_details"]["cached_tokens"] == 0
    assert m(url, "prefix_cache_queries_total") == first["prompt_tokens"] * 2
    assert m(url, "prefix_cache_hits_total") == hits
    assert m(url, "prefix_cache_hit_rate") == hits / (first["prompt_tokens"] * 2)

    alone = [complete(url, p)["choices"][0]["text"] for p in PROMPTS]
    assert m(url, "num_preemptions_total") == 0
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(url, p)["choices"][0]["text"], PROMPTS))
    assert m(url, "num_preemptions_total") > 0  # the cache could not hold all three
    assert together == alone  # preempted, resumed, and unchanged

    requests = 2 + 2 * len(PROMPTS)
    tokens = 2 + 2 * len(PROMPTS) * MAX_TOKENS
    assert m(url, "generation_tokens_total") == tokens
    assert m(url, "time_to_first_token_seconds_count") == requests
    assert m(url, "e2e_request_latency_seconds_count") == requests
    # Every token after a request's first is one inter-token gap (or several
    # tokens in one gap, when a step's text holds back a partial character).
    gaps = m(url, "inter_token_latency_seconds_count")
    assert 0 < gaps <= tokens - requests
    assert m(url, "request_success_total") == requests
    assert m(url, "time_to_first_token_seconds_sum") > 0
    # All done: nothing running, waiting, or holding a block.
    assert m(url, "num_requests_running") == 0
    assert m(url, "num_requests_waiting") == 0
    assert m(url, "kv_cache_usage_perc") == 0
