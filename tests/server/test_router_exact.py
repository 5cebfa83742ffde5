"""The router's settings, counters, logs and prefix key, pinned to exact values
(issue 49), in process as test_router_in_process.py drives it: the /metrics text
a scraper reads, the warnings an operator reads, the prompt's tokens as the
worker will count them, the health check's clock and the start and stop of the
app's lifespan."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from engine.entrypoints import router as router_module
from engine.entrypoints.chat_template import load_chat_template
from engine.entrypoints.prompt_tokens import bytes_per_token
from engine.entrypoints.router import (
    FORWARDED,
    HOP_HEADERS,
    Router,
    RouterConfig,
    Tokens,
    build_router,
    run_router,
)
from engine.entrypoints.routing import PrefixAffinity, RoundRobin, prefix_key
from engine.kv.hashing import chain_root
from tests.server.conftest import TINY
from tests.server.test_router_in_process import (
    A,
    B,
    metric,
    ok,
    pieces,
    post,
    router_app,
    silent,
    unreachable,
)

LOGGER = "deepinfer.router"


def test_the_defaults_and_what_the_router_builds_from_them() -> None:
    config = RouterConfig([A + "/", B])
    assert (config.model, config.policy, config.block_size, config.prefix_blocks) == (
        None,
        "prefix",
        16,
        4,
    )
    assert (config.load_factor, config.health_interval, config.max_body_bytes) == (
        1.25,
        2.0,
        4 * 1024 * 1024,
    )
    assert (config.connect_timeout, config.first_byte_timeout, config.idle_timeout) == (
        2.0,
        600.0,
        120.0,
    )
    assert (config.head_timeout, config.body_timeout) == (60.0, 60.0)
    router = Router(RouterConfig([A + "/", B], policy="round-robin", block_size=8))
    assert [w.url for w in router.workers] == [A, B]
    assert isinstance(router.policy, RoundRobin) and router.policy.workers is router.workers
    assert router.tokens.tokenizer is None and router.tokens.max_chars is None
    assert router.root == chain_root("router", "", 8)
    assert router.client.timeout == httpx.Timeout(None, connect=2.0)
    assert set(router.down) == {A, B} and not any(e.is_set() for e in router.down.values())
    for url in (A, B):
        assert (
            metric(router, "worker_up", worker=url),
            metric(router, "in_flight", worker=url),
        ) == (
            1,
            0,
        )
    assert {
        "host",
        "content-length",
        "connection",
        "transfer-encoding",
        "keep-alive",
    } == HOP_HEADERS


def test_prefix_routing_builds_its_ring_and_tokenizer_from_the_model() -> None:
    router = Router(RouterConfig([A, B], model=str(TINY), load_factor=1.5, prefix_blocks=2))
    assert isinstance(router.policy, PrefixAffinity) and router.policy.load_factor == 1.5
    assert router.policy.workers is router.workers
    assert router.tokens.template is not None
    assert router.tokens.max_chars == (2 * 16 + 1) * bytes_per_token(router.tokens.tokenizer)


HELP = {
    "requests": "Requests sent, by worker.",
    "retries": "Attempts whose worker could not be reached; the request went on to the next.",
    "unroutable": "Requests no worker could take.",
    "stalls": "Attempts left before their first byte: the worker went down or took too long.",
    "broken_replies": (
        "Replies that broke off after their first byte; a stream ends with an error event."
    ),
    "worker_up": "1 if the worker is healthy.",
    "in_flight": "Requests in flight, by worker.",
}


def test_metrics_text_names_and_explains_every_counter() -> None:
    app, router, _ = router_app({A: unreachable, B: ok})

    async def run() -> httpx.Response:
        await post(app)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r.test") as client:
            return await client.get("/metrics")

    reply = asyncio.run(run())
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    lines = reply.text.splitlines()
    for name, doc in HELP.items():
        counted = "" if name in ("worker_up", "in_flight") else "_total"  # the gauges
        assert f"# HELP deepinfer_router:{name}{counted} {doc}" in lines, name
    assert f'deepinfer_router:requests_total{{worker="{B}"}} 1.0' in lines
    assert "deepinfer_router:retries_total 1.0" in lines
    assert f'deepinfer_router:worker_up{{worker="{A}"}} 0.0' in lines
    assert f'deepinfer_router:in_flight{{worker="{B}"}} 0.0' in lines


def test_an_unreachable_worker_and_its_recovery_are_logged(caplog) -> None:
    app, router, _ = router_app({A: unreachable, B: ok})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        asyncio.run(post(app))
        router.mark(router.workers[0], healthy=False)  # already down: no second line
        router.mark(router.workers[0], healthy=True)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert lines == [
        ("WARNING", f"worker {A} unreachable (refused); trying another"),
        ("INFO", f"worker {A} is down"),
        ("INFO", f"worker {A} is up"),
    ]
    assert metric(router, "worker_up", worker=A) == 1


def test_a_stalled_worker_is_logged(caplog) -> None:
    app, router, _ = router_app({A: silent, B: ok}, first_byte_timeout=0.05)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        asyncio.run(post(app))
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == [f"worker {A} sent nothing in time; trying another"]


def test_a_worker_marked_down_while_awaited_is_left_at_once() -> None:
    """The first-byte timeout is ten minutes; the health check's mark ends the wait."""
    app, router, seen = router_app({A: silent, B: ok})

    async def run() -> httpx.Response:
        async def mark_down() -> None:
            await asyncio.sleep(0.05)
            router.mark(router.workers[0], healthy=False)

        marker = asyncio.ensure_future(mark_down())
        reply = await asyncio.wait_for(post(app), 30)
        await marker
        return reply

    reply = asyncio.run(run())
    assert reply.headers["x-deepinfer-worker"] == B
    assert (metric(router, "stalls_total"), metric(router, "retries_total")) == (1, 1)
    assert [url for url, _ in seen] == [A, B]


