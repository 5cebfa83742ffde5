"""`deepinfer serve MODEL`: an OpenAI-compatible HTTP server over one engine.

    POST /v1/completions, /v1/chat/completions   (stream: true for server-sent events)
    POST /v1/responses                           (OpenAI's Responses API, text; responses.py)
    GET  /v1/models, /v1/models/{id}, /health, /metrics
    POST /tokenize, /detokenize; GET /tokenizer_info   (vLLM's, tokenize_api.py)

Every error is OpenAI's error object: a bad request is a 400 that says what is
wrong, an engine failure a 500 with the request's id, and the server goes on.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from engine.config import EngineConfig
from engine.entrypoints import logs
from engine.entrypoints.async_llm import AsyncLLM, CoreMode
from engine.entrypoints.chat_template import load_chat_template
from engine.entrypoints.errors import OpenAIError
from engine.entrypoints.metrics import ServerMetrics
from engine.entrypoints.middleware import ApiKey, BodyLimit, CountResponses, HeadAsGet, RequestId
from engine.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from engine.entrypoints.read_timeouts import BodyTimeout, with_head_timeout
from engine.entrypoints.responses import Response as ResponseObject
from engine.entrypoints.responses import Responses, ResponsesRequest
from engine.entrypoints.serving import OpenAIServing
from engine.entrypoints.tokenize_api import tokenize_routes

logger = logging.getLogger("deepinfer.server")


@dataclass
class ServerConfig:
    engine: EngineConfig
    served_model_names: list[str] = field(default_factory=list)  # default: the folder's name
    api_key: str | None = None
    max_waiting: int = 1024  # requests without a first token; more are refused with 503
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout: float = 30.0  # on SIGTERM: how long requests in flight may go on
    head_timeout: float = 60.0  # to send a request's line and headers (read_timeouts.py)
    body_timeout: float = 60.0  # between two pieces of a request's body
    # The engine core's own process, or a thread of the server's (async_llm.py).
    engine_core: CoreMode = "thread"


ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 413, 500, 503)}


def build_app(config: ServerConfig) -> FastAPI:
    """The app, with its engine loaded; the core thread starts with the app."""
    names = config.served_model_names or [Path(config.engine.model).name]
    metrics = ServerMetrics(names[0])
    llm = AsyncLLM(config.engine, metrics, config.max_waiting, config.engine_core)
    serving = OpenAIServing(llm, names, load_chat_template(Path(config.engine.model)))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()
        yield
        llm.stop()

    app = FastAPI(title="DeepInfer", lifespan=lifespan, responses=ERRORS)
    app.state.llm = llm
    add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(BodyTimeout, timeout=config.body_timeout)
    app.add_middleware(ApiKey, api_key=config.api_key)
    app.add_middleware(CountResponses, count=metrics.answered)
    app.add_middleware(HeadAsGet)
    app.add_middleware(RequestId)  # added last: runs first
    app.include_router(tokenize_routes(serving, Path(config.engine.model)))  # vLLM's, at the root

    add_generating_routes(app, serving)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=n, max_model_len=llm.max_model_len) for n in names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return ModelCard(id=model_id, max_model_len=llm.max_model_len)

    @app.get("/health")
    async def health() -> Response:
        if llm.draining:
            raise OpenAIError(503, "the server is shutting down")
        if not llm.healthy:
            raise OpenAIError(503, f"the engine is not running: {llm.core.dead}")
        return JSONResponse({"status": "ok"})

    @app.get("/kv/info")
    async def kv_info() -> Response:
        """What a PD router checks before it pairs workers (Chapter 8): their role,
        and the store's key space, which only workers that can share blocks share."""
        config = llm.config
        root = llm.kv_root.hex() if llm.kv_root is not None else None
        info = {"role": config.role, "namespace": root, "block_size": llm.block_size}
        return JSONResponse(info | {"kv_store": config.kv_store})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def add_generating_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """The endpoints that run the engine, each cancelled if its client goes."""
    responses = Responses(serving)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request):
        return await until_disconnect(request, serving.completions(body, request_id(request)))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await until_disconnect(request, serving.chat(body, request_id(request)))

    @app.post("/v1/responses", response_model=ResponseObject)
    async def create_response(body: ResponsesRequest, request: Request):
        return await until_disconnect(request, responses.create(body, request_id(request)))


def request_id(request: Request) -> str:
    return request.scope["state"]["request_id"]


async def until_disconnect(request: Request, handler):
    """Run a handler, cancelling it if the client disconnects first: the engine
    requests it started are then aborted. A stream watches for itself."""
    task = asyncio.ensure_future(handler)
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()
        return Response(status_code=499)  # nobody is listening
    gone.cancel()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError) -> Response:
        if err.status >= 500:
            err.request_id = request_id(request)
            logger.error("request %s: %s", err.request_id, err.message)
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        return invalid_request(err.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        return OpenAIError(err.status_code, str(err.detail), headers=err.headers).response()

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> Response:
        rid = request_id(request)
        logger.exception("request %s failed", rid)
        message = f"internal server error (request id {rid})"
        return OpenAIError(500, message, request_id=rid).response()


def invalid_request(problems: list[dict]) -> OpenAIError:
    """One 400 for pydantic's errors: the first problem of each field, by name."""
    if any(p.get("type") == "json_invalid" for p in problems):
        return OpenAIError(400, "the body is not valid JSON")
    first: dict[str, str] = {}
    for p in problems:
        loc = [str(x) for x in p.get("loc", ())[1:]]  # drop "body"
        field = loc[0] if loc else "body"
        first.setdefault(field, f"{'.'.join(loc) or field}: {p.get('msg')}")
    fields = list(first)
    return OpenAIError(400, "; ".join(first.values()), param=fields[0] if fields else None)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but on SIGTERM or Ctrl-C the engine first stops taking
    requests and gives those in flight ``shutdown_timeout`` seconds; whatever
    is left then ends with a 503 or an error event, so that no client is cut
    off without a word. uvicorn meanwhile stops listening and waits for them."""

    MARGIN_S = 5.0  # for the last responses to be written

    def __init__(self, app: FastAPI, config: ServerConfig, **uvicorn_kw: object) -> None:
        timeout = config.shutdown_timeout + self.MARGIN_S
        http = with_head_timeout(config.head_timeout)
        super().__init__(
            uvicorn.Config(app, http=http, timeout_graceful_shutdown=timeout, **uvicorn_kw)
        )
        self.llm: AsyncLLM = app.state.llm
        self.shutdown_timeout = config.shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self.llm.loop is not None:
            self.llm.loop.call_soon_threadsafe(self.llm.drain, self.shutdown_timeout)
        super().handle_exit(sig, frame)


def run_server(config: ServerConfig, host: str, port: int, log_level: str = "info") -> None:
    logs.configure(log_level)
    app = build_app(config)
    DrainingServer(app, config, host=host, port=port, log_level=log_level).run()
