"""The router under the faults of real processes: a worker frozen with SIGSTOP
is left, before its reply begins, for the other, whether the health check or
the first-byte timeout finds it; a stream whose worker freezes or is SIGKILLed
partway ends with an OpenAI error event, which the official client raises,
instead of a silent cut. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.server.conftest import TINY, metric, running

WORKER_ARGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--no-compile-decode")
MODEL = "deepinfer-tiny"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    """Two workers; a router with quick health checks, and one whose health checks
    are too slow to matter, with short first-byte and idle timeouts."""
    with running(("serve", str(TINY), *WORKER_ARGS), ("serve", str(TINY), *WORKER_ARGS)) as ws:
        urls = [a for w in ws for a in ("--worker", w.url)]
        quick = ("--policy", "round-robin", "--health-interval", "0.5")
        slow = ("--policy", "round-robin", "--health-interval", "600")
        timeouts = ("--first-byte-timeout", "1.5", "--idle-timeout", "1.5")
        with running(("router", *urls, *quick), ("router", *urls, *slow, *timeouts)) as routers:
            yield ws, *routers
        for w in ws:
            if w.proc.poll() is None:
                os.kill(w.proc.pid, signal.SIGCONT)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=30, max_retries=0)


def complete(url: str, n: int) -> list[str]:
    """n requests at once, each answered: the workers that served them."""

    def one(i: int) -> str:
        raw = client(url).completions.with_raw_response.create(
            model=MODEL, prompt=f"Request {i}:", max_tokens=4
        )
        assert raw.parse().choices[0].finish_reason == "length"
        return raw.headers["x-deepinfer-worker"]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def up(router_url: str, worker_url: str) -> float:
    return metric(router_url, f'deepinfer_router:worker_up{{worker="{worker_url}"}}')


def test_a_frozen_worker_is_left_and_comes_back(cluster) -> None:
    (frozen, alive), quick, _ = cluster
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        served = complete(quick.url, 8)  # before the fix: those sent to it hung
        assert set(served) == {alive.url}
        assert time.monotonic() - start < 25
        assert up(quick.url, frozen.url) == 0
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while up(quick.url, frozen.url) != 1:
        assert time.monotonic() < deadline, "the thawed worker was not brought back"
        time.sleep(0.2)
    assert set(complete(quick.url, 4)) == {frozen.url, alive.url}


def test_the_first_byte_timeout_moves_a_request_off_a_stalled_worker(cluster) -> None:
    """With no health check in time, the timeout alone finds the stall."""
    (frozen, alive), _, slow = cluster
    stalls = metric(slow.url, "deepinfer_router:stalls_total")
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        assert set(complete(slow.url, 4)) == {alive.url}
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    assert metric(slow.url, "deepinfer_router:stalls_total") >= stalls + 1
    assert up(slow.url, frozen.url) == 0  # until its next health check, 600 s away


def _stream_then(url: str, fault) -> tuple[int, str]:
    """Stream a long completion, apply ``fault`` to its worker after a few events,
    and read on: (events read, the error the client raised)."""
    stream = client(url).completions.create(
        model=MODEL,
        prompt="A long story:",
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    worker = stream.response.headers["x-deepinfer-worker"]
    events = 0
    with pytest.raises(openai.APIError) as raised:
        for _ in stream:
            events += 1
            if events == 3:
                fault(worker)
    return events, str(raised.value)


def test_a_stream_whose_worker_freezes_ends_with_an_error_event(cluster) -> None:
    workers, _, slow = cluster
    by_url = {w.url: w for w in workers}
    frozen = []

    def freeze(url: str) -> None:
        frozen.append(by_url[url])
        os.kill(by_url[url].proc.pid, signal.SIGSTOP)

    try:
        events, error = _stream_then(slow.url, freeze)
    finally:
        for w in frozen:
            os.kill(w.proc.pid, signal.SIGCONT)
    assert events >= 3 and "sent nothing for 1.5 s" in error, error


def test_a_stream_whose_worker_dies_ends_with_an_error_event(cluster) -> None:
    """Last: it kills a worker."""
    workers, quick, _ = cluster
    by_url = {w.url: w for w in workers}
    broken = metric(quick.url, "deepinfer_router:broken_replies_total")
    events, error = _stream_then(quick.url, lambda url: by_url[url].kill())
    assert events >= 3 and "the stream was cut" in error, error
    assert metric(quick.url, "deepinfer_router:broken_replies_total") == broken + 1
    survivor = next(w for w in workers if w.proc.poll() is None)
    assert set(complete(quick.url, 4)) == {survivor.url}  # and the next requests are served