def broken_stream(then: Exception | None) -> object:
    async def body():
        yield b"data: 1\n\n"
        yield b"data: 2"  # half an event, never sent
        if then is None:
            await asyncio.sleep(30)  # goes quiet
        raise then

    async def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return answer


@pytest.mark.parametrize("died", [True, False])
def test_a_stream_that_breaks_off_is_counted_and_logged(died: bool, caplog) -> None:
    cause = httpx.ReadError("reset") if died else None
    app, router, _ = router_app({A: broken_stream(cause), B: ok}, idle_timeout=0.05)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        reply = asyncio.run(post(app))
    events = reply.text.split("\n\n")
    assert events[0] == "data: 1" and events[-2] == "data: [DONE]" and "data: 2" not in events
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "worker_failed" and error["message"].startswith("the stream was cut")
    assert metric(router, "broken_replies_total") == 1
    assert metric(router, "worker_up", worker=A) == (0 if died else 1)
    assert router.workers[0].healthy is not died
    assert metric(router, "in_flight", worker=A) == 0 and router.workers[0].in_flight == 0
    why = "the worker's reply broke off" if died else "the worker sent nothing for 0.05 s"
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert messages[0].startswith(f"worker {A}: {why}"), messages


def test_a_reply_in_flight_is_counted_until_read() -> None:
    during: list[float | None] = []

    async def body():
        yield b"data: 1\n\n"
        during.append(metric(router, "in_flight", worker=A))  # the first event is on its way
        yield b"data: [DONE]\n\n"

    async def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    app, router, _ = router_app({A: answer})
    asyncio.run(post(app))
    assert during == [1] and metric(router, "in_flight", worker=A) == 0


def test_a_reply_keeps_its_headers_but_not_a_hops() -> None:
    async def answer(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "application/json", "x-worker-says": "hi", "keep-alive": "t=5"}
        return httpx.Response(201, headers=headers, content=pieces([b"{}"]))

    app, router, seen = router_app({A: answer})
    reply = asyncio.run(post(app))
    assert reply.status_code == 201 and reply.headers["x-worker-says"] == "hi"
    assert "keep-alive" not in reply.headers


@pytest.mark.parametrize(("method", "path"), FORWARDED)
def test_every_forwarded_route_reaches_a_worker_as_sent(method: str, path: str) -> None:
    app, router, seen = router_app({A: ok})
    url = path.replace("{model_id:path}", "org/m")

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r.test") as client:
            content = b'{"x":1}' if method == "POST" else None
            return await client.request(method, url, content=content)

    assert asyncio.run(run()).status_code == 200
    [(worker, sent)] = seen
    assert (worker, sent.method, sent.url.path) == (A, method, url)


