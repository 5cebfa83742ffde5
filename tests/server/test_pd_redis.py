"""Prefill/decode disaggregation with Redis as the store (Chapter 8): the same
text as one worker through a prefill and a decode worker that share a Redis
server; and when Redis stops mid-run, the workers recompute and keep serving,
with the same text, and count what the store could not give. Redis is started
by the test from Debian's redis-server, on a free loopback port."""

from __future__ import annotations

import pytest

from tests.server.conftest import TINY, metric, running
from tests.server.test_pd import WORKER_ARGS, prompts, text

pytestmark = pytest.mark.timeout(300)


def test_pd_over_redis_and_without_it(redis_server) -> None:
    store = ("--kv-store", redis_server.url)
    with running(
        ("serve", str(TINY), *WORKER_ARGS),
        ("serve", str(TINY), *WORKER_ARGS, *store, "--role", "prefill"),
        ("serve", str(TINY), *WORKER_ARGS, *store, "--role", "decode"),
    ) as (plain, prefill, decode):
        urls = ("--prefill", prefill.url, "--decode", decode.url)
        with running(("router", *urls, "--model", str(TINY))) as (router,):
            batch = prompts(6, seed=31)
            want = [text(plain.url, p, True, 5) for p in batch]
            assert [text(router.url, p, True, 5) for p in batch] == want
            handed = metric(decode.url, "deepinfer:kv_store_handoff_tokens_total")
            assert handed > 0
            redis_server.stop()
            later = prompts(6, seed=32)
            want = [text(plain.url, p, False, None) for p in later]
            assert [text(router.url, p, False, None) for p in later] == want
            assert metric(decode.url, "deepinfer:kv_store_handoff_tokens_total") == handed
