"""The counters AsyncLLM keeps per request, pinned in process (issue 49): prompt
tokens counted once per prompt however many choices share it, generated tokens
as delivered, a finish by its reason, the prefix cache's lookups, and a
request whose caller stops listening counted once as aborted. The live server
tests (test_usage_and_metrics.py, test_concurrency.py) read the same counters
over HTTP, where mutation testing cannot see them."""

from __future__ import annotations

import asyncio

from engine.config import EngineConfig
from engine.entrypoints.async_llm import AsyncLLM
from engine.entrypoints.metrics import ServerMetrics
from tests.server.conftest import TINY
from tests.server.test_async_llm_counts import MODEL, params


def sample(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"deepinfer:{name}", {"model_name": MODEL, **labels})


async def scenario() -> tuple[ServerMetrics, list[str]]:
    config = EngineConfig(str(TINY), dtype="float32", num_kv_blocks=64, compile_decode=False)
    metrics = ServerMetrics(MODEL)
    llm = AsyncLLM(config, metrics, max_waiting=8)
    llm.start()
    seen: list[str] = []
    try:
        prompt = list(range(1, 21))  # 20 tokens: one full block of 16 to share
        two = {"a": (prompt, params(4)), "b": (prompt, params(3))}
        outs = [o async for o in llm.generate(two, repeats={"b"})]
        seen.append(f"two choices: {sorted((o.request_id, len(o.token_ids)) for o in outs[-2:])}")
        long = llm.generate({"c": ([7, 8, 9], params(500))})
        first = await anext(long)
        await long.aclose()  # the client went away after its first token
        seen.append(f"left after {len(first.token_ids)} of c")
        llm.abort(["c"])  # already aborted: not counted again
    finally:
        llm.stop()
    return metrics, seen


def test_prompt_generation_finish_and_abort_counts_are_exact() -> None:
    metrics, seen = asyncio.run(scenario())
    assert seen == ["two choices: [('a', 4), ('b', 3)]", "left after 1 of c"]
    assert sample(metrics, "prompt_tokens_total") == 20 + 3  # b repeats a's prompt
    assert sample(metrics, "generation_tokens_total") == 4 + 3 + 1
    assert sample(metrics, "request_success_total", finished_reason="length") == 2
    assert sample(metrics, "request_aborted_total") == 1
    assert sample(metrics, "request_failed_total") == 0
    assert sample(metrics, "request_rejected_total") == 0
    # Each request's prompt is looked up once; the three of them look up 43 tokens.
    assert sample(metrics, "prefix_cache_queries_total") == 20 + 20 + 3
    assert sample(metrics, "time_to_first_token_seconds_count") == 3
    assert sample(metrics, "e2e_request_latency_seconds_count") == 2