def test_health_says_which_workers_are_up() -> None:
    app, router, _ = router_app({A: ok, B: ok})

    async def get(path: str, method: str = "GET") -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r.test") as client:
            return await client.request(method, path)

    router.mark(router.workers[1], healthy=False)
    reply = asyncio.run(get("/health"))
    assert (reply.status_code, reply.json()) == (
        200,
        {"status": "ok", "workers": {A: True, B: False}},
    )
    head = asyncio.run(get("/health", "HEAD"))
    assert head.status_code == 200 and head.content == b""
    router.mark(router.workers[0], healthy=False)
    reply = asyncio.run(get("/health"))
    assert reply.status_code == 503 and reply.json()["error"]["message"] == "no worker is healthy"


def test_a_body_over_the_limit_is_refused_before_any_worker_sees_it() -> None:
    app, router, seen = router_app({A: ok}, max_body_bytes=20)
    reply = asyncio.run(post(app))  # 27 bytes
    assert reply.status_code == 413 and seen == []
    app, router, seen = router_app({A: ok}, max_body_bytes=27)
    assert asyncio.run(post(app)).status_code == 200


def test_a_router_failure_is_a_500_that_names_it_and_is_logged(caplog) -> None:
    async def broken(request: httpx.Request) -> httpx.Response:
        raise KeyError("bug")

    app, router, _ = router_app({A: broken})

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://r.test") as client:
            return await client.post("/v1/completions", json={"prompt": "hi"})

    with caplog.at_level(logging.ERROR, logger=LOGGER):
        reply = asyncio.run(run())
    assert reply.status_code == 500
    assert reply.json()["error"]["message"] == "the router failed: KeyError"
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "POST /v1/completions failed"
    ]


async def lifespan_until(app, router, probes: list, enough: Callable[[], bool]) -> tuple:
    """Run the app's lifespan until ``enough()``: the probes made by its end, the
    probes 0.1 s later, and whether the router's client was closed with it."""
    async with app.router.lifespan_context(app):
        while not enough():
            await asyncio.sleep(0.01)
        during = len(probes)
    closed = router.client.is_closed
    await asyncio.sleep(0.1)
    return during, len(probes), closed


def test_the_health_check_probes_every_worker_on_its_clock_and_stops_with_the_app() -> None:
    probes: list[tuple[str, dict]] = []

    async def health(status: int):
        async def answer(request: httpx.Request) -> httpx.Response:
            probes.append((request.url.host, request.extensions["timeout"]))
            return httpx.Response(status)

        return answer

    async def run() -> tuple:
        app, router, _ = router_app(
            {A: await health(503), B: await health(200)}, health_interval=0.05
        )
        # two rounds: the check goes on after its interval
        return router, *await lifespan_until(app, router, probes, lambda: len(probes) >= 4)

    router, during, after, closed = asyncio.run(asyncio.wait_for(run(), 30))
    assert after == during and closed
    assert probes[0][1] == {"connect": 2.0, "read": 2.0, "write": 2.0, "pool": 2.0}
    assert [w.healthy for w in router.workers] == [False, True]
    assert metric(router, "worker_up", worker=A) == 0


def test_a_probe_that_cannot_connect_marks_its_worker_down() -> None:
    app, router, _ = router_app({A: unreachable})
    asyncio.run(router._probe(router.workers[0]))
    assert not router.workers[0].healthy and router.down[A].is_set()


def served(monkeypatch, module: ModuleType) -> tuple[dict, list[str]]:
    """What a module's run_* hands uvicorn.run (its keywords, and the app as "app"),
    and the levels it configures logging at, caught instead of serving."""
    import uvicorn

    got: dict = {}
    configured: list[str] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: got.update(kw, app=app))
    monkeypatch.setattr(module.logs, "configure", configured.append)
    return got, configured


