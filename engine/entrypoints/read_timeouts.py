"""How long a client may take to send its request: the head (request line and
headers) and the body, as nginx's client_header_timeout and client_body_timeout
bound them. Without them a client that opens connections and sends a byte a
minute holds each one, and the server's file descriptors, for ever.

The head's clock is uvicorn's HTTP protocol's: it starts when the connection
opens, and again when a response completes on a kept-alive connection, and
stops when the head is whole; past it the connection is closed. The body's is
an ASGI middleware's: each piece of the body must come within the timeout of
the one before, or the request gets a 408.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.entrypoints.errors import OpenAIError


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late."""

    def __init__(self, *args: object, head_timeout: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self.head_timer: asyncio.TimerHandle | None = None
        self.waiting_cycle = None  # the cycle that was current when the clock started

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_clock()

    def handle_events(self) -> None:
        super().handle_events()
        if self.head_timer is not None and self.cycle is not self.waiting_cycle:
            self._stop_clock()  # a new request's head came whole

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._start_clock()  # the next request's head, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _start_clock(self) -> None:
        self._stop_clock()
        self.waiting_cycle = self.cycle
        self.head_timer = self.loop.call_later(self.head_timeout, self._late)

    def _stop_clock(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _late(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def with_head_timeout(head_timeout: float) -> Callable[..., HeadTimeoutProtocol]:
    """What uvicorn.Config(http=...) takes: the protocol, with its timeout."""
    return functools.partial(HeadTimeoutProtocol, head_timeout=head_timeout)


class BodyTimedOut(HTTPException):
    """An HTTPException, which FastAPI passes on from reading a body (it turns any
    other error there into a 400), and the app's handler answers as OpenAI would."""

    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"the request body paused for more than {timeout} s")


class BodyTimeout:
    """A 408 for a request whose body pauses for longer than ``timeout`` seconds."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        whole = False

        async def timed() -> Message:
            nonlocal whole
            if whole:  # from here on receive() waits for a disconnect: no clock
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                raise BodyTimedOut(self.timeout) from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        try:
            await self.app(scope, timed, send)
        except BodyTimedOut as err:  # raised outside the app's handlers (BodyLimit reads too)
            await OpenAIError(err.status_code, err.detail).response()(scope, receive, send)
