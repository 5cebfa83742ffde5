"""Many clients at once: every stream completes with exactly the tokens the
offline API gives on the same seeds, the server's memory stays bounded, and a
client that hangs up mid-stream has its request aborted and its blocks freed."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import torch

from engine import LLM, SamplingParams
from tests.conftest import ARTIFACTS
from tests.server.conftest import SERVE_ARGS, TINY, auth, metric

CLIENTS = 200
TOPICS = ["block", "step", "request", "scheduler", "cache", "token", "kernel", "sampler"]
RSS_GROWTH_LIMIT = 256 * 1024 * 1024  # what 200 streams may add to the server's peak memory


def workload() -> list[tuple[str, SamplingParams]]:
    """Prompts of several lengths; seeded sampling, with several output lengths."""
    jobs = []
    for i in range(CLIENTS):
        topic = TOPICS[i % len(TOPICS)]
        prompt = f"Q: What does the {topic} do in step {i}?" + " Explain." * (i % 5) + "\nA:"
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, max_tokens=4 + i % 9)
        jobs.append((prompt, params))
    return jobs


async def stream(client: httpx.AsyncClient, url: str, prompt: str, p: SamplingParams) -> dict:
    body = {
        "model": "deepinfer-tiny",
        "prompt": prompt,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "seed": p.seed,
        "max_tokens": p.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage, done, reason = "", None, False, None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=auth()) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                text += choice["text"]
                reason = choice.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
    return {"text": text, "tokens": usage["completion_tokens"], "done": done, "reason": reason}


async def all_at_once(url: str, jobs: list[tuple[str, SamplingParams]]) -> list[dict]:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(stream(client, url, p, sp) for p, sp in jobs))


def test_concurrent_streams_match_offline_generate(server) -> None:
    jobs = workload()
    rss_before = server.rss_bytes()
    peak_before = server.rss_bytes("VmHWM")
    results = asyncio.run(all_at_once(server.url, jobs))
    peak_after = server.rss_bytes("VmHWM")

    # The offline API, with the server's engine settings, on the same seeds; on
    # one thread, as the server runs, so that the two cores are not oversubscribed.
    blocks, max_len = (int(SERVE_ARGS[i + 1]) for i in (0, 2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(TINY, dtype="float32", num_kv_blocks=blocks, max_model_len=max_len)
        offline = llm.generate([p for p, _ in jobs], [sp for _, sp in jobs], use_tqdm=False)
    finally:
        torch.set_num_threads(threads)

    assert all(r["done"] for r in results), "every stream ends with [DONE]"
    mismatched = [
        i
        for i, (r, o) in enumerate(zip(results, offline))
        if (r["text"], r["tokens"]) != (o.text, len(o.token_ids))
    ]
    assert not mismatched, f"{len(mismatched)} of {CLIENTS} differ from LLM.generate"
    assert [r["reason"] for r in results] == [o.finish_reason for o in offline]

    growth = peak_after - peak_before
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "server-rss.json").write_text(
        json.dumps(
            {
                "clients": CLIENTS,
                "rss_before_mib": round(rss_before / 2**20, 1),
                "peak_before_mib": round(peak_before / 2**20, 1),
                "peak_after_mib": round(peak_after / 2**20, 1),
                "peak_growth_mib": round(growth / 2**20, 1),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"server RSS {rss_before / 2**20:.0f} MiB; peak {peak_after / 2**20:.0f} MiB")
    assert growth < RSS_GROWTH_LIMIT, f"{CLIENTS} streams grew the peak RSS by {growth / 2**20} MiB"


def wait_for(condition, interval: float = 0.05, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return False


def test_a_client_that_hangs_up_mid_stream_frees_its_blocks(server) -> None:
    url, max_tokens = server.url, 120
    body = {
        "model": "deepinfer-tiny",
        "prompt": "The block manager",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    aborted = metric(url, "deepinfer:request_aborted_total")
    finished = metric(url, "deepinfer:request_success_total")
    generated = metric(url, "deepinfer:generation_tokens_total")
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", url + "/v1/completions", json=body, headers=auth()) as r,
    ):
        lines = r.iter_lines()
        for _ in range(3):  # a few tokens in
            while not next(lines).startswith("data: "):
                pass
        assert metric(url, "deepinfer:num_requests_running") == 1
        assert metric(url, "deepinfer:kv_cache_usage_perc") > 0
    # leaving the block closes the connection: the client hung up
    assert wait_for(lambda: metric(url, "deepinfer:kv_cache_usage_perc") == 0)
    assert metric(url, "deepinfer:request_aborted_total") == aborted + 1
    assert metric(url, "deepinfer:num_requests_running") == 0
    assert metric(url, "deepinfer:request_success_total") == finished  # it never finished
    assert metric(url, "deepinfer:generation_tokens_total") - generated < max_tokens


def test_a_client_that_gives_up_on_a_whole_response_aborts_it(server) -> None:
    """Without streaming too: the handler notices the hang-up and aborts. The
    client hangs up once the server reports the request running, not after a
    fixed time, which a fast machine could outrun by finishing the request."""
    url = server.url
    body = json.dumps({"model": "deepinfer-tiny", "prompt": "The block manager",
                       "max_tokens": 120, "ignore_eos": True}).encode()  # fmt: skip
    aborted = metric(url, "deepinfer:request_aborted_total")
    finished = metric(url, "deepinfer:request_success_total")
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: {auth()['Authorization']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        running = wait_for(lambda: metric(url, "deepinfer:num_requests_running") == 1, 0.01)
        assert running, "the request was never seen running"
    # leaving the block closed the socket before any response came back
    assert wait_for(lambda: metric(url, "deepinfer:request_aborted_total") == aborted + 1)
    assert wait_for(lambda: metric(url, "deepinfer:kv_cache_usage_perc") == 0)
    assert metric(url, "deepinfer:request_success_total") == finished