def test_run_router_serves_the_app_with_the_head_timeout(monkeypatch) -> None:
    got, configured = served(monkeypatch, router_module)
    run_router(
        RouterConfig([A], policy="round-robin", head_timeout=7.0), "127.0.0.9", 8123, "debug"
    )
    assert configured == ["debug"]
    assert (got["host"], got["port"], got["log_level"]) == ("127.0.0.9", 8123, "debug")
    assert got["http"].keywords == {"head_timeout": 7.0}
    assert got["app"].state.router.config.head_timeout == 7.0


# The prefix key's tokens, as a worker counts them.


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """deepinfer-tiny whose tokenizer adds a BOS token to a plain prompt, as
    Llama's does, so that a chat (whose template writes its own) and a
    completion differ in it."""
    folder = tmp_path_factory.mktemp("bos") / "tiny"
    shutil.copytree(TINY, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_a_completion_is_tokenized_with_the_tokenizers_special_tokens(model: Path) -> None:
    tokens = Tokens(str(model), needed=64)
    plain = tokens.tokenizer.encode("Hello world", add_special_tokens=False).ids
    assert tokens.of("/v1/completions", {"prompt": "Hello world"}) == [0, *plain]
    assert tokens.of("/v1/completions", {"prompt": [7, 8, 9]}) == [7, 8, 9]
    assert tokens.of("/v1/completions", {"prompt": [[7, 8], [9]]}) == [7, 8]
    assert tokens.of("/v1/completions", {"prompt": ["Hello world", "x"]}) == [0, *plain]
    assert tokens.of("/v1/completions", {"prompt": 5}) is None  # a worker says why
    assert tokens.of("/v1/completions", {}) is None


def test_only_the_text_the_key_can_come_from_is_tokenized(model: Path) -> None:
    tokens = Tokens(str(model), needed=3)
    per_token = bytes_per_token(tokens.tokenizer)
    assert tokens.max_chars == 4 * per_token
    prompt = "ab " * 1000
    expected = tokens.tokenizer.encode(prompt[: 4 * per_token]).ids
    assert tokens.of("/v1/completions", {"prompt": prompt}) == expected
    assert len(expected) < len(tokens.tokenizer.encode(prompt).ids)


def test_a_chat_is_rendered_by_its_template_without_added_special_tokens(model: Path) -> None:
    tokens = Tokens(str(model), needed=64)
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"text": "there"}]},
    ]
    template = load_chat_template(model)
    rendered = template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}], True
    )
    assert rendered == "Be brief.\n\nQ: Hi there\nA:"
    encode = tokens.tokenizer.encode
    path = "/v1/chat/completions"
    assert tokens.of(path, {"messages": messages}) == encode(rendered, add_special_tokens=False).ids
    no_prompt = {"messages": messages, "add_generation_prompt": False}
    expected = encode(rendered.removesuffix("A:"), add_special_tokens=False).ids
    assert tokens.of(path, no_prompt) == expected
    assert tokens.of(path, {"messages": [{"role": "tool", "content": "x"}]}) is None


def test_the_router_keys_a_prompt_by_its_leading_blocks(model: Path) -> None:
    config = RouterConfig([A, B, "http://c.test"], model=str(model), block_size=4, prefix_blocks=2)
    router = Router(config)
    root = chain_root("router", "", 4)
    orders = set()
    for text in ("the quick brown fox jumps", "over the lazy dog", "def free(self", "1 2 3 4 5 6"):
        body = {"prompt": text * 3}
        key = prefix_key(router.tokens.of("/v1/completions", body), 4, 2, root)
        assert key is not None
        order = router.candidates("/v1/completions", json.dumps(body).encode())
        assert order == router.policy.candidates(key), text
        orders.add(tuple(w.url for w in order))
    assert len(orders) > 1  # the prompts' owners differ, so a wrong key shows
    # Not JSON: no key, so round-robin turns from the first worker.
    assert [w.url for w in router.candidates("/v1/completions", b"{")] == [
        A,
        B,
        "http://c.test",
    ]


def test_run_router_logs_at_info_by_default(monkeypatch) -> None:
    got, configured = served(monkeypatch, router_module)
    run_router(RouterConfig([A], policy="round-robin"), "127.0.0.9", 8123)
    assert configured == ["info"] and got["log_level"] == "info"  # uvicorn's spelling


