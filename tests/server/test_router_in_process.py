"""The router's forwarding, failover and counters, in process: the router's app
driven through httpx's ASGI transport, and its workers played by a mock
transport, so that each case is exact and fast and mutation testing sees the
code. test_router.py and test_router_faults.py run the same paths through live
worker processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from engine.entrypoints.router import Router, RouterConfig, build_router

A, B = "http://a.test", "http://b.test"
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def router_app(workers: dict[str, Handler], **options) -> tuple:
    """The router's app in front of ``workers`` (URL -> what it answers), round-robin
    from the first, and a list of the requests each worker was sent."""
    seen: list[tuple[str, httpx.Request]] = []

    async def transport(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        seen.append((url, request))
        return await workers[url](request)

    config = RouterConfig(list(workers), policy="round-robin", **options)
    app = build_router(config)
    router: Router = app.state.router
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(transport))
    return app, router, seen


async def pieces(parts: list[bytes]):
    for part in parts:  # a body that arrives as it would off a socket, unread
        yield part


async def ok(request: httpx.Request) -> httpx.Response:
    body = json.dumps({"worker": str(request.url)}).encode()
    return httpx.Response(200, headers={"content-type": "application/json"}, content=pieces([body]))


async def unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("refused", request=request)


async def silent(request: httpx.Request) -> httpx.Response:
    await asyncio.Event().wait()  # never answers
    raise AssertionError


def stream_of(events: list[bytes]) -> Handler:
    async def answer(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, content=pieces(events))

    return answer


def metric(router: Router, name: str, **labels: str) -> float | None:
    return router.metrics.registry.get_sample_value(f"deepinfer_router:{name}", labels)


async def post(app, path: str = "/v1/completions", **kw) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router.test") as client:
        return await client.post(path, json={"model": "m", "prompt": "hi"}, **kw)


def test_an_unreachable_worker_is_marked_down_and_the_next_one_answers() -> None:
    app, router, seen = router_app({A: unreachable, B: ok})
    reply = asyncio.run(post(app, headers={"x-trace": "7", "keep-alive": "timeout=5"}))
    assert reply.status_code == 200 and reply.json() == {"worker": f"{B}/v1/completions"}
    assert reply.headers["x-deepinfer-worker"] == B
    assert [url for url, _ in seen] == [A, B]
    sent = seen[-1][1]
    assert sent.headers["x-trace"] == "7" and "keep-alive" not in sent.headers  # a hop's
    assert sent.headers["host"] == "b.test"  # the client's was the router's
    assert sent.content == b'{"model":"m","prompt":"hi"}'
    assert (metric(router, "retries_total"), metric(router, "unroutable_total")) == (1, 0)
    assert metric(router, "requests_total", worker=B) == 1
    assert metric(router, "requests_total", worker=A) is None
    assert (metric(router, "worker_up", worker=A), metric(router, "worker_up", worker=B)) == (0, 1)
    assert metric(router, "in_flight", worker=B) == 0  # the reply was read whole
    assert router.down[A].is_set() and not router.down[B].is_set()


def test_no_worker_reachable_is_a_503_to_retry() -> None:
    app, router, _ = router_app({A: unreachable, B: unreachable})
    reply = asyncio.run(post(app))
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["message"] == "no worker is available"
    assert (metric(router, "retries_total"), metric(router, "unroutable_total")) == (2, 1)
    assert metric(router, "stalls_total") == 0


def test_a_worker_silent_past_the_first_byte_timeout_is_left_for_the_next() -> None:
    app, router, _ = router_app({A: silent, B: ok}, first_byte_timeout=0.05)
    reply = asyncio.run(post(app))
    assert reply.status_code == 200 and reply.headers["x-deepinfer-worker"] == B
    assert (metric(router, "stalls_total"), metric(router, "retries_total")) == (1, 1)
    assert metric(router, "worker_up", worker=A) == 0


def test_every_worker_silent_is_a_504() -> None:
    app, router, _ = router_app({A: silent, B: silent}, first_byte_timeout=0.05)
    reply = asyncio.run(post(app))
    assert reply.status_code == 504 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["message"] == "no worker answered in time"
    assert (metric(router, "stalls_total"), metric(router, "unroutable_total")) == (2, 1)


def test_a_stream_is_passed_on_whole_events_at_a_time() -> None:
    events = [b"data: 1\n\nda", b"ta: 2\n\n", b"data: [DONE]\n\n"]
    app, router, _ = router_app({A: stream_of(events), B: ok})
    reply = asyncio.run(post(app))
    assert reply.status_code == 200 and reply.content == b"".join(events)
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert metric(router, "broken_replies_total") == 0
    assert metric(router, "in_flight", worker=A) == 0


def test_round_robin_takes_turns_and_health_brings_a_worker_back() -> None:
    app, router, seen = router_app({A: ok, B: ok})

    async def run() -> list[str]:
        firsts = []
        for _ in range(3):
            firsts.append((await post(app)).headers["x-deepinfer-worker"])
        router.mark(router.workers[0], healthy=False)
        firsts.append((await post(app)).headers["x-deepinfer-worker"])
        await router._probe(router.workers[0])  # /health answers 200: up again
        return firsts

    assert asyncio.run(run()) == [A, B, A, B]
    assert seen[-1][1].url.path == "/health"
    assert metric(router, "worker_up", worker=A) == 1 and not router.down[A].is_set()
    assert metric(router, "requests_total", worker=A) == 2


def test_prefix_routing_without_a_model_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefix-affinity routing needs --model"):
        Router(RouterConfig([A], policy="prefix"))
