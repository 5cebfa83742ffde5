"""`deepinfer serve --async-scheduling`: the engine core schedules each step while
the one before it runs, with its core in a process or in a thread, and clients
get what a synchronous server gives them. Underneath, the core's outbox is the
engine's output processor everywhere the engine uses one: its async loop and
its trace included."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.entrypoints.engine_core import EngineCore
from tests.server.conftest import (
    API_KEY,
    SERVE_ARGS,
    TINY,
    Running,
    auth,
    completion_choices,
    running,
)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
BODIES = [
    {"prompt": "def free(self", "max_tokens": 24, "temperature": 0},
    {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0},
    {"prompt": "class Block", "max_tokens": 16, "temperature": 0, "stop": ["e"]},
    {"prompt": "The KV cache", "max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 2},
    {
        "prompt": "answer:",
        "max_tokens": 24,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    },
]


def completion(url: str, body: dict, stream: bool = False) -> list[tuple[int, str, str]]:
    """(index, text, finish reason) of each choice, streamed or not."""
    return completion_choices(url, body, stream, auth())


@pytest.fixture(scope="module")
def async_servers() -> Iterator[list[Running]]:
    """Two async-scheduling servers, as the session's synchronous one is started:
    the engine core in a process (serve's default), and in a thread."""
    args = ("serve", str(TINY), *SERVE_ARGS, "--api-key", API_KEY, "--async-scheduling")
    with running(args, (*args, "--engine-core", "thread")) as servers:
        yield servers


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_async_scheduling_server_answers_as_a_synchronous_one(
    server, async_servers, stream
) -> None:
    for body in BODIES:
        expected = completion(server.url, body, stream)
        assert all(text for _, text, _ in expected), body
        for other in async_servers:
            assert completion(other.url, body, stream) == expected, (body, other.log_tail())


def engine_config(**kwargs: object) -> EngineConfig:
    return EngineConfig(
        model=str(TINY), dtype="float32", num_kv_blocks=64, max_model_len=128, **kwargs
    )


@pytest.mark.parametrize("option", ["async_scheduling", "trace"])
def test_a_cores_outputs_reach_the_outbox_that_saw_its_requests(option) -> None:
    """The core's engine is built with its outbox as its output processor: under
    async scheduling the async loop hands every step's outputs to it, and a
    trace times its process_outputs, not a processor the requests never reached."""
    prompts = ["def free(self", "class Block", "The KV cache"]
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = [
        o.token_ids for o in LLM(TINY, dtype="float32").generate(prompts, params, use_tqdm=False)
    ]
    core = EngineCore(engine_config(**{option: True}))
    engine = core.engine
    for i, prompt in enumerate(prompts):
        engine.add_sequence(engine.make_sequence(str(i), prompt, params), prompt)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        engine.step()
        for out in core.outbox.take():
            tokens[out.request_id] += out.new_token_ids
    assert list(tokens.values()) == expected
    if option == "trace":
        assert {s.stage for s in engine.trace.spans} >= {"schedule", "forward", "process"}
