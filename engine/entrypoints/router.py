"""`deepinfer router --worker URL --worker URL ...`: one OpenAI endpoint in front
of several `deepinfer serve` workers.

Each generating request goes to the worker its policy picks (prefix affinity,
or round-robin), streamed through as the worker sends it. A worker that cannot
be reached before it has sent a byte is marked down and the request goes to
the next candidate; health checks bring workers back. The router loads no
torch: to hash a prompt it needs only the tokenizer and the chat template.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.entrypoints import logs, relay
from engine.entrypoints.chat_template import ChatTemplate, load_chat_template
from engine.entrypoints.errors import OpenAIError
from engine.entrypoints.middleware import BodyLimit, HeadAsGet
from engine.entrypoints.prompt_tokens import bytes_per_token
from engine.entrypoints.read_timeouts import BodyTimeout, with_head_timeout
from engine.entrypoints.relay import WorkerFailed
from engine.entrypoints.routing import PrefixAffinity, RoundRobin, Worker, prefix_key
from engine.kv.hashing import chain_root

logger = logging.getLogger("deepinfer.router")
# Headers that belong to one hop, not to the request or response forwarded.
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


@dataclass
class RouterConfig:
    workers: list[str]
    model: str | None = None  # the workers' folder: tokenizer and chat template
    policy: str = "prefix"  # or "round-robin"
    block_size: int = 16  # the workers' block size
    prefix_blocks: int = 4
    load_factor: float = 1.25
    health_interval: float = 2.0
    max_body_bytes: int = 4 * 1024 * 1024  # as the workers': the router reads a body whole
    connect_timeout: float = 2.0
    # Until a worker's reply begins: a non-streamed reply begins only when it is
    # whole. Meanwhile a worker found stalled by its health check is left at once.
    first_byte_timeout: float = 600.0
    idle_timeout: float = 120.0  # between two pieces of a reply's body
    head_timeout: float = 60.0  # for clients, as the workers' (read_timeouts.py)
    body_timeout: float = 60.0


class RouterMetrics:
    def __init__(self, workers: list[Worker]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "deepinfer_router:requests", "Requests sent, by worker.", ["worker"], registry=r
        )
        self.retries = Counter(
            "deepinfer_router:retries",
            "Attempts whose worker could not be reached; the request went on to the next.",
            registry=r,
        )
        self.unroutable = Counter(
            "deepinfer_router:unroutable", "Requests no worker could take.", registry=r
        )
        self.stalls = Counter(
            "deepinfer_router:stalls",
            "Attempts left before their first byte: the worker went down or took too long.",
            registry=r,
        )
        self.broken = Counter(
            "deepinfer_router:broken_replies",
            "Replies that broke off after their first byte; a stream ends with an error event.",
            registry=r,
        )
        self.up = Gauge(
            "deepinfer_router:worker_up", "1 if the worker is healthy.", ["worker"], registry=r
        )
        self.in_flight = Gauge(
            "deepinfer_router:in_flight", "Requests in flight, by worker.", ["worker"], registry=r
        )
        for w in workers:
            self.up.labels(w.url).set(1)
            self.in_flight.labels(w.url).set(0)


class Tokens:
    """A request's prompt as token ids, computed as the worker will compute it."""

    def __init__(self, model: str | None, needed: int) -> None:
        """``needed``: how many leading tokens the key uses. Only the text they can
        come from is tokenized, so that a huge prompt costs the router no more
        than a short one (the worker refuses it, off its own event loop)."""
        self.tokenizer = self.template = None
        self.max_chars: int | None = None
        if model is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
            self.template: ChatTemplate | None = load_chat_template(Path(model))
            if (per_token := bytes_per_token(self.tokenizer)) is not None:
                self.max_chars = (needed + 1) * per_token  # a char is at least one byte

    def of(self, path: str, body: dict) -> list[int] | None:
        """None when the body is not one we can read: the worker will say why."""
        try:
            if path.endswith("/chat/completions"):
                messages = [
                    {
                        "role": "system" if m["role"] == "developer" else m["role"],
                        "content": _text(m["content"]),
                    }
                    for m in body["messages"]
                ]
                prompt = self.template.render(messages, body.get("add_generation_prompt", True))
            else:
                prompt = body["prompt"]
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]  # a batch: its first prompt chooses
            if isinstance(prompt, list):
                return [int(t) for t in prompt]
            # As the worker encodes it: a chat's template writes its own special tokens.
            chat = path.endswith("/chat/completions")
            return self.tokenizer.encode(prompt[: self.max_chars], add_special_tokens=not chat).ids
        except Exception:
            return None


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.workers = [Worker(url.rstrip("/")) for url in config.workers]
        if config.policy == "prefix":
            if config.model is None:
                raise ValueError("prefix-affinity routing needs --model, for the tokenizer")
            self.policy = PrefixAffinity(self.workers, config.load_factor)
        else:
            self.policy = RoundRobin(self.workers)
        needed = config.prefix_blocks * config.block_size
        self.tokens = Tokens(config.model if config.policy == "prefix" else None, needed)
        # The router's own chain root: keys need only agree with one another.
        self.root = chain_root("router", "", config.block_size)
        self.metrics = RouterMetrics(self.workers)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.connect_timeout))
        self.down = {w.url: asyncio.Event() for w in self.workers}  # set while a worker is down

    def candidates(self, path: str, body: bytes) -> list[Worker]:
        key = None
        if isinstance(self.policy, PrefixAffinity):
            try:
                ids = self.tokens.of(path, json.loads(body))
            except ValueError:
                ids = None
            if ids is not None:
                key = prefix_key(ids, self.config.block_size, self.config.prefix_blocks, self.root)
        return self.policy.candidates(key)

    async def forward(self, request: Request) -> Response:
        """Send the request to the first candidate whose reply begins; stream the
        reply. Before its first byte a request can go elsewhere unharmed."""
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        timed_out = False
        for worker in self.candidates(request.url.path, body):
            upstream = self.client.build_request(
                request.method, worker.url + request.url.path, headers=headers, content=body
            )
            try:
                reply = await self._first_byte(worker, upstream)
            except httpx.TransportError as err:  # down before its first byte: next one
                logger.warning("worker %s unreachable (%s); trying another", worker.url, err)
                self.mark(worker, healthy=False)
                self.metrics.retries.inc()
                continue
            if reply is None:  # stalled: the health check found it down, or time ran out
                timed_out = True
                self.mark(worker, healthy=False)
                self.metrics.stalls.inc()
                self.metrics.retries.inc()
                continue
            return self._relay(worker, reply)
        self.metrics.unroutable.inc()
        if timed_out:
            raise OpenAIError(504, "no worker answered in time", headers={"Retry-After": "1"})
        raise OpenAIError(503, "no worker is available", headers={"Retry-After": "1"})

    async def _first_byte(self, worker: Worker, upstream: httpx.Request) -> httpx.Response | None:
        """The worker's reply once it begins; None if the worker is marked down
        first, or the first-byte timeout passes."""
        send = asyncio.ensure_future(self.client.send(upstream, stream=True))
        down = asyncio.ensure_future(self.down[worker.url].wait())
        timeout = self.config.first_byte_timeout
        await asyncio.wait({send, down}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        down.cancel()
        if send.done():
            return send.result()
        send.cancel()
        (outcome,) = await asyncio.gather(send, return_exceptions=True)
        if isinstance(outcome, httpx.Response):  # it began as we gave up on it
            await outcome.aclose()
        logger.warning("worker %s sent nothing in time; trying another", worker.url)
        return None

    def _relay(self, worker: Worker, reply: httpx.Response) -> Response:
        worker.in_flight += 1
        self.metrics.requests.labels(worker.url).inc()
        self.metrics.in_flight.labels(worker.url).set(worker.in_flight)

        def failed(failure: WorkerFailed) -> None:
            logger.warning("worker %s: %s", worker.url, failure)
            self.metrics.broken.inc()
            if failure.died:
                self.mark(worker, healthy=False)

        stream = reply.headers.get("content-type", "").startswith("text/event-stream")
        pieces = (relay.events if stream else relay.raw)(reply, self.config.idle_timeout, failed)

        async def body():
            try:
                async for piece in pieces:
                    yield piece
            finally:
                await reply.aclose()  # a client that left closes the worker's stream too
                worker.in_flight -= 1
                self.metrics.in_flight.labels(worker.url).set(worker.in_flight)

        headers = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_HEADERS}
        headers["x-deepinfer-worker"] = worker.url
        return StreamingResponse(body(), status_code=reply.status_code, headers=headers)

    def mark(self, worker: Worker, healthy: bool) -> None:
        if worker.healthy != healthy:
            logger.info("worker %s is %s", worker.url, "up" if healthy else "down")
        worker.healthy = healthy
        self.metrics.up.labels(worker.url).set(int(healthy))
        if healthy:
            self.down[worker.url].clear()
        else:
            self.down[worker.url].set()  # requests waiting on it go elsewhere

    async def check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(w) for w in self.workers))
            await asyncio.sleep(self.config.health_interval)

    async def _probe(self, worker: Worker) -> None:
        try:
            reply = await self.client.get(worker.url + "/health", timeout=2.0)
            self.mark(worker, reply.status_code == 200)
        except httpx.HTTPError:
            self.mark(worker, False)


# What the router passes to a worker, as it came: the workers' OpenAI and vLLM
# endpoints. Any worker answers /v1/models and the tokenizer's as another would.
FORWARDED = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id:path}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/tokenizer_info"),
]


def build_router(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        checker = asyncio.create_task(router.check_health())
        yield
        checker.cancel()
        await router.client.aclose()

    app = FastAPI(title="DeepInfer router", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(BodyTimeout, timeout=config.body_timeout)
    app.add_middleware(HeadAsGet)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError) -> Response:
        return err.response()

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> Response:
        logger.exception("%s %s failed", request.method, request.url.path)
        return OpenAIError(500, f"the router failed: {type(err).__name__}").response()

    for method, path in FORWARDED:
        app.add_api_route(path, router.forward, methods=[method], name=path)

    @app.get("/health")
    async def health() -> Response:
        if not any(w.healthy for w in router.workers):
            raise OpenAIError(503, "no worker is healthy")
        return JSONResponse({"status": "ok", "workers": {w.url: w.healthy for w in router.workers}})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_router(config: RouterConfig, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    logs.configure(log_level)
    http = with_head_timeout(config.head_timeout)
    uvicorn.run(build_router(config), host=host, port=port, log_level=log_level, http=http)
