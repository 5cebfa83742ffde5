"""The PD router in process: its app driven through httpx's ASGI transport, the
prefill and decode workers played by a mock transport. Each case pins what the
client hears and the router's counters: a handoff, a decode resumed on another
worker from the tokens already shown, the requests served whole, and prefill
retries. test_pd.py runs the same paths through live workers, which mutation
testing cannot see."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from engine.entrypoints.pd_router import PDRouter, PDRouterConfig, build_pd_router, handoff_able

P1, P2, D1, D2 = "http://p1.test", "http://p2.test", "http://d1.test", "http://d2.test"
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
PREFILLED = {
    "id": "cmpl-prefill",
    "choices": [{"index": 0, "text": "A", "finish_reason": "length"}],
    "kv_transfer_params": {"output_token_ids": [5], "block_hashes": ["h0"], "seed": 42},
}


async def pieces(parts: list[bytes]):
    for part in parts:  # as it would come off a socket, unread
        yield part


def answer(status: int, body: dict) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        data = json.dumps(body).encode()
        media = {"content-type": "application/json"}
        return httpx.Response(status, headers=media, content=pieces([data]))

    return handler


def event(tokens: list[int], text: str) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": tokens, "finish_reason": None}
    return b"data: " + json.dumps({"id": "worker-id", "choices": [choice]}).encode() + b"\n\n"


def streaming(events: list[bytes]) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        media = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=media, content=pieces(events))

    return handler


async def unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("refused", request=request)


def pd_app(workers: dict[str, Handler]) -> tuple:
    """The PD router in front of ``workers``; what each worker was sent."""
    sent: list[tuple[str, dict]] = []

    async def transport(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        sent.append((url, json.loads(request.content) if request.content else {}))
        return await workers[url](request)

    prefill = [u for u in workers if u.startswith("http://p")]
    decode = [u for u in workers if u.startswith("http://d")]
    app = build_pd_router(PDRouterConfig(prefill, decode))
    router: PDRouter = app.state.router
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(transport))
    return app, router, sent


async def post(app, body: dict, path: str = "/v1/completions") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router.test") as client:
        return await client.post(path, json=body)


def counts(router: PDRouter) -> dict[str, float]:
    names = ("pd_handoffs", "pd_plain", "pd_prefill_retries", "pd_resumed")
    get = router.metrics.registry.get_sample_value
    return {n: get(f"deepinfer_router:{n}_total") for n in names}


def data_lines(reply: httpx.Response) -> list[dict | str]:
    out = []
    for line in reply.text.split("\n\n"):
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


BODY = {"model": "m", "prompt": "Hello", "max_tokens": 8, "stream": True}


def test_a_stream_is_handed_on_and_resumed_from_the_tokens_shown() -> None:
    cut = streaming([event([6], "B"), event([7], "C")])  # dies before [DONE]
    rest = streaming([event([8], "D"), b"data: [DONE]\n\n"])
    app, router, sent = pd_app({P1: answer(200, PREFILLED), D1: cut, D2: rest})
    reply = asyncio.run(post(app, BODY))
    lines = data_lines(reply)
    assert [x["choices"][0]["text"] for x in lines[:-1]] == ["B", "C", "D"]
    assert all(x["id"] == "cmpl-prefill" and "token_ids" not in x["choices"][0] for x in lines[:-1])
    assert lines[-1] == "[DONE]"
    (p, ask), (d1, first), (d2, second) = sent
    assert (p, d1, d2) == (P1, D1, D2)
    assert ask["kv_transfer_params"] == {"do_remote_decode": True} and "stream" not in ask
    handed = {"output_token_ids": [5], "block_hashes": ["h0"]}
    assert first["kv_transfer_params"] == handed and first["seed"] == 42
    assert second["kv_transfer_params"] == handed | {
        "output_token_ids": [6, 7],
        "num_sent_tokens": 2,
    }
    assert counts(router) == {
        "pd_handoffs": 1, "pd_plain": 0, "pd_prefill_retries": 0, "pd_resumed": 1
    }  # fmt: skip
    assert [w.healthy for w in router.decode] == [False, True]  # died: left till its health check
    assert [w.in_flight for w in router.decode] == [0, 0]


def test_no_decode_worker_to_finish_ends_the_stream_with_an_error_event() -> None:
    app, router, _ = pd_app({P1: answer(200, PREFILLED), D1: unreachable})
    lines = data_lines(asyncio.run(post(app, BODY)))
    assert lines[-1] == "[DONE]" and lines[0]["error"]["code"] == "worker_failed"
    assert lines[0]["error"]["message"] == "no decode worker could finish the stream"


def test_a_failing_prefill_worker_is_retried_and_a_refusal_is_passed_on() -> None:
    whole = answer(200, {"id": "d", "choices": [{"text": "BCD"}]})
    app, router, sent = pd_app({P1: answer(500, {}), P2: answer(200, PREFILLED), D1: whole})
    reply = asyncio.run(post(app, BODY | {"stream": False}))
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "BCD"
    assert [url for url, _ in sent] == [P1, P2, D1]
    assert counts(router)["pd_prefill_retries"] == 1 and counts(router)["pd_handoffs"] == 1
    refusal = {"error": {"message": "prompt too long", "code": 400}}
    app, router, sent = pd_app({P1: answer(400, refusal), D1: whole})
    reply = asyncio.run(post(app, BODY))
    assert (reply.status_code, reply.json()) == (400, refusal) and len(sent) == 1


def test_no_prefill_worker_is_a_503() -> None:
    app, router, _ = pd_app({P1: unreachable, P2: answer(502, {}), D1: unreachable})
    reply = asyncio.run(post(app, BODY))
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert counts(router)["pd_prefill_retries"] == 2
    assert [w.healthy for w in router.prefill] == [False, True]  # only the unreachable one


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"n": 2}, "two choices"),
        ({"logprobs": 1}, "logprobs"),
        ({"prompt": ["a", "b"]}, "two prompts"),
    ],
)
def test_what_a_handoff_cannot_carry_is_served_whole(change: dict, why: str) -> None:
    whole = answer(200, {"id": "d", "choices": []})
    app, router, sent = pd_app({P1: answer(200, PREFILLED), D1: whole})
    reply = asyncio.run(post(app, BODY | {"stream": False} | change))
    assert reply.status_code == 200 and [url for url, _ in sent] == [D1], why
    assert counts(router)["pd_plain"] == 1 and counts(router)["pd_handoffs"] == 0


def test_a_prompt_that_ends_at_its_first_token_is_served_whole() -> None:
    stopped = PREFILLED | {"choices": [{"index": 0, "text": "A", "finish_reason": "stop"}]}
    whole = answer(200, {"id": "d", "choices": []})
    app, router, sent = pd_app({P1: answer(200, stopped), D1: whole})
    asyncio.run(post(app, BODY | {"stream": False}))
    assert [url for url, _ in sent] == [P1, D1] and "kv_transfer_params" not in sent[1][1]
    assert counts(router)["pd_plain"] == 1


def test_handoff_able() -> None:
    assert handoff_able({"prompt": "x"}) and handoff_able({"prompt": [1, 2]})
    assert not handoff_able({"prompt": [[1], [2]]}) and not handoff_able({"prompt": []})
    assert not handoff_able({"prompt": "x", "echo": True})
    assert handoff_able({"prompt": "x", "echo": False, "logprobs": None})
    assert not handoff_able({"prompt": "x", "guided_regex": "a+"})


def test_workers_of_another_role_or_key_space_are_refused_at_start() -> None:
    def info(role: str, namespace: str = "ns", block_size: int = 16) -> Handler:
        kv = {"role": role, "namespace": namespace, "block_size": block_size, "kv_store": "disk"}
        return answer(200, kv)

    _, router, _ = pd_app({P1: info("decode"), D1: info("decode")})
    with pytest.raises(ValueError, match="cannot be a prefill worker"):
        asyncio.run(router.check_workers())
    _, router, _ = pd_app({P1: info("both"), D1: info("decode", block_size=32)})
    with pytest.raises(ValueError, match="do not share one KV store key space"):
        asyncio.run(router.check_workers())
    _, router, _ = pd_app({P1: info("prefill"), D1: unreachable})
    asyncio.run(router.check_workers())  # a worker down now joins later
