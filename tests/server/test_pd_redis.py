"""Prefill/decode disaggregation with Redis as the store (Chapter 8): the same
text as one worker, for 32 prompts four ways (whole and streamed, greedy and
seeded), through a prefill and two decode workers that share a Redis server;
and when Redis stops mid-run, the workers recompute and keep serving, with the
same text, and count what the store could not give. Redis is started
by the test from Debian's redis-server, on a free loopback port."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.conftest import TINY, metric, running
from tests.server.test_pd import WORKER_ARGS, prompts, text

pytestmark = pytest.mark.timeout(300)


def test_pd_over_redis_and_without_it(redis_server) -> None:
    store = ("--kv-store", redis_server.url)
    decoding = (*WORKER_ARGS, *store, "--role", "decode")
    with running(
        ("serve", str(TINY), *WORKER_ARGS),
        ("serve", str(TINY), *WORKER_ARGS, *store, "--role", "prefill"),
        ("serve", str(TINY), *decoding),
        ("serve", str(TINY), *decoding),
    ) as (plain, prefill, *decode):
        urls = ("--prefill", prefill.url, *(a for d in decode for a in ("--decode", d.url)))
        with running(("router", *urls, "--model", str(TINY))) as (router,):
            for i, (stream, seed) in enumerate(WAYS):  # 32 prompts, each of four ways
                batch = prompts(32, seed=40 + i)
                want = ask_all(plain.url, batch, stream, seed)
                assert ask_all(router.url, batch, stream, seed) == want, f"{stream=}, {seed=}"
            handed = sum(metric(d.url, HANDED) for d in decode)
            assert handed > 0
            redis_server.stop()
            later = prompts(6, seed=32)
            want = [text(plain.url, p, False, None) for p in later]
            assert [text(router.url, p, False, None) for p in later] == want
            assert sum(metric(d.url, HANDED) for d in decode) == handed


def ask_all(url: str, batch: list[str], stream: bool, seed: int | None) -> list[str]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: text(url, p, stream, seed), batch))


HANDED = "deepinfer:kv_store_handoff_tokens_total"
WAYS = [(False, None), (True, None), (False, 5), (True, 5)]
