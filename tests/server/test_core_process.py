"""The engine core in a process of its own (core_process.py), as `deepinfer
serve` runs it: the same answers as the core in a thread, a bad request refused
by the front end, and a core that dies or a front end that dies taking nothing
with it that should live on.

Both servers run in this process under uvicorn (in_thread), on deepinfer-tiny
in float32, so that the two cores can be compared request by request."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import engine.runner.model_runner as model_runner
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.entrypoints.api_server import ServerConfig, build_app
from engine.entrypoints.core_process import CoreProcess
from engine.entrypoints.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.tools.launch import descendants
from tests.conftest import wait_gone
from tests.server.conftest import SERVE_ARGS, TINY, completion_choices, in_thread, running

MODEL = "deepinfer-tiny"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
# Greedy, seeded sampling over two choices, a stop string, and a JSON schema:
# each must come back the same from either core.
BODIES = [
    {"prompt": "def free(self", "max_tokens": 12, "temperature": 0},
    {"prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 1.0, "seed": 7, "n": 2},
    {"prompt": "class Block", "max_tokens": 16, "temperature": 0, "stop": ["e"]},
    {
        "prompt": "answer:",
        "max_tokens": 24,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    },
]


def config() -> EngineConfig:
    return EngineConfig(model=str(TINY), dtype="float32", num_kv_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def both() -> Iterator[tuple[str, str, CoreProcess]]:
    """(the thread core's URL, the process core's URL, the process core)."""
    thread_app = build_app(ServerConfig(config(), engine_core="thread"))
    process_app = build_app(ServerConfig(config(), engine_core="process"))
    with in_thread(thread_app) as a, in_thread(process_app) as b:
        yield a, b, process_app.state.llm.core


def completion(url: str, body: dict, stream: bool = False) -> list[tuple[int, str, str]]:
    """(index, text, finish reason) of each choice, streamed or not."""
    return completion_choices(url, body, stream, None)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", BODIES, ids=["greedy", "seeded-n2", "stop", "schema"])
def test_the_process_core_answers_as_the_thread_core_does(both, body, stream) -> None:
    thread_url, process_url, _ = both
    expected = completion(thread_url, body, stream)
    assert all(text for _, text, _ in expected)
    assert completion(process_url, body, stream) == expected


def test_a_bad_request_is_refused_before_it_reaches_the_core(both) -> None:
    _, url, core = both
    sent = core.checker.num_added
    for body in (
        {"prompt": [5, 99999], "max_tokens": 2},  # outside the vocabulary
        {"prompt": "hi", "max_tokens": 2, "logit_bias": {"99999": 5}},
        {
            "prompt": "hi",
            "max_tokens": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        },
    ):
        reply = httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
        assert reply.status_code == 400, reply.text
    assert core.checker.num_added == sent  # nothing crossed to the core
    assert completion(url, BODIES[0])  # and it goes on serving


def test_a_killed_core_process_fails_its_requests_and_the_server_says_so() -> None:
    app = build_app(ServerConfig(config(), engine_core="process"))
    core: CoreProcess = app.state.llm.core
    with in_thread(app) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "ignore_eos": True}
        with httpx.stream(
            "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # under way
            os.kill(core.process.pid, signal.SIGKILL)
            rest = list(lines)
        assert any('"error"' in line for line in rest), rest  # the stream ends with an error
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "exited" in health.text, health.text
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 503, reply.text
    assert not core.process.is_alive()


def core_processes(pid: int) -> list[int]:
    """The server's descendants that multiprocessing spawned (not its resource tracker)."""
    return [k for k in descendants(pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def test_a_core_outlives_neither_a_graceful_stop_nor_a_killed_server() -> None:
    for kill in (False, True):
        with running(("serve", str(TINY), *SERVE_ARGS)) as (server,):
            [core] = core_processes(server.proc.pid)
            assert Path(f"/proc/{core}").exists()
            # the core logs at the server's level: its start-up compile, at INFO
            assert "compiled the decode step" in server.log.read_text(), server.log_tail()
            if kill:
                server.kill()
            else:
                server.proc.terminate()
                server.proc.wait(timeout=60)
        assert not wait_gone([core], 30), f"the core process {core} outlived its server ({kill=})"


def test_a_thread_core_loads_its_model_in_the_thread_that_steps_it(monkeypatch) -> None:
    """The thread core's model loads in the core's own thread, not the caller's:
    a second thread running torch's parallel operators would give OpenMP a
    second pool and slow every forward pass (runner/torch_thread.py)."""
    threads: dict[str, set[int]] = {"load": set(), "step": set()}
    load, step = model_runner.load_model, LLMEngine.step

    def recorded_load(*args, **kwargs):
        threads["load"].add(threading.get_ident())
        return load(*args, **kwargs)

    def recorded_step(self):
        threads["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(model_runner, "load_model", recorded_load)
    monkeypatch.setattr(LLMEngine, "step", recorded_step)
    core = EngineCore.in_thread(config())
    batches = []
    core.start(batches.append)
    core.add([core.make_sequence("a", [5, 6, 7], SamplingParams(max_tokens=3))])
    deadline = time.monotonic() + 60
    while not any(o.finish_reason for b in batches for o in b.outputs):
        assert time.monotonic() < deadline, "the core gave no finished output"
        time.sleep(0.01)
    core.stop()
    assert threads["step"] and threads["load"] == threads["step"] == {core.thread.ident}
    assert threading.get_ident() not in threads["load"]
