"""The `redis_server` fixture: a redis-server of the test's own on a free
loopback port (engine/tools/redis_server.py), stopped at teardown whatever
happens. A test may stop and start it again (same port) to play a Redis that
dies mid-run. Where redis-server is missing the test fails, saying how to get
it: a store test that skipped would pass on every machine that never ran it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from engine.tools.redis_server import MISSING, RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail(MISSING)
    with RedisServer() as server:
        yield server
