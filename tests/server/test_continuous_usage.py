"""vLLM's stream_options.continuous_usage_stats, which AIPerf's
--use-server-token-count reads: with include_usage, every chunk carries the
request's usage so far, its completion_tokens the tokens streamed until then."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import auth

OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def chunks(url: str, path: str, body: dict) -> list[dict]:
    body = {"model": "deepinfer-tiny", "stream": True, "temperature": 0, **body}
    with httpx.stream("POST", url + path, json=body, headers=auth(), timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        return [
            json.loads(line.removeprefix("data: "))
            for line in reply.iter_lines()
            if line.startswith("data: {")
        ]


def tokens_in(chunk: dict) -> int:
    """The generated tokens a chunk carries, counted from its logprobs."""
    total = 0
    for c in chunk["choices"]:
        lp = c.get("logprobs") or {}
        total += len(lp.get("tokens") or lp.get("content") or [])
    return total


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "def schedule(self", "max_tokens": 7, "logprobs": 0}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "What is a block?"}],
                "max_tokens": 7,
                "logprobs": True,
            },
        ),
    ],
    ids=["completions", "chat"],
)
def test_every_chunk_carries_the_usage_so_far(server, path, body) -> None:
    got = chunks(server.url, path, {**body, "stream_options": OPTIONS})
    seen, prompt = 0, got[-1]["usage"]["prompt_tokens"]
    for chunk in got:
        usage = chunk["usage"]
        seen += tokens_in(chunk)
        assert usage["prompt_tokens"] == prompt
        assert usage["completion_tokens"] == seen
        assert usage["total_tokens"] == prompt + seen
    assert got[-1]["choices"] == [] and seen == 7
    # Without the option, only the last chunk has usage, as before.
    plain = chunks(server.url, path, {**body, "stream_options": {"include_usage": True}})
    assert [c["usage"] is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_continuous_usage_without_include_usage_is_refused(server) -> None:
    body = {
        "model": "deepinfer-tiny",
        "prompt": "a",
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    reply = httpx.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=60)
    assert reply.status_code == 400
    assert "continuous_usage_stats" in reply.json()["error"]["message"]
