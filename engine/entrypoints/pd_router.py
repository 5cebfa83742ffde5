"""`deepinfer router --prefill URL... --decode URL...`: prefill/decode
disaggregation behind one OpenAI endpoint (Chapter 8).

A completion goes first to a prefill worker, chosen by prefix affinity, which
runs its prompt, saves the prompt's blocks to the shared store and replies
with the first token and the blocks' hash chain. It then goes to the least
loaded decode worker, which loads the blocks and streams the rest. If that
worker dies mid-stream, the request goes on on another from the tokens the
client has already seen: the handoff says how many, so the new worker sends
only what comes after. The client sees one stream. A prefill worker that
cannot answer is retried on the next.

Requests a handoff cannot carry (several choices, logprobs, echo, structured
output) and chat replies are served whole by one decode worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.entrypoints import logs
from engine.entrypoints.errors import OpenAIError
from engine.entrypoints.middleware import HeadAsGet
from engine.entrypoints.relay import EVENT_END, WorkerFailed, chunks
from engine.entrypoints.router import Tokens
from engine.entrypoints.routing import PrefixAffinity, RoundRobin, Worker, prefix_key
from engine.kv.hashing import chain_root

logger = logging.getLogger("deepinfer.router")
PLAIN_FIELDS = ("logprobs", "echo", "prompt_logprobs", "response_format", "structured_outputs")
PLAIN_FIELDS += ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass
class PDRouterConfig:
    prefill: list[str]
    decode: list[str]
    model: str | None = None  # the workers' folder, for prefix affinity's tokenizer
    block_size: int = 16
    prefix_blocks: int = 4
    load_factor: float = 1.25
    health_interval: float = 2.0
    connect_timeout: float = 2.0
    idle_timeout: float = 120.0  # between two pieces of a worker's reply


class PDMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"deepinfer_router:{name}", doc, registry=r)

        self.handed_on = counter(
            "pd_handoffs", "Requests prefilled on one worker, decoded on another."
        )
        self.plain = counter("pd_plain", "Requests served whole by one decode worker.")
        self.prefill_retries = counter("pd_prefill_retries", "Prefill attempts that failed.")
        self.resumed = counter("pd_resumed", "Decodes resumed on another worker.")


def handoff_able(body: dict) -> bool:
    """Can a prefill worker hand this request on? One prompt, one choice, and
    nothing the handoff does not carry."""
    prompt = body.get("prompt")
    one_prompt = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
    )
    plain = any(body.get(f) not in (None, False) for f in PLAIN_FIELDS)
    return one_prompt and body.get("n", 1) == 1 and not plain


def parse_event(event: bytes) -> dict | None:
    """A server-sent event's JSON; None for [DONE] or anything else."""
    data = event.strip().removeprefix(b"data: ")
    if data == b"[DONE]":
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


