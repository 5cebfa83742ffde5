"""The exact request bodies lm-eval-harness, langchain-openai and LiteLLM send,
recorded by `make clients` (tests/server/clients/, which runs the clients
themselves) in tests/server/client_requests/, replayed against the server on
every `make test`: a change that would refuse or break one of them fails here
without installing the clients."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import auth

RECORDS = Path(__file__).parent / "client_requests"
CLIENTS = ["lm_eval", "langchain", "litellm"]


def recorded(client: str) -> list[dict]:
    lines = (RECORDS / f"{client}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, headers=auth(), timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        data = [ln.removeprefix("data: ") for ln in reply.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def prompts_of(body: dict) -> list:
    """A completion's prompts: a string or one id list is one prompt."""
    prompt = body["prompt"]
    return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt


def check(path: str, body: dict, reply: dict) -> None:
    """What each client reads of the reply is there."""
    assert "error" not in reply, reply
    if path == "/tokenize":
        assert reply["count"] == len(reply["tokens"]) > 0
        return
    choices = reply["choices"]
    prompts = prompts_of(body) if path == "/v1/completions" else [body["messages"]]
    assert len(choices) == len(prompts) * body.get("n", 1)
    if body.get("echo") and body.get("logprobs") is not None:  # lm-eval's scoring
        for choice, prompt in zip(choices, prompts):
            lp = choice["logprobs"]
            assert lp["token_logprobs"][0] is None
            assert len(lp["token_logprobs"]) == len(prompt) + body["max_tokens"]
    if body.get("tool_choice") not in (None, "none"):
        assert choices[0]["message"]["tool_calls"] or choices[0]["finish_reason"] == "length"


@pytest.mark.parametrize("client", CLIENTS)
def test_each_recorded_request_is_served(server, client) -> None:
    requests = recorded(client)
    assert requests, f"nothing recorded for {client}"
    for request in requests:
        path, body = request["path"], request["body"]
        if body.get("stream"):
            chunks = events(server.url, path, body)
            assert chunks and not [c for c in chunks if "error" in c]
            continue
        reply = httpx.post(server.url + path, json=body, headers=auth(), timeout=120)
        assert reply.status_code == 200, (path, body, reply.text)
        check(path, body, reply.json())
