"""SIGTERM drains: the server stops taking requests at once, lets those in flight
run for --shutdown-timeout seconds, and then ends each one still running with
an answer (a 503, or an error event and [DONE] in a stream), never a silent
cut; then it exits cleanly."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import TINY, running

MODEL = "deepinfer-tiny"
SHUTDOWN_S = 1.0
# Requests far longer than the drain: deepinfer-tiny on a CPU makes a few hundred
# tokens a second, so 1000 take seconds.
LONG = 1000
ARGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "1024")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)


@pytest.mark.timeout(180)
def test_sigterm_finishes_short_requests_and_ends_long_ones_with_an_answer() -> None:
    args = (*ARGS, "--no-compile-decode", "--shutdown-timeout", str(SHUTDOWN_S))
    with running(("serve", str(TINY), *args)) as (server,):
        api = client(server.url)
        stream = api.completions.create(
            model=MODEL,
            prompt="Once",
            max_tokens=LONG,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # in flight
        outcomes: dict[str, object] = {}

        def call(name: str, max_tokens: int) -> None:
            try:
                reply = api.completions.create(
                    model=MODEL,
                    prompt="Twice",
                    max_tokens=max_tokens,
                    extra_body={"ignore_eos": True},
                )
                outcomes[name] = reply.choices[0].finish_reason
            except openai.APIStatusError as err:
                outcomes[name] = (err.status_code, err.message)

        threads = [
            threading.Thread(target=call, args=("long", LONG)),
            threading.Thread(target=call, args=("short", 8)),
        ]
        for t in threads:
            t.start()
        time.sleep(0.3)  # both are in the engine
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        with pytest.raises(openai.APIError) as raised:  # the stream ends with an error event
            for _ in stream:
                pass
        assert "shutting down" in str(raised.value)
        for t in threads:
            t.join(timeout=60)
        assert outcomes["short"] == "length"  # finished within the drain
        status, message = outcomes["long"]
        assert status == 503 and "shutting down" in message
        with pytest.raises(httpx.HTTPError):  # no new requests: it no longer listens
            httpx.get(server.url + "/health", timeout=5).raise_for_status()
        # uvicorn re-raises the signal once it has shut down cleanly, as servers do.
        assert server.proc.wait(timeout=60) == -signal.SIGTERM
        assert time.monotonic() - sent < SHUTDOWN_S + 30
        assert "Application shutdown complete" in server.log.read_text()