class PDRouter:
    def __init__(self, config: PDRouterConfig) -> None:
        self.config = config
        self.prefill = [Worker(url.rstrip("/")) for url in config.prefill]
        self.decode = [Worker(url.rstrip("/")) for url in config.decode]
        if config.model is not None:
            self.policy = PrefixAffinity(self.prefill, config.load_factor)
        else:
            self.policy = RoundRobin(self.prefill)
        self.tokens = Tokens(config.model, config.prefix_blocks * config.block_size)
        self.root = chain_root("router", "", config.block_size)
        self.metrics = PDMetrics()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.connect_timeout))

    async def completions(self, request: Request) -> Response:
        body = json.loads(await request.body())
        if not handoff_able(body):
            self.metrics.plain.inc()
            return await self.whole(body)
        reply = await self.prefill_step(body)
        if isinstance(reply, Response):
            return reply  # the prefill worker refused it, as the client will hear
        [choice] = reply["choices"]
        if choice["finish_reason"] == "stop" or body.get("max_tokens", 16) == 1:
            self.metrics.plain.inc()  # it ended at its first token: served whole
            return await self.whole(body)
        transfer = reply["kv_transfer_params"]
        handed = {
            "output_token_ids": transfer["output_token_ids"],
            "block_hashes": transfer["block_hashes"],
        }
        decode_body = body | {"seed": transfer["seed"], "kv_transfer_params": handed}
        self.metrics.handed_on.inc()
        if body.get("stream"):
            events = self.stream(decode_body, reply["id"])
            return StreamingResponse(events, media_type="text/event-stream")
        return await self.whole(decode_body)

    # --8<-- [start:prefill_step]
    async def prefill_step(self, body: dict) -> dict | Response:
        """The prefill worker's reply: its first token and the blocks' chain. A
        worker that cannot answer, or fails (5xx), is left for the next."""
        ids = self.tokens.of("/v1/completions", body)
        key = (
            None
            if ids is None
            else prefix_key(ids, self.config.block_size, self.config.prefix_blocks, self.root)
        )
        ask = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        ask["kv_transfer_params"] = {"do_remote_decode": True}
        for worker in self.policy.candidates(key):
            try:
                reply = await self.client.post(worker.url + "/v1/completions", json=ask)
            except httpx.TransportError as err:
                logger.warning("prefill worker %s unreachable (%s)", worker.url, err)
                worker.healthy = False
                self.metrics.prefill_retries.inc()
                continue
            if reply.status_code >= 500:
                self.metrics.prefill_retries.inc()
                continue
            if reply.status_code != 200:
                return Response(reply.content, reply.status_code, media_type="application/json")
            return reply.json()
        raise OpenAIError(503, "no prefill worker is available", headers={"Retry-After": "1"})

    # --8<-- [end:prefill_step]

    def decoders(self, tried: set[str]) -> list[Worker]:
        """Healthy decode workers not yet tried for this request, least loaded first."""
        fresh = [w for w in self.decode if w.healthy and w.url not in tried]
        return sorted(fresh, key=lambda w: w.in_flight)

    async def whole(self, body: dict, path: str = "/v1/completions") -> Response:
        """One decode worker's reply, passed on: a stream as it comes, any other
        reply once whole. A worker that cannot answer, or fails (5xx), or dies
        before a whole reply, is left for the next."""
        tried: set[str] = set()
        while workers := self.decoders(tried):
            worker = workers[0]
            tried.add(worker.url)
            url = worker.url + path
            try:
                if body.get("stream"):
                    reply = await self.client.send(
                        self.client.build_request("POST", url, json=body), stream=True
                    )
                else:
                    reply = await self.client.post(url, json=body)
            except httpx.TransportError:
                worker.healthy = False
                continue
            if reply.status_code >= 500:
                await reply.aclose()
                continue
            kind = reply.headers.get("content-type")
            if not body.get("stream"):
                return Response(reply.content, reply.status_code, media_type=kind)
            return StreamingResponse(self._pass(worker, reply), reply.status_code, media_type=kind)
        raise OpenAIError(503, "no decode worker is available", headers={"Retry-After": "1"})

    async def _pass(self, worker: Worker, reply: httpx.Response) -> AsyncIterator[bytes]:
        worker.in_flight += 1
        try:
            async for piece in chunks(reply, self.config.idle_timeout):
                yield piece
        except WorkerFailed as failure:
            logger.warning("decode worker %s: %s", worker.url, failure)
        finally:
            worker.in_flight -= 1
            await reply.aclose()

    # --8<-- [start:stream]
    async def stream(self, body: dict, stream_id: str) -> AsyncIterator[bytes]:
        """The decode worker's events, as one stream under one id. If the worker
        dies, the request goes on on another from the tokens already shown."""
        handed = body["kv_transfer_params"]
        shown: list[int] = []  # tokens whose text the client has been sent
        tried: set[str] = set()
        while workers := self.decoders(tried):
            worker = workers[0]
            tried.add(worker.url)
            if shown:  # a resume: the new worker sends only what comes after
                self.metrics.resumed.inc()
                handed = handed | {"output_token_ids": shown, "num_sent_tokens": len(shown)}
            try:
                async for event in self._events(worker, body | {"kv_transfer_params": handed}):
                    if event is None:
                        yield b"data: [DONE]" + EVENT_END
                        return
                    for choice in event.get("choices", []):
                        shown += choice.pop("token_ids", None) or []
                    event["id"] = stream_id
                    yield b"data: " + json.dumps(event).encode() + EVENT_END
                return
            except WorkerFailed as failure:
                logger.warning("decode worker %s failed (%s); resuming", worker.url, failure)
                worker.healthy = not failure.died
        error = OpenAIError(503, "no decode worker could finish the stream", code="worker_failed")
        yield (
            b"data: " + json.dumps(error.body()).encode() + EVENT_END + b"data: [DONE]" + EVENT_END
        )

    # --8<-- [end:stream]

    async def _events(self, worker: Worker, body: dict) -> AsyncIterator[dict | None]:
        """A decode worker's stream as parsed events, None for [DONE]; WorkerFailed
        if it cannot be reached, fails before streaming, or breaks off."""
        request = self.client.build_request("POST", worker.url + "/v1/completions", json=body)
        try:
            reply = await self.client.send(request, stream=True)
        except httpx.TransportError as err:
            raise WorkerFailed(f"unreachable ({err!r})", died=True) from None
        worker.in_flight += 1
        try:
            if reply.status_code != 200:
                raise WorkerFailed(f"status {reply.status_code}", died=False)
            pending = b""
            async for piece in chunks(reply, self.config.idle_timeout):
                pending += piece
                while (cut := pending.find(EVENT_END)) >= 0:
                    event, pending = pending[:cut], pending[cut + len(EVENT_END) :]
                    parsed = parse_event(event)
                    if parsed is None and event.strip() == b"data: [DONE]":
                        yield None
                        return
                    if parsed is not None:
                        yield parsed
            raise WorkerFailed("the stream ended before [DONE]", died=True)
        finally:
            worker.in_flight -= 1
            await reply.aclose()

    async def check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(w) for w in self.prefill + self.decode))
            await asyncio.sleep(self.config.health_interval)

    async def _probe(self, worker: Worker) -> None:
        try:
            reply = await self.client.get(worker.url + "/health", timeout=2.0)
            worker.healthy = reply.status_code == 200
        except httpx.HTTPError:
            worker.healthy = False

    async def check_workers(self) -> None:
        """At start-up: every worker that answers must play its part, and all
        must share one store key space (model, KV format, block size) and store."""
        infos = {}
        for role, workers in (("prefill", self.prefill), ("decode", self.decode)):
            for w in workers:
                try:
                    info = (await self.client.get(w.url + "/kv/info", timeout=5.0)).json()
                except (httpx.HTTPError, ValueError):
                    continue  # down now: its health check brings it in later
                if info["role"] not in (role, "both") or info["namespace"] is None:
                    raise ValueError(f"{w.url} cannot be a {role} worker: it serves {info}")
                infos[w.url] = info
        spaces = {(i["namespace"], i["block_size"], i["kv_store"]) for i in infos.values()}
        if len(spaces) > 1:
            raise ValueError(
                "the workers do not share one KV store key space (another model, KV "
                f"format, block size or store): {infos}"
            )


