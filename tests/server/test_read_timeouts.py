"""A client that sends its request slowly is cut off: a connection whose request
head does not come whole in time is closed, on a fresh connection and between
requests on a kept-alive one, and a body that pauses gets a 408 in OpenAI's
shape. A prompt client is not touched. uvicorn runs here, in a thread, with the
server's protocol and middleware around a one-route app."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from engine.config import EngineConfig
from engine.entrypoints.api_server import (
    DrainingServer,
    ServerConfig,
    add_error_handlers,
    build_app,
)
from engine.entrypoints.read_timeouts import BodyTimeout, HeadTimeoutProtocol, with_head_timeout
from tests.server.conftest import TINY

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    add_error_handlers(app)  # the server's: OpenAI's error shape
    app.add_middleware(BodyTimeout, timeout=TIMEOUT_S)
    config = uvicorn.Config(app, log_level="warning", http=with_head_timeout(TIMEOUT_S))
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield sock.getsockname()
    server.should_exit = True
    thread.join(timeout=10)


def closed_after(conn: socket.socket, limit: float = 10.0) -> tuple[bytes, float]:
    """Read until the server closes: what it sent, and how long that took."""
    conn.settimeout(limit)
    start, data = time.monotonic(), b""
    while chunk := conn.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def request(body: bytes = b"{}") -> bytes:
    head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def test_a_silent_connection_is_closed(address) -> None:
    with socket.create_connection(address) as conn:
        data, took = closed_after(conn)
    assert data == b"" and took >= TIMEOUT_S * 0.8


def test_a_head_sent_a_byte_at_a_time_is_cut_off(address) -> None:
    with socket.create_connection(address) as conn:
        start = time.monotonic()
        with pytest.raises(OSError):  # the server closes while we still send
            for byte in request()[:-4]:
                conn.sendall(bytes([byte]))
                time.sleep(0.05)
                assert time.monotonic() - start < 10
        assert time.monotonic() - start >= TIMEOUT_S * 0.8


def test_a_prompt_client_is_served_and_its_idle_kept_alive_connection_closed(address) -> None:
    with socket.create_connection(address) as conn:
        for _ in range(2):  # two requests on one connection
            conn.sendall(request(b'{"a": 1}'))
            conn.settimeout(10)
            reply = b""
            while not reply.endswith(b'{"bytes":8}'):
                reply += conn.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200"), reply
        data, _ = closed_after(conn)  # then silent: uvicorn's keep-alive or the head clock
    assert data == b""


def test_a_paused_body_gets_408(address) -> None:
    with socket.create_connection(address) as conn:
        conn.sendall(request(b'{"a": 1}')[:-3])  # the head, and part of the body
        data, _ = closed_after(conn)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    error = json.loads(body)["error"]
    assert "paused" in error["message"] and error["type"] == "invalid_request_error"


def test_serve_wires_both_timeouts() -> None:
    config = ServerConfig(
        EngineConfig(model=str(TINY), dtype="float32", num_kv_blocks=16, max_model_len=64),
        head_timeout=7.0,
        body_timeout=9.0,
    )
    app = build_app(config)
    timeouts = [m.kwargs["timeout"] for m in app.user_middleware if m.cls is BodyTimeout]
    assert timeouts == [9.0]
    http = DrainingServer(app, config).config.http
    assert http.func is HeadTimeoutProtocol and http.keywords == {"head_timeout": 7.0}
