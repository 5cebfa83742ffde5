"""AsyncLLM's own request counters, in process (no server, no HTTP): a refusal
for too many waiting counts once per call, however many choices it carries, and
queues none of them; a request that shutdown ends counts once as failed, and
its caller gets a 503; a request that finishes counts as neither. The server
tests see these counters only through a live process, which mutation testing
cannot reach."""

from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.entrypoints.async_llm import AsyncLLM
from engine.entrypoints.errors import OpenAIError
from engine.entrypoints.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from tests.server.conftest import TINY

MODEL = "tiny"


def count(metrics: ServerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"deepinfer:{name}_total", {"model_name": MODEL})


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def scenario() -> tuple[ServerMetrics, list[str]]:
    config = EngineConfig(str(TINY), dtype="float32", num_kv_blocks=64, compile_decode=False)
    metrics = ServerMetrics(MODEL)
    llm = AsyncLLM(config, metrics, max_waiting=1)
    llm.start()
    seen = []
    try:
        two = {"a": ([1, 2, 3], params(4)), "b": ([1, 2, 3], params(4))}
        with pytest.raises(OpenAIError) as refused:
            llm.generate(two)  # two choices, one allowed to wait: both refused
        seen.append(f"refused {refused.value.status} queued {len(llm.sinks)}")
        outs = [o async for o in llm.generate({"c": ([4, 5, 6], params(3))})]
        seen.append(f"finished {outs[-1].finished} tokens {len(outs[-1].token_ids)}")
        long = llm.generate({"d": ([7, 8, 9], params(500))})
        first = await anext(long)  # running: it has its first token
        seen.append(f"running {first.request_id}")
        llm.drain(timeout=0)
        with pytest.raises(OpenAIError) as ended:
            async for _ in long:
                pass
        seen.append(f"ended {ended.value.status} left {len(llm.sinks)}")
    finally:
        llm.stop()
    return metrics, seen


def test_refusals_and_failures_count_once_each() -> None:
    metrics, seen = asyncio.run(scenario())
    assert seen == [
        "refused 503 queued 0",
        "finished True tokens 3",
        "running d",
        "ended 503 left 0",
    ]
    assert count(metrics, "request_rejected") == 1
    assert count(metrics, "request_failed") == 1