def build_pd_router(config: PDRouterConfig) -> FastAPI:
    router = PDRouter(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.check_workers()  # a ValueError stops the router at start-up
        checker = asyncio.create_task(router.check_health())
        yield
        checker.cancel()
        await router.client.aclose()

    app = FastAPI(title="DeepInfer PD router", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(HeadAsGet)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError) -> Response:
        return err.response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        router.metrics.plain.inc()  # a chat reply is served whole by one decode worker
        return await router.whole(json.loads(await request.body()), "/v1/chat/completions")

    add_worker_routes(app, router)

    @app.get("/health")
    async def health() -> Response:
        workers = router.prefill + router.decode
        if not any(w.healthy for w in router.prefill) or not any(w.healthy for w in router.decode):
            raise OpenAIError(503, "no prefill or no decode worker is healthy")
        return JSONResponse({"status": "ok", "workers": {w.url: w.healthy for w in workers}})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def add_worker_routes(app: FastAPI, router: PDRouter) -> None:
    """What one decode worker answers whole, as a plain server would: the Responses
    API, /v1/models and vLLM's tokenizer endpoints."""

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        router.metrics.plain.inc()  # as a chat: served whole by one decode worker
        return await router.whole(json.loads(await request.body()), "/v1/responses")

    # vLLM's tokenizer endpoints (tokenize_api.py): any decode worker answers.
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.whole(json.loads(await request.body()), "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.whole(json.loads(await request.body()), "/detokenize")

    @app.get("/v1/models")
    async def models() -> Response:
        return await first_decoder_get("/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await first_decoder_get(f"/v1/models/{model_id}")

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return await first_decoder_get("/tokenizer_info")

    async def first_decoder_get(path: str) -> Response:
        for worker in router.decoders(set()):
            with contextlib.suppress(httpx.HTTPError):
                reply = await router.client.get(worker.url + path, timeout=10.0)
                return Response(reply.content, reply.status_code, media_type="application/json")
        raise OpenAIError(503, "no decode worker is available")


def run_pd_router(config: PDRouterConfig, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    logs.configure(log_level)
    uvicorn.run(build_pd_router(config), host=host, port=port, log_level=log_level)
