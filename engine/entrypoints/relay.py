"""A worker's reply, passed on to the client by the router, and what the client
hears when the worker stops answering partway.

A stream of server-sent events is passed on an event at a time, never a part
of one, so that if the worker dies or goes quiet for longer than the idle
timeout, the client's stream still ends well formed: with an OpenAI error
event, as the worker itself ends a stream it cannot finish, then `[DONE]`.
Any other body is passed on as it comes; cut short, it is simply cut.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

import httpx

from engine.entrypoints.errors import OpenAIError

logger = logging.getLogger("deepinfer.router")
EVENT_END = b"\n\n"


class WorkerFailed(Exception):
    """The worker's reply broke off: it died (``died``) or went quiet."""

    def __init__(self, message: str, died: bool) -> None:
        super().__init__(message)
        self.died = died


async def chunks(reply: httpx.Response, idle_timeout: float | None) -> AsyncIterator[bytes]:
    """The reply's body as it comes; WorkerFailed if it breaks off or goes quiet."""
    body = reply.aiter_raw()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(body), idle_timeout)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise WorkerFailed(
                f"the worker sent nothing for {idle_timeout} s", died=False
            ) from None
        except httpx.HTTPError as err:
            raise WorkerFailed(f"the worker's reply broke off ({err!r})", died=True) from None
        yield chunk


async def events(
    reply: httpx.Response, idle_timeout: float | None, on_failure: Callable[[WorkerFailed], None]
) -> AsyncIterator[bytes]:
    """Whole server-sent events; a broken stream ends in an error event and [DONE]."""
    pending = b""
    try:
        async for chunk in chunks(reply, idle_timeout):
            pending += chunk
            cut = pending.rfind(EVENT_END)
            if cut >= 0:
                whole, pending = pending[: cut + len(EVENT_END)], pending[cut + len(EVENT_END) :]
                yield whole
    except WorkerFailed as failure:
        on_failure(failure)  # the part of an event never sent is dropped
        error = OpenAIError(502, f"the stream was cut: {failure}", code="worker_failed")
        yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
        return
    if pending:
        yield pending


async def raw(
    reply: httpx.Response, idle_timeout: float | None, on_failure: Callable[[WorkerFailed], None]
) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks(reply, idle_timeout):
            yield chunk
    except WorkerFailed as failure:
        on_failure(failure)
