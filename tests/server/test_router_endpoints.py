"""Both routers pass on every endpoint a client of the worker uses: `deepinfer
router` and the PD router answer /v1/responses, vLLM's /tokenize, /detokenize
and /tokenizer_info, and /v1/models/{id} as the worker behind them does."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import TINY, running

WORKER_ARGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--no-compile-decode")
MODEL = "deepinfer-tiny"
POSTS = [
    ("/tokenize", {"model": MODEL, "prompt": "What is a block?"}),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2, 3]}),
    (
        "/v1/responses",
        {"model": MODEL, "input": "What is a block?", "max_output_tokens": 6, "temperature": 0},
    ),
]
GETS = ["/tokenizer_info", f"/v1/models/{MODEL}"]


def same_answers(worker: str, router: str, gets: list[str]) -> None:
    for path, body in POSTS:
        direct = httpx.post(worker + path, json=body, timeout=60)
        routed = httpx.post(router + path, json=body, timeout=60)
        assert routed.status_code == direct.status_code == 200, (path, routed.text)
        assert strip(routed.json()) == strip(direct.json()), path
    streamed = {**POSTS[-1][1], "stream": True}
    with httpx.stream("POST", router + "/v1/responses", json=streamed, timeout=60) as reply:
        assert reply.status_code == 200
        events = [ln for ln in reply.iter_lines() if ln.startswith("event: ")]
    assert events[0] == "event: response.created" and events[-1].startswith("event: response.")
    for path in gets:
        direct, routed = httpx.get(worker + path, timeout=60), httpx.get(router + path, timeout=60)
        assert routed.status_code == 200 and strip(routed.json()) == strip(direct.json()), path


def strip(reply: dict) -> dict:
    """A reply without what differs between two requests: ids and times."""
    drop = {"id", "created_at", "created"}
    out = {k: v for k, v in reply.items() if k not in drop}
    if "output" in out:
        out["output"] = [{k: v for k, v in o.items() if k != "id"} for o in out["output"]]
    return out


@pytest.mark.parametrize("policy", [("--policy", "round-robin"), ("--model", str(TINY))])
def test_the_router_forwards_every_endpoint(policy) -> None:
    with running(("serve", str(TINY), *WORKER_ARGS)) as (worker,):
        args = ("--worker", worker.url, *policy, "--health-interval", "600")
        with running(("router", *args)) as (router,):
            same_answers(worker.url, router.url, GETS)
