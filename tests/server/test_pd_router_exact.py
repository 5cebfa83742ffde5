"""The PD router's settings, counters, decisions and side routes pinned to exact
values (issue 49), in process as test_pd_router_in_process.py drives it: the
/metrics text, which requests a handoff carries, what each worker is sent and
with what timeout, how a decode worker's stream is cut into events, which
worker is left and which kept, and the start-up check of the workers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from engine.entrypoints import pd_router as pd_module
from engine.entrypoints.pd_router import (
    PLAIN_FIELDS,
    PDRouter,
    PDRouterConfig,
    handoff_able,
    parse_event,
    run_pd_router,
)
from engine.entrypoints.prompt_tokens import bytes_per_token
from engine.entrypoints.routing import PrefixAffinity, RoundRobin, prefix_key
from engine.kv.hashing import chain_root
from tests.server.test_pd_router_in_process import (
    BODY,
    D1,
    D2,
    P1,
    P2,
    PREFILLED,
    Handler,
    answer,
    counts,
    data_lines,
    event,
    pd_app,
    post,
    streaming,
    unreachable,
)
from tests.server.test_router_exact import (
    TwoAtOnce,
    lifespan_until,
    model,  # noqa: F401  (a fixture)
    served,
)

LOGGER = "deepinfer.router"
WHOLE = answer(200, {"id": "d", "choices": [{"text": "BCD"}]})
SSE = "text/event-stream"


async def get(app, path: str, method: str = "GET") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router.test") as client:
        return await client.request(method, path)


def test_the_defaults_and_what_the_router_builds_from_them() -> None:
    config = PDRouterConfig([P1 + "/"], [D1 + "/"])
    assert (config.model, config.block_size, config.prefix_blocks, config.load_factor) == (
        None,
        16,
        4,
        1.25,
    )
    assert (config.health_interval, config.connect_timeout, config.idle_timeout) == (
        2.0,
        2.0,
        120.0,
    )
    router = PDRouter(config)
    assert [w.url for w in router.prefill] == [P1] and [w.url for w in router.decode] == [D1]
    assert isinstance(router.policy, RoundRobin) and router.policy.workers is router.prefill
    assert router.root == chain_root("router", "", 16)
    assert router.client.timeout == httpx.Timeout(None, connect=2.0)
    assert counts(router) == dict.fromkeys(counts(router), 0.0)


def test_with_a_model_the_prefill_worker_is_chosen_by_prefix(model: Path) -> None:  # noqa: F811
    config = PDRouterConfig([P1, P2, "http://p3.test"], [D1], str(model), 4, 2, 1.5)
    router = PDRouter(config)
    assert isinstance(router.policy, PrefixAffinity) and router.policy.load_factor == 1.5
    assert router.policy.workers is router.prefill
    assert router.tokens.max_chars == (4 * 2 + 1) * bytes_per_token(router.tokens.tokenizer)
    sent: list[str] = []

    async def transport(request: httpx.Request) -> httpx.Response:
        sent.append(f"{request.url.scheme}://{request.url.host}")
        return httpx.Response(400, json={"error": {}})

    router.client = httpx.AsyncClient(transport=httpx.MockTransport(transport))
    root = chain_root("router", "", 4)
    for text in ("the quick brown fox jumps", "over the lazy dog", "def free(self", "1 2 3 4 5"):
        body = {"prompt": text * 3}
        key = prefix_key(router.tokens.of("/v1/completions", body), 4, 2, root)
        asyncio.run(router.prefill_step(body))
        assert sent[-1] == router.policy.candidates(key)[0].url, text
    assert len(set(sent)) > 1  # the owners differ, so a wrong key shows


HELP = {
    "pd_handoffs": "Requests prefilled on one worker, decoded on another.",
    "pd_plain": "Requests served whole by one decode worker.",
    "pd_prefill_retries": "Prefill attempts that failed.",
    "pd_resumed": "Decodes resumed on another worker.",
}


def test_metrics_text_names_and_explains_every_counter() -> None:
    app, router, _ = pd_app({P1: answer(200, PREFILLED), D1: WHOLE})
    asyncio.run(post(app, BODY | {"stream": False}))
    reply = asyncio.run(get(app, "/metrics"))
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    lines = reply.text.splitlines()
    for name, doc in HELP.items():
        assert f"# HELP deepinfer_router:{name}_total {doc}" in lines, name
    assert "deepinfer_router:pd_handoffs_total 1.0" in lines
    assert "deepinfer_router:pd_plain_total 0.0" in lines


@pytest.mark.parametrize("field", PLAIN_FIELDS)
def test_each_field_a_handoff_cannot_carry_is_served_whole(field: str) -> None:
    assert handoff_able({"prompt": "x", field: None}) and handoff_able(
        {"prompt": "x", field: False}
    )
    assert not handoff_able({"prompt": "x", field: 1})


def test_what_a_handoff_carries() -> None:
    assert PLAIN_FIELDS == (
        "logprobs",
        "echo",
        "prompt_logprobs",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    )
    assert handoff_able({"prompt": "x", "n": 1}) and not handoff_able({"prompt": "x", "n": 2})
    assert not handoff_able({"prompt": 5}) and not handoff_able({})
    assert not handoff_able({"prompt": ["a"]}) and handoff_able({"prompt": [3]})


def test_parse_event() -> None:
    assert parse_event(b'data: {"a": 1}') == {"a": 1}
    assert parse_event(b'  data: {"a": 1}\n') == {"a": 1}
    assert parse_event(b"data: [DONE]") is None and parse_event(b" data: [DONE] ") is None
    assert parse_event(b"data: nonsense") is None and parse_event(b": keep-alive") is None


def test_a_handoff_sends_the_seed_and_chain_and_the_prefill_worker_no_stream() -> None:
    app, router, sent = pd_app({P1: answer(200, PREFILLED), D1: WHOLE})
    body = {"model": "m", "prompt": "Hello", "stream": False, "stream_options": {"a": 1}}
    reply = asyncio.run(post(app, body))  # max_tokens defaults to 16: handed on
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "BCD"
    (p, ask), (d, decode) = sent
    assert (p, d) == (P1, D1)
    assert ask == {
        "model": "m",
        "prompt": "Hello",
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert decode == body | {
        "seed": 42,
        "kv_transfer_params": {"output_token_ids": [5], "block_hashes": ["h0"]},
    }
    assert counts(router) == {
        "pd_handoffs": 1, "pd_plain": 0, "pd_prefill_retries": 0, "pd_resumed": 0
    }  # fmt: skip


def test_a_one_token_request_is_served_whole_after_its_prefill() -> None:
    app, router, sent = pd_app({P1: answer(200, PREFILLED), D1: WHOLE})
    asyncio.run(post(app, BODY | {"stream": False, "max_tokens": 1}))
    assert [url for url, _ in sent] == [P1, D1] and "kv_transfer_params" not in sent[1][1]
    assert counts(router)["pd_plain"] == 1 and counts(router)["pd_handoffs"] == 0
    app, router, sent = pd_app({P1: answer(200, PREFILLED), D1: WHOLE})
    asyncio.run(post(app, BODY | {"stream": False, "max_tokens": 2}))
    assert counts(router)["pd_handoffs"] == 1


def test_an_unreachable_prefill_worker_is_logged_and_left(caplog) -> None:
    app, router, sent = pd_app({P1: unreachable, P2: answer(200, PREFILLED), D1: WHOLE})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        asyncio.run(post(app, BODY | {"stream": False}))
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        f"prefill worker {P1} unreachable (refused)"
    ]
    assert [w.healthy for w in router.prefill] == [False, True]
    assert counts(router)["pd_prefill_retries"] == 1


def test_a_refusal_keeps_its_status_body_and_type() -> None:
    refusal = {"error": {"message": "no", "code": 422}}
    app, router, sent = pd_app({P1: answer(422, refusal), P2: answer(200, PREFILLED), D1: WHOLE})
    reply = asyncio.run(post(app, BODY))
    assert (reply.status_code, reply.json()) == (422, refusal)
    assert reply.headers["content-type"] == "application/json" and len(sent) == 1
    assert counts(router)["pd_prefill_retries"] == 0


def test_no_prefill_worker_is_a_503_that_says_so() -> None:
    app, router, _ = pd_app({P1: answer(503, {}), D1: WHOLE})
    reply = asyncio.run(post(app, BODY))
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["message"] == "no prefill worker is available"
    assert [w.healthy for w in router.prefill] == [True]  # it answered: only a 5xx


def test_decode_workers_are_taken_least_loaded_first_and_tried_once() -> None:
    _, router, _ = pd_app({P1: WHOLE, D1: WHOLE, D2: WHOLE, "http://d3.test": WHOLE})
    d1, d2, d3 = router.decode
    d1.in_flight, d2.in_flight, d3.in_flight = 2, 0, 1
    assert router.decoders(set()) == [d2, d3, d1]
    assert router.decoders({D2}) == [d3, d1]
    d3.healthy = False
    assert router.decoders(set()) == [d2, d1]


def test_a_whole_reply_skips_failing_decode_workers_and_keeps_its_status() -> None:
    app, router, sent = pd_app({P1: WHOLE, D1: answer(500, {}), D2: answer(404, {"e": 1})})
    reply = asyncio.run(post(app, {"prompt": "x", "n": 2}))
    assert (reply.status_code, reply.json()) == (404, {"e": 1})
    assert reply.headers["content-type"] == "application/json"
    assert [url for url, _ in sent] == [D1, D2]
    assert [w.healthy for w in router.decode] == [True, True]  # a 5xx is not a death
    app, router, sent = pd_app({P1: WHOLE, D1: unreachable, D2: unreachable})
    reply = asyncio.run(post(app, {"prompt": "x", "n": 2}))
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["message"] == "no decode worker is available"
    assert [w.healthy for w in router.decode] == [False, False]


def test_a_plain_stream_is_passed_on_and_counted_in_flight(caplog) -> None:
    during: list[int] = []

    async def body():
        yield event([6], "B")
        during.append(router.decode[0].in_flight)
        raise httpx.ReadError("reset")

    async def cut(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    app, router, sent = pd_app({P1: WHOLE, D1: cut})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        reply = asyncio.run(post(app, BODY | {"n": 2}))
    assert reply.status_code == 200 and reply.headers["content-type"].startswith(
        "text/event-stream"
    )
    assert reply.content == event([6], "B") and sent[0][1]["stream"] is True
    assert during == [1] and router.decode[0].in_flight == 0
    [message] = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert message.startswith(f"decode worker {D1}: the worker's reply broke off")


def test_a_stream_is_cut_into_events_across_pieces_under_the_prefill_id() -> None:
    first = event([6], "B")
    parts = [first[:9], first[9:] + b"data: not json\n\n: ping\n\n" + event([], "")[:5]]
    parts += [event([], "")[5:], event([7, 8], "CD"), b"data: [DONE]\n\n", event([9], "never")]
    app, router, sent = pd_app({P1: answer(200, PREFILLED), D1: streaming(parts)})
    lines = data_lines(asyncio.run(post(app, BODY)))
    assert [x["choices"][0]["text"] for x in lines[:-1]] == ["B", "", "CD"]
    assert {x["id"] for x in lines[:-1]} == {"cmpl-prefill"} and lines[-1] == "[DONE]"
    assert counts(router)["pd_resumed"] == 0 and router.decode[0].in_flight == 0


def test_a_decode_worker_that_refuses_is_left_alive_and_the_stream_resumed(caplog) -> None:
    rest = streaming([event([8], "D"), b"data: [DONE]\n\n"])
    app, router, sent = pd_app({P1: answer(200, PREFILLED), D1: answer(500, {}), D2: rest})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        lines = data_lines(asyncio.run(post(app, BODY)))
    assert lines[0]["choices"][0]["text"] == "D" and lines[-1] == "[DONE]"
    assert [w.healthy for w in router.decode] == [True, True]
    assert sent[2][1]["kv_transfer_params"] == {"output_token_ids": [5], "block_hashes": ["h0"]}
    assert counts(router)["pd_resumed"] == 0  # nothing was shown: a fresh start, not a resume
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        f"decode worker {D1} failed (status 500); resuming"
    ]


def test_a_decode_stream_that_ends_without_done_is_a_death(caplog) -> None:
    cut = streaming([event([6], "B")])
    app, router, sent = pd_app({P1: answer(200, PREFILLED), D1: cut, D2: unreachable})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        lines = data_lines(asyncio.run(post(app, BODY)))
    assert lines[0]["choices"][0]["text"] == "B" and lines[1]["error"]["code"] == "worker_failed"
    assert lines[-1] == "[DONE]" and len(lines) == 3
    assert [w.healthy for w in router.decode] == [False, False]
    assert [w.in_flight for w in router.decode] == [0, 0]
    assert counts(router)["pd_resumed"] == 1
    assert sent[2][1]["kv_transfer_params"]["num_sent_tokens"] == 1
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert messages[0] == f"decode worker {D1} failed (the stream ended before [DONE]); resuming"
    assert messages[1].startswith(f"decode worker {D2} failed (unreachable (ConnectError(")


def test_chat_responses_and_tokenizer_routes_go_whole_to_a_decode_worker() -> None:
    app, router, sent = pd_app({P1: WHOLE, D1: WHOLE})
    for path in ("/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"):
        reply = asyncio.run(post(app, {"x": 1}, path))
        assert reply.status_code == 200 and reply.json()["id"] == "d", path
    assert [url for url, _ in sent] == [D1] * 4 and all(b == {"x": 1} for _, b in sent)
    assert counts(router)["pd_plain"] == 2  # a chat and a response; tokenizing is not a request


def test_get_routes_ask_the_first_decode_worker_that_answers() -> None:
    asked: list[tuple[str, str, dict]] = []

    async def transport(request: httpx.Request) -> httpx.Response:
        asked.append((request.url.host, request.url.path, request.extensions["timeout"]))
        if request.url.host == "d1.test":
            raise httpx.ConnectError("refused", request=request)
        status = 404 if request.url.path.endswith("/missing") else 200
        return httpx.Response(status, json={"path": request.url.path})

    app, router, _ = pd_app({P1: WHOLE, D1: WHOLE, D2: WHOLE})
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(transport))
    for path in ("/v1/models", "/v1/models/org/m", "/tokenizer_info"):
        reply = asyncio.run(get(app, path))
        assert (reply.status_code, reply.json()) == (200, {"path": path})
        assert reply.headers["content-type"] == "application/json"
    assert [(h, p) for h, p, _ in asked] == [
        ("d1.test", "/v1/models"),
        ("d2.test", "/v1/models"),
        ("d1.test", "/v1/models/org/m"),
        ("d2.test", "/v1/models/org/m"),
        ("d1.test", "/tokenizer_info"),
        ("d2.test", "/tokenizer_info"),
    ]
    assert asked[0][2] == {"connect": 10.0, "read": 10.0, "write": 10.0, "pool": 10.0}
    reply = asyncio.run(get(app, "/v1/models/missing"))  # the worker's status passed on
    assert (reply.status_code, reply.json()) == (404, {"path": "/v1/models/missing"})
    router.decode[1].healthy = False
    reply = asyncio.run(get(app, "/v1/models"))
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == "no decode worker is available"


def test_health_needs_a_prefill_and_a_decode_worker() -> None:
    app, router, _ = pd_app({P1: WHOLE, D1: WHOLE})
    reply = asyncio.run(get(app, "/health"))
    assert (reply.status_code, reply.json()) == (
        200,
        {"status": "ok", "workers": {P1: True, D1: True}},
    )
    assert asyncio.run(get(app, "/health", "HEAD")).content == b""
    for workers in (router.prefill, router.decode):
        workers[0].healthy = False
        reply = asyncio.run(get(app, "/health"))
        assert reply.status_code == 503
        assert reply.json()["error"]["message"] == "no prefill or no decode worker is healthy"
        workers[0].healthy = True


def test_start_up_checks_the_workers_then_probes_them_on_the_clock() -> None:
    probes: list[tuple[str, str, dict]] = []
    info = {"role": "both", "namespace": "ns", "block_size": 16, "kv_store": "disk"}

    async def transport(request: httpx.Request) -> httpx.Response:
        probes.append((request.url.host, request.url.path, request.extensions["timeout"]))
        if request.url.path == "/kv/info":
            return httpx.Response(200, json=info)
        if request.url.host == "d2.test":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200 if request.url.host == "p1.test" else 503)

    async def run() -> tuple:
        app, router, _ = pd_app({P1: WHOLE, D1: WHOLE, D2: WHOLE})
        router.config.health_interval = 0.05
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(transport))
        rounds = lambda: sum(p == "/health" for _, p, _ in probes) >= 6  # noqa: E731  (two rounds)
        return router, *await lifespan_until(app, router, probes, rounds)

    router, during, after, closed = asyncio.run(asyncio.wait_for(run(), 30))
    assert after == during and closed
    assert [(h, p) for h, p, _ in probes[:3]] == [
        ("p1.test", "/kv/info"),
        ("d1.test", "/kv/info"),
        ("d2.test", "/kv/info"),
    ]
    assert probes[0][2] == {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 5.0}
    assert probes[3][1:] == ("/health", {"connect": 2.0, "read": 2.0, "write": 2.0, "pool": 2.0})
    assert [w.healthy for w in router.prefill + router.decode] == [True, False, False]


def test_a_worker_with_no_namespace_or_an_answer_not_json_at_start() -> None:
    def info(namespace: str | None) -> object:
        kv = {"role": "both", "namespace": namespace, "block_size": 16, "kv_store": "disk"}
        return answer(200, kv)

    async def not_json(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"<html>")

    _, router, _ = pd_app({P1: info("ns"), D1: info(None)})
    with pytest.raises(ValueError, match=f"{D1} cannot be a decode worker: it serves"):
        asyncio.run(router.check_workers())
    _, router, _ = pd_app({P1: info("ns"), D1: not_json})
    asyncio.run(router.check_workers())  # a worker that is not up yet joins later
    _, router, _ = pd_app({P1: info("ns"), D1: info("other")})
    with pytest.raises(ValueError, match="do not share one KV store key space"):
        asyncio.run(router.check_workers())


def test_run_pd_router_serves_the_app(monkeypatch) -> None:
    got, configured = served(monkeypatch, pd_module)
    run_pd_router(PDRouterConfig([P1], [D1], block_size=8), "127.0.0.9", 8124, "debug")
    assert configured == ["debug"]
    assert (got["host"], got["port"], got["log_level"]) == ("127.0.0.9", 8124, "debug")
    assert got["app"].state.router.config.block_size == 8


def test_run_pd_router_logs_at_info_by_default(monkeypatch) -> None:
    got, configured = served(monkeypatch, pd_module)
    run_pd_router(PDRouterConfig([P1], [D1]), "127.0.0.9", 8124)
    assert configured == ["info"] and got["log_level"] == "info"  # uvicorn's spelling


@pytest.mark.parametrize(
    "prefill, body, chunk",
    [
        (WHOLE, BODY | {"n": 2}, event([6], "B")),  # a plain stream from decode
        (answer(200, PREFILLED), BODY, event([6], "B") + b"data: [DONE]\n\n"),  # a handoff
    ],
    ids=["plain", "handoff"],
)
def test_two_streams_on_one_decode_worker_are_both_in_flight(prefill, body, chunk) -> None:
    worker = TwoAtOnce(lambda: router.decode[0].in_flight, chunk, SSE)
    app, router, _ = pd_app({P1: prefill, D1: worker})

    async def run() -> None:
        await asyncio.wait_for(asyncio.gather(post(app, body), post(app, body)), 30)

    asyncio.run(run())
    assert worker.during == [2, 2] and router.decode[0].in_flight == 0


def test_a_plain_stream_gone_quiet_is_cut_after_the_idle_timeout(caplog) -> None:
    async def body():
        yield event([6], "B")
        await asyncio.sleep(30)
        yield event([7], "C")

    async def quiet(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    app, router, _ = pd_app({P1: WHOLE, D1: quiet})
    router.config.idle_timeout = 0.05
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        reply = asyncio.run(asyncio.wait_for(post(app, BODY | {"n": 2}), 20))
    assert reply.content == event([6], "B") and router.decode[0].in_flight == 0
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        f"decode worker {D1}: the worker sent nothing for 0.05 s"
    ]


def test_a_handoff_stream_passes_events_without_choices_or_token_ids_and_blank_ones() -> None:
    asked: list[tuple[str, str]] = []
    usage = b'data: {"id": "w", "usage": {"completion_tokens": 2}}\n\n'
    plain = b'data: {"id": "w", "choices": [{"index": 0, "text": "E"}]}\n\n'
    parts = [event([6], "B") + b"\n\n", plain, usage + b"data: [DONE]\n\n"]
    stream = streaming(parts)

    async def decode(request: httpx.Request) -> httpx.Response:
        asked.append((request.method, request.url.path))
        return await stream(request)

    app, router, _ = pd_app({P1: answer(200, PREFILLED), D1: decode})
    lines = data_lines(asyncio.run(post(app, BODY)))
    assert asked == [("POST", "/v1/completions")]
    assert [x["id"] for x in lines[:-1]] == ["cmpl-prefill"] * 3 and lines[-1] == "[DONE]"
    assert lines[1]["choices"] == [{"index": 0, "text": "E"}]
    assert lines[2]["usage"] == {"completion_tokens": 2} and "choices" not in lines[2]


def test_the_stream_that_no_worker_can_finish_is_a_503_event() -> None:
    app, router, _ = pd_app({P1: answer(200, PREFILLED), D1: unreachable})
    error = data_lines(asyncio.run(post(app, BODY)))[0]["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "worker_failed"


def test_a_handoff_stream_gone_quiet_resumes_on_another_worker(caplog) -> None:
    async def body():
        yield event([6], "B")
        await asyncio.sleep(30)

    async def quiet(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    rest = streaming([event([7], "C"), b"data: [DONE]\n\n"])
    app, router, sent = pd_app({P1: answer(200, PREFILLED), D1: quiet, D2: rest})
    router.config.idle_timeout = 0.05
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        lines = data_lines(asyncio.run(asyncio.wait_for(post(app, BODY), 20)))
    assert [x["choices"][0]["text"] for x in lines[:-1]] == ["B", "C"]
    assert [w.healthy for w in router.decode] == [True, True]  # quiet is not dead
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        f"decode worker {D1} failed (the worker sent nothing for 0.05 s); resuming"
    ]


def test_a_request_served_whole_goes_to_the_completions_path() -> None:
    paths: list[str] = []

    async def decode(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return await WHOLE(request)

    app, router, _ = pd_app({P1: WHOLE, D1: decode})
    asyncio.run(post(app, {"prompt": "x", "n": 2}))
    assert paths == ["/v1/completions"]


def test_start_up_asks_each_worker_with_its_own_timeout_and_checks_every_one() -> None:
    asked: list[dict] = []
    info = {"role": "prefill", "namespace": "ns", "block_size": 16, "kv_store": "disk"}

    async def transport(request: httpx.Request) -> httpx.Response:
        asked.append(request.extensions["timeout"])
        if request.url.host == "p1.test":
            raise httpx.ConnectError("refused", request=request)
        role = "decode" if request.url.host == "p2.test" else "prefill"
        return httpx.Response(200, json=info | {"role": role})

    _, router, _ = pd_app({P1: WHOLE, P2: WHOLE, D1: WHOLE})
    client = httpx.AsyncClient(transport=httpx.MockTransport(transport), timeout=None)
    router.client = client
    with pytest.raises(ValueError) as err:  # P1 is down; P2, after it, is still checked
        asyncio.run(router.check_workers())
    assert str(err.value).startswith(f"{P2} cannot be a prefill worker: it serves {{'role'")
    assert asked[0] == {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 5.0}
    _, router, _ = pd_app({P1: WHOLE, D1: WHOLE})
    router.client = httpx.AsyncClient(
        transport=httpx.MockTransport(
            lambda r: httpx.Response(
                200, json=info | {"role": "both", "block_size": r.url.port or 16}
            )
        )
    )
    router.decode[0].url = "http://d1.test:32"
    with pytest.raises(ValueError) as err:
        asyncio.run(router.check_workers())
    assert str(err.value).startswith(
        "the workers do not share one KV store key space (another model, KV format, block size "
        "or store): {"
    )


def test_each_worker_is_asked_by_method_and_path() -> None:
    asked: list[tuple[str, str, str]] = []

    def recorded(handler: Handler) -> Handler:
        async def answer(request: httpx.Request) -> httpx.Response:
            asked.append((request.url.host, request.method, request.url.path))
            return await handler(request)

        return answer

    stream = streaming([event([6], "B"), b"data: [DONE]\n\n"])
    app, router, _ = pd_app({P1: recorded(answer(200, PREFILLED)), D1: recorded(stream)})
    asyncio.run(post(app, BODY))
    asyncio.run(post(app, BODY | {"n": 2}))  # served whole, streamed
    assert asked == [
        ("p1.test", "POST", "/v1/completions"),
        ("d1.test", "POST", "/v1/completions"),
        ("d1.test", "POST", "/v1/completions"),
    ]


def test_a_streamed_request_refused_by_its_decode_worker_keeps_the_status() -> None:
    refusal = {"error": {"message": "bad", "code": 400}}
    app, router, _ = pd_app({P1: WHOLE, D1: answer(400, refusal)})
    reply = asyncio.run(post(app, BODY | {"n": 2}))
    assert (reply.status_code, reply.json()) == (400, refusal)
    assert reply.headers["content-type"] == "application/json"


def test_a_handed_on_stream_is_an_event_stream_of_a_titled_app() -> None:
    stream = streaming([event([6], "B"), b"data: [DONE]\n\n"])
    app, router, _ = pd_app({P1: answer(200, PREFILLED), D1: stream})
    reply = asyncio.run(post(app, BODY))
    assert reply.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert app.title == "DeepInfer PD router"


def test_only_a_trailing_slash_is_cut_from_a_workers_url() -> None:
    router = PDRouter(PDRouterConfig(["http://pX/"], ["http://dX/"]))
    assert [w.url for w in router.prefill + router.decode] == ["http://pX", "http://dX"]
