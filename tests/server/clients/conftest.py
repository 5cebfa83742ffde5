"""Real clients, unchanged, against `deepinfer serve`: lm-eval-harness,
langchain-openai and LiteLLM (`make clients`, which installs them; not part of
`make test`, where tests/server/test_client_requests.py replays the request
bodies these tests record instead).

The server runs in this process (tests/server/conftest.py's in_thread), with a
middleware that keeps every request body a client sends; with
DEEPINFER_RECORD_CLIENTS=1 each client's bodies are written to
tests/server/client_requests/CLIENT.jsonl for the replay."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from tests.server.conftest import TINY, in_thread

# Collected only by `make clients`, which installs them and sets this.
if not os.environ.get("DEEPINFER_CLIENTS"):
    collect_ignore_glob = ["test_*.py"]

RECORDS = Path(__file__).parents[1] / "client_requests"
MODEL = "deepinfer-tiny"


ORACLE = {"X-Deepinfer-Oracle": "1"}  # the tests' own requests, not a client's


class Recorder:
    """ASGI middleware: each client POST's path and JSON body, in arrival order."""

    def __init__(self, app, seen: list[dict]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers", ()))
        oracle = headers.get(b"x-deepinfer-oracle") is not None
        if scope["type"] != "http" or scope["method"] != "POST" or oracle:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def keep():
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                self.seen.append({"path": scope["path"], "body": json.loads(b"".join(chunks))})
            return message

        return await self.app(scope, keep, send)


class Server:
    def __init__(self, url: str, seen: list[dict]) -> None:
        self.url, self.seen = url, seen

    def record(self, client: str) -> list[dict]:
        """What was sent since the last call, kept as CLIENT's recorded requests
        when DEEPINFER_RECORD_CLIENTS is set."""
        seen, self.seen[:] = list(self.seen), []
        if os.environ.get("DEEPINFER_RECORD_CLIENTS"):
            lines = [json.dumps(r, sort_keys=True) for r in seen]
            (RECORDS / f"{client}.jsonl").write_text("\n".join(lines) + "\n")
        return seen


@pytest.fixture(scope="package")
def server() -> Iterator[Server]:
    """deepinfer-tiny in float32 (the oracle's dtype) with --disable-any-whitespace,
    so that JSON under a grammar ends instead of running on in whitespace."""
    config = EngineConfig(
        model=str(TINY),
        dtype="float32",
        num_kv_blocks=512,
        max_model_len=512,
        disable_any_whitespace=True,
        seed=0,
    )
    app = build_app(ServerConfig(config))
    seen: list[dict] = []
    app.add_middleware(Recorder, seen=seen)
    with in_thread(app) as url:
        yield Server(url, seen)
