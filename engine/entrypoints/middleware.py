"""Checks every request meets before a handler sees it: a request id, the API
key, and the body's size; and HEAD, answered as GET without the body. Plain
ASGI, so that streaming responses and disconnects pass through untouched."""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.entrypoints.errors import OpenAIError


class RequestId:
    """Give every request an id: in scope['state'], and as X-Request-Id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        await self.app(scope, receive, send_with_id)


class HeadAsGet:
    """HEAD on a GET route: the GET's status and headers, without its body, as HTTP
    defines HEAD. FastAPI's routes answer only the methods they declare, so a
    client's HEAD /health (a load balancer's probe) met 405. On a route without
    GET, HEAD still gets the route's 405."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # the body's last message ends it, empty
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, without_body)


class ApiKey:
    """With a key set, /v1/ answers only `Authorization: Bearer KEY`; the key is
    compared in constant time, so its prefix cannot be found by timing."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or not _guarded(scope["path"]):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            error = OpenAIError(401, "a valid API key is required", code="invalid_api_key")
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _guarded(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1"


class BodyLimit:
    """Refuse a body over ``max_bytes`` with 413: by its Content-Length, or, when
    it comes in chunks without one, by reading it here (up to the limit) before
    the app sees it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # from here on, only a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = OpenAIError(413, f"the request body is larger than {self.max_bytes} bytes")
        await error.response()(scope, receive, send)


class CountResponses:
    """Count every response by its path and status, for /metrics."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counted)
