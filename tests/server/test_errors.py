"""Bad input and bad luck: each bad request is a 400 in OpenAI's error shape
that names what is wrong, a body too large a 413, a missing key a 401, a full
queue a 503 with Retry-After, an engine failure a 500 with the request's id;
and after every one of them the server goes on serving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from tests.server.conftest import TINY, auth, in_thread

MODEL = "deepinfer-tiny"
GOOD = {"model": MODEL, "prompt": "def free(self", "max_tokens": 2}


def assert_openai_error(reply: httpx.Response, status: int, needle: str = "") -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert needle in error["message"], error["message"]
    return error


BAD_COMPLETIONS = [
    ({**GOOD, "max_tokens": -5}, "max_tokens"),
    ({**GOOD, "max_tokens": 0}, "max_tokens 0 is only allowed with echo"),
    ({**GOOD, "prompt": {"text": "hi"}}, "prompt"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "temperature": -1}, "temperature"),
    ({**GOOD, "top_p": 0}, "top_p"),
    ({**GOOD, "n": 0}, "n"),
    ({**GOOD, "logprobs": 9}, "logprobs"),
    ({**GOOD, "stop": [""]}, "stop strings"),
    ({**GOOD, "frequency_penalty": 2.5}, "frequency_penalty"),
    ({**GOOD, "prompt": ""}, "empty"),
    ({**GOOD, "prompt": []}, "empty"),
    ({**GOOD, "prompt": [5, 99999]}, "token ids"),
    ({**GOOD, "prompt": "word " * 200}, "maximum context length"),
    ({**GOOD, "max_tokens": 500}, "maximum context length"),
    ({"prompt": "hi"}, "model"),
]
BAD_CHATS = [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50}, ""),
    ({"model": MODEL, "messages": "hello"}, "messages"),
]


@pytest.mark.parametrize("body,needle", BAD_COMPLETIONS, ids=lambda v: str(v)[:40])
def test_bad_completion_is_a_400(server, body, needle) -> None:
    reply = httpx.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=30)
    assert_openai_error(reply, 400, needle)


@pytest.mark.parametrize("body,needle", BAD_CHATS, ids=lambda v: str(v)[:40])
def test_bad_chat_is_a_400(server, body, needle) -> None:
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(), timeout=30)
    assert_openai_error(reply, 400, needle)


def test_an_unknown_model_is_a_404_as_in_openai(server) -> None:
    reply = httpx.post(
        server.url + "/v1/completions", json={**GOOD, "model": "gpt-4o"}, headers=auth()
    )
    assert assert_openai_error(reply, 404, "does not exist")["code"] == "model_not_found"
    assert_openai_error(httpx.get(server.url + "/v1/models/gpt-4o", headers=auth()), 404)
    card = httpx.get(server.url + f"/v1/models/{MODEL}", headers=auth()).json()
    assert card["id"] == MODEL and card["object"] == "model"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_lone_surrogate_is_a_400_and_the_connection_lives_on(server, path) -> None:
    """ "\ud800" is valid JSON but no text: the tokenizer cannot take it."""
    if path == "/v1/completions":
        body = {**GOOD, "prompt": "a\ud800b"}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]}
    raw = json.dumps(body).encode()  # ASCII, with the escape as a client sends it
    headers = {**auth(), "content-type": "application/json"}
    with httpx.Client(timeout=30) as conn:  # one connection, kept alive across both
        assert_openai_error(conn.post(server.url + path, content=raw, headers=headers), 400)
        assert conn.post(server.url + "/v1/completions", json=GOOD, headers=auth()).is_success


def test_not_json_is_a_400_and_unknown_paths_are_404s(server) -> None:
    headers = {**auth(), "content-type": "application/json"}
    reply = httpx.post(server.url + "/v1/completions", content=b"{nope", headers=headers)
    assert_openai_error(reply, 400, "JSON")
    assert_openai_error(httpx.get(server.url + "/v1/nothing", headers=auth()), 404)
    assert_openai_error(httpx.get(server.url + "/v1/completions", headers=auth()), 405)


def test_a_body_over_the_limit_is_a_413_by_length_or_by_chunks(server) -> None:
    big = b'{"model": "deepinfer-tiny", "prompt": "' + b"x" * (5 * 2**20) + b'"}'
    headers = {**auth(), "content-type": "application/json"}
    reply = httpx.post(server.url + "/v1/completions", content=big, headers=headers, timeout=30)
    assert_openai_error(reply, 413, "larger than")

    def chunks():  # no Content-Length: the server must count
        for i in range(0, len(big), 2**16):
            yield big[i : i + 2**16]

    reply = httpx.post(server.url + "/v1/completions", content=chunks(), headers=headers)
    assert_openai_error(reply, 413, "larger than")


def test_the_api_key_guards_v1_only(server) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "test-key"}):
        error = assert_openai_error(httpx.get(server.url + "/v1/models", headers=headers), 401)
        assert error["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_any_number_of_stop_strings(server) -> None:
    """No cap on stop strings, as in vLLM (OpenAI's is 4): lm-eval adds the EOS text to a
    task's list, and HumanEval's then has five. The first that matches ends the reply."""
    stop = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<eos>"] + [f"zz{i}" for i in range(58)]
    body = {**GOOD, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=30)
    text = whole.json()["choices"][0]["text"]
    cut = {**body, "stop": stop + [text[2:4]]}  # 65 strings; the last cuts the reply short
    reply = httpx.post(server.url + "/v1/completions", json=cut, headers=auth(), timeout=30)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and text.startswith(choice["text"])
    assert len(choice["text"]) < len(text)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models"])
def test_head_answers_every_get_route_without_a_body(server, path: str) -> None:
    got = httpx.get(server.url + path, headers=auth())
    head = httpx.head(server.url + path, headers=auth())
    assert head.status_code == got.status_code == 200
    assert head.content == b"" and got.content
    assert head.headers["content-type"] == got.headers["content-type"]
    assert httpx.head(server.url + "/v1/completions", headers=auth()).status_code == 405


def test_the_server_still_serves_after_all_that(server) -> None:
    reply = httpx.post(server.url + "/v1/completions", json=GOOD, headers=auth(), timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------ in-process


@pytest.fixture(scope="module")
def app_url():
    """A server in this process, so a test can hold its engine still or break it."""
    config = EngineConfig(model=str(TINY), dtype="float32", num_kv_blocks=256, max_model_len=128)
    app = build_app(ServerConfig(config, max_waiting=2))
    with in_thread(app) as url:
        yield app, url


def test_a_full_queue_answers_503_with_retry_after(app_url) -> None:
    app, url = app_url
    engine = app.state.llm.core.engine
    release, step = threading.Event(), engine.step
    engine.step = lambda: (release.wait(30), step())[1]  # the core holds at its next step
    results: list[httpx.Response] = []

    def post() -> None:
        results.append(httpx.post(url + "/v1/completions", json=GOOD, timeout=60))

    try:
        senders = [threading.Thread(target=post) for _ in range(2)]
        for t in senders:
            t.start()
        deadline = time.monotonic() + 30
        while app.state.llm.num_waiting < 2:  # both accepted, neither has a token
            assert time.monotonic() < deadline, "the two requests never arrived"
            time.sleep(0.01)
        refused = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
        assert_openai_error(refused, 503, "too many requests waiting")
        assert refused.headers["retry-after"] == "1"
    finally:
        release.set()
        for t in senders:
            t.join(60)
        engine.step = step
    assert [r.status_code for r in results] == [200, 200]
    assert httpx.post(url + "/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_an_engine_failure_is_a_500_with_the_request_id(app_url, caplog) -> None:
    app, url = app_url
    executor = app.state.llm.core.engine.executor
    execute = executor.execute_model

    def fail_once(scheduler_output):
        executor.execute_model = execute
        raise RuntimeError("the device fell over")

    executor.execute_model = fail_once
    try:
        reply = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
    finally:
        executor.execute_model = execute
    error = assert_openai_error(reply, 500, "the device fell over")
    assert error["request_id"] == reply.headers["x-request-id"]
    assert error["request_id"] in caplog.text  # and in the log
    assert app.state.llm.core.engine.block_manager.num_free_blocks == 256  # nothing held
    again = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
    assert again.status_code == 200, again.text
    assert httpx.get(url + "/health").status_code == 200


def test_an_engine_failure_mid_stream_ends_it_with_an_error_event(app_url, caplog) -> None:
    """The stream's 200 is sent already: the error comes as its last event, with
    the request's id, before [DONE]."""
    app, url = app_url
    executor = app.state.llm.core.engine.executor
    execute, steps = executor.execute_model, []

    def fail_third(scheduler_output):
        steps.append(scheduler_output)
        if len(steps) < 3:
            return execute(scheduler_output)
        executor.execute_model = execute
        raise RuntimeError("the device fell over mid-stream")

    executor.execute_model = fail_third
    body = {**GOOD, "max_tokens": 8, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as reply:
            events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    finally:
        executor.execute_model = execute
    assert reply.status_code == 200 and events[-1] == "data: [DONE]"
    assert all("error" not in json.loads(e[6:]) for e in events[:-2])  # two tokens came
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "mid-stream" in error["message"] and error["type"] == "internal_server_error"
    assert error["request_id"] == reply.headers["x-request-id"]
    assert error["request_id"] in caplog.text
    assert app.state.llm.core.engine.block_manager.num_free_blocks == 256
    assert httpx.post(url + "/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_a_failure_in_the_front_end_is_a_500_too(app_url, caplog) -> None:
    """Turning a step's outputs into text can fail too (a tokenizer's bug): the
    requests of that step fail with a 500, the core drops them, the server goes on."""
    app, url = app_url
    llm = app.state.llm
    process = llm.processor.process_outputs

    def fail_once(outputs):
        llm.processor.process_outputs = process
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "not a character")

    llm.processor.process_outputs = fail_once
    try:
        reply = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
    finally:
        llm.processor.process_outputs = process
    error = assert_openai_error(reply, 500, "UnicodeDecodeError")
    assert error["request_id"] == reply.headers["x-request-id"]
    assert error["request_id"] in caplog.text
    engine = llm.core.engine
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() or engine.block_manager.num_free_blocks != 256:
        assert time.monotonic() < deadline, "the core kept the failed request"
        time.sleep(0.01)
    assert httpx.post(url + "/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_the_api_key_can_come_from_the_environment(monkeypatch) -> None:
    """`deepinfer serve` takes DEEPINFER_API_KEY when --api-key is not given."""
    from engine.entrypoints import api_server
    from engine.tools import cli

    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda config, *a: seen.append(config))
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    assert cli.main(["serve", str(TINY)]) == 0
    assert cli.main(["serve", str(TINY), "--api-key", "given"]) == 0
    monkeypatch.delenv("DEEPINFER_API_KEY")
    assert cli.main(["serve", str(TINY)]) == 0
    assert [c.api_key for c in seen] == ["from-env", "given", None]


def test_a_dead_engine_core_fails_its_requests_and_says_so() -> None:
    """If the core's thread itself fails (not a step: those it survives), the
    requests it held get a 500 instead of waiting forever, /health turns 503,
    and new requests are refused with 503."""
    app = build_app(ServerConfig(EngineConfig(model=str(TINY), dtype="float32", num_kv_blocks=64)))

    def broken(seq) -> None:
        raise RuntimeError("the core's queue is corrupt")

    app.state.llm.core.engine.add_sequence = broken
    with in_thread(app) as url:
        reply = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
        assert_openai_error(reply, 500, "the core's queue is corrupt")
        assert_openai_error(httpx.get(url + "/health", timeout=10), 503, "not running")
        again = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
        assert_openai_error(again, 503, "not running")