class TwoAtOnce:
    """A worker whose replies wait until two of them are under way, then each
    notes what ``seen()`` says at that moment and sends ``chunk``."""

    def __init__(self, seen: Callable[[], object], chunk: bytes, content_type: str) -> None:
        self.seen, self.chunk, self.content_type = seen, chunk, content_type
        self.started, self.both = 0, asyncio.Event()
        self.during: list[object] = []

    async def body(self) -> AsyncIterator[bytes]:
        self.started += 1
        if self.started == 2:
            self.both.set()
        await self.both.wait()
        self.during.append(self.seen())
        yield self.chunk

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        headers = {"content-type": self.content_type}
        return httpx.Response(200, headers=headers, content=self.body())


def test_two_replies_at_once_from_one_worker_are_both_in_flight() -> None:
    worker = TwoAtOnce(lambda: metric(router, "in_flight", worker=A), b"{}", "application/json")
    app, router, _ = router_app({A: worker})

    async def run() -> None:
        await asyncio.wait_for(asyncio.gather(post(app), post(app)), 30)

    asyncio.run(run())
    assert worker.during == [2, 2] and router.workers[0].in_flight == 0
    assert metric(router, "requests_total", worker=A) == 2


def test_a_reply_without_a_content_type_is_passed_on_as_it_comes() -> None:
    async def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=pieces([b"data: 1", b"\n\nda"]))  # not events

    app, router, _ = router_app({A: answer})
    reply = asyncio.run(post(app))
    assert reply.status_code == 200 and reply.content == b"data: 1\n\nda"


def test_a_reply_not_a_stream_that_breaks_off_is_cut_without_an_error_event() -> None:
    async def body():
        yield b'{"choices": [{"te'
        raise httpx.ReadError("reset")

    async def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/json"}, content=body())

    app, router, _ = router_app({A: answer})
    reply = asyncio.run(post(app))
    assert reply.content == b'{"choices": [{"te'  # what came, and nothing added
    assert metric(router, "broken_replies_total") == 1 and not router.workers[0].healthy


def test_each_request_goes_to_the_owner_of_its_prompts_key(model: Path) -> None:
    workers = [A, B, "http://c.test"]
    seen: list[str] = []

    async def transport(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.scheme}://{request.url.host}")
        return await ok(request)

    app = build_router(RouterConfig(workers, model=str(model), block_size=4, prefix_blocks=2))
    router: Router = app.state.router
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(transport))
    root = chain_root("router", "", 4)
    owners = []
    for text in ("the quick brown fox jumps", "over the lazy dog", "def free(self", "1 2 3 4 5 6"):
        body = {"model": "m", "prompt": text * 3}
        key = prefix_key(router.tokens.of("/v1/completions", body), 4, 2, root)
        owners.append(router.policy.candidates(key)[0].url)

        async def send(body: dict = body) -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://r.test") as c:
                return await c.post("/v1/completions", json=body)

        assert asyncio.run(send()).status_code == 200
    assert seen == owners and len(set(owners)) > 1


def test_the_app_is_titled_and_routed_by_name_with_its_limits() -> None:
    from starlette.routing import Route

    from engine.entrypoints.middleware import BodyLimit
    from engine.entrypoints.read_timeouts import BodyTimeout

    config = RouterConfig([A], policy="round-robin", max_body_bytes=99, body_timeout=3.5)
    app = build_router(config)
    assert app.title == "DeepInfer router"
    named = {(r.path, r.name, tuple(sorted(r.methods))) for r in app.routes if isinstance(r, Route)}
    for method, path in FORWARDED:
        assert (path, path, (method,)) in named, path
    options = {m.cls: m.kwargs for m in app.user_middleware}
    assert options[BodyLimit] == {"max_bytes": 99} and options[BodyTimeout] == {"timeout": 3.5}


def test_round_robin_loads_no_tokenizer_and_prefix_needs_a_model() -> None:
    router = Router(RouterConfig(["http://wX/"], model=str(TINY), policy="round-robin"))
    assert router.tokens.tokenizer is None and [w.url for w in router.workers] == ["http://wX"]
    with pytest.raises(ValueError) as err:
        Router(RouterConfig([A], policy="prefix"))
    assert str(err.value) == "prefix-affinity routing needs --model, for the tokenizer"
