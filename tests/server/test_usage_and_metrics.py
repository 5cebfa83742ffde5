"""What the server reports about its cache, against what the engine did: a
request's usage counts each prompt's cached tokens once, as its first choice
found them, when n > 1 choices share the prompt; and /metrics counts each
preemption once, however many steps come after it.

The server runs in this process (uvicorn in a thread) on deepinfer-tiny with a
cache of twenty-four 4-token blocks, so that the engine can be read beside it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import FastAPI

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from tests.server.conftest import TINY, in_thread, metric

BLOCK = 4
NUM_BLOCKS = 24  # 96 tokens: one request of 25 + 60 tokens fits, three at once do not
MAX_LEN = 96


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FastAPI]]:
    config = EngineConfig(
        model=str(TINY),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=MAX_LEN,
    )
    app = build_app(ServerConfig(config))
    with in_thread(app) as url:
        yield url, app


def post(url: str, **body) -> dict:
    body = {"model": "deepinfer-tiny", "temperature": 0, "ignore_eos": True, **body}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed_usage(url: str, **body) -> dict:
    """The usage chunk that ends a stream asked to include it."""
    body = {"model": "deepinfer-tiny", "temperature": 0, "ignore_eos": True, **body}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    assert events[-1]["choices"] == []
    return events[-1]["usage"]


def cached_prefix(prompt: list[int]) -> int:
    """What the prefix cache can give a prompt it holds whole: its full blocks,
    save that the last token is always computed (BlockManager.match_prefix)."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def test_usage_counts_each_prompts_cached_tokens_once_as_its_first_choice_found_them(
    served: tuple[str, FastAPI],
) -> None:
    """Bug guarded: cached_tokens taken from each prompt's last choice instead of
    its first. With n = 3, choices 1 and 2 of a new prompt share the blocks that
    choice 0 computes in the same step, so only the first choice's count says what
    the cache held for the prompt: nothing for a new one, the full blocks of a
    prompt sent before."""
    url, _ = served
    warm = list(range(1000, 1022))  # token ids no other test sends
    new = list(range(2000, 2022))
    assert post(url, prompt=warm, max_tokens=1)["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0
    }
    usage = post(url, prompt=[warm, new], n=3, max_tokens=2)["usage"]
    assert usage["prompt_tokens"] == len(warm) + len(new)
    assert usage["completion_tokens"] == 2 * 3 * 2
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached_prefix(warm) + 0
    # The same through a stream's usage chunk, on another new prompt.
    fresh = list(range(3000, 3022))
    usage = streamed_usage(url, prompt=fresh, n=3, max_tokens=2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    usage = streamed_usage(url, prompt=fresh, n=3, max_tokens=2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached_prefix(fresh)


PROMPTS = [
    f"The {part} of the engine keeps its state in blocks of sixteen tokens, and every "
    "step of the engine reads them"
    for part in ("scheduler", "block manager", "model runner")
]


def test_the_preemption_counter_equals_the_engines_count(served: tuple[str, FastAPI]) -> None:
    """Bug guarded: the metrics adding the engine's running total of preemptions at
    every step instead of the new ones. Three requests that do not fit the cache
    together preempt each other; afterwards /metrics reports exactly as many
    preemptions as the engine made."""
    url, app = served
    engine = app.state.llm.core.engine
    before = engine.stats.preemptions
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        list(pool.map(lambda p: post(url, prompt=p, max_tokens=60), PROMPTS))
    assert engine.stats.preemptions - before >= 2  # several, with steps between them
    assert metric(url, "deepinfer:num_preemptions_total") == engine.stats.preemptions
    assert metric(url, "deepinfer:num_requests_running") == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_with_include_usage_every_other_chunk_says_usage_null(
    served: tuple[str, FastAPI], path: str
) -> None:
    """As OpenAI's streams do; without include_usage no chunk has the field."""
    url, _ = served
    body = {"model": "deepinfer-tiny", "max_tokens": 3, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = "def free(self"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    for include in (True, False):
        events = []
        asked = body | {"stream_options": {"include_usage": True}} if include else body
        with httpx.stream("POST", url + path, json=asked, timeout=120) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line.removeprefix("data: ")))
        if include:
            assert all("usage" in e and e["usage"] is None for e in events[:-1]), events
            assert events[-1]["usage"]["completion_tokens"] == 3
        else:
            assert not any("usage" in e for e in events), events


def test_prompt_tokens_count_each_prompt_once_however_many_choices(
    served: tuple[str, FastAPI],
) -> None:
    """Bug guarded: prompt_tokens_total counted a prompt once per choice."""
    url, _ = served
    prompts = [list(range(3000, 3010)), list(range(3100, 3113))]
    before = metric(url, "deepinfer:prompt_tokens_total")
    post(url, prompt=prompts, n=3, max_tokens=2, temperature=1.0, seed=0)
    assert metric(url, "deepinfer:prompt_tokens_total") == before + sum(map(len, prompts))


def test_queue_prefill_and_decode_times_are_observed_once_per_request(
    served: tuple[str, FastAPI],
) -> None:
    url, _ = served
    names = [f"deepinfer:request_{k}_time_seconds" for k in ("queue", "prefill", "decode")]
    counts = [metric(url, n + "_count") for n in names]
    sums = [metric(url, n + "_sum") for n in names]
    post(url, prompt=[list(range(3200, 3212)), list(range(3300, 3305))], max_tokens=3)
    for name, count, total in zip(names, counts, sums):
        assert metric(url, name + "_count") == count + 2, name
        assert metric(url, name + "_sum") >= total, name  # times are never negative


def test_http_responses_are_counted_by_handler_and_status(served: tuple[str, FastAPI]) -> None:
    url, _ = served

    def count(handler: str, status: int) -> float:
        labels = f'handler="{handler}",model_name="deepinfer-tiny",status="{status}"'
        return metric(url, "deepinfer:http_requests_total{" + labels + "}")

    def send() -> None:
        post(url, prompt=[5, 6, 7], max_tokens=1)
        bad = httpx.post(url + "/v1/completions", json={"model": "deepinfer-tiny"}, timeout=30)
        assert bad.status_code == 400
        for path in ("/nope", "/nope/again", "/v2/x"):  # many paths, one label set
            assert httpx.get(url + path, timeout=30).status_code == 404

    send()  # each series exists from here on
    ok, bad = count("/v1/completions", 200), count("/v1/completions", 400)
    other = count("other", 404)
    send()
    assert count("/v1/completions", 200) == ok + 1
    assert count("/v1/completions", 400) == bad + 1
    assert count("other", 404) == other + 3
