"""`deepinfer router` in front of two `deepinfer serve` workers on deepinfer-tiny:
prefix affinity finds more of a shared-system-prompt workload in the workers'
prefix caches than round-robin does, and when a worker dies, new requests go
to the other and none is lost."""

from __future__ import annotations

import json
import random
from collections import Counter

import httpx
import pytest

from tests.conftest import ARTIFACTS
from tests.server.conftest import TINY, metric, running

# Routing does not depend on how a worker runs its steps: no compile at start-up.
WORKER_ARGS = ("--dtype", "float32", "--num-kv-blocks", "1024", "--no-compile-decode")
QUESTIONS = [
    "What is a block?",
    "Who frees blocks?",
    "What is a step?",
    "When is a request preempted?",
    "What does the scheduler decide?",
    "Where do keys and values live?",
    "Why share a prefix?",
    "How long is a block?",
]


def system_prompts(variant: str) -> list[str]:
    """Four system prompts, each longer than the four blocks the router hashes."""
    subjects = ["the scheduler", "the block manager", "the model runner", "the sampler"]
    return [
        f"[{variant}] You answer questions about {s} of DeepInfer, a small inference engine, "
        f"in one short sentence. Be exact, cite the code, and never guess about {s}; say "
        f"what {s} owns, what it decides, and what it leaves to the other parts.\n"
        for s in subjects
    ]


def workload(variant: str) -> list[dict]:
    """Every question after every system prompt, in a shuffled (seeded) order, as
    requests arrive: in a fixed rotation, round-robin could land on affinity by luck."""
    bodies = [
        {
            "model": "deepinfer-tiny",
            "messages": [{"role": "system", "content": sp}, {"role": "user", "content": q}],
            "max_tokens": 1,
            "temperature": 0,
        }
        for q in QUESTIONS
        for sp in system_prompts(variant)
    ]
    random.Random(0).shuffle(bodies)
    return bodies


def hit_rate(workers: list, run) -> tuple[float, list[str]]:
    """Prompt tokens found cached, as a share of those looked up, across the workers."""
    names = ("deepinfer:prefix_cache_hits_total", "deepinfer:prefix_cache_queries_total")
    before = [sum(metric(w.url, n) for w in workers) for n in names]
    served = run()
    hits, queries = (sum(metric(w.url, n) for w in workers) - b for n, b in zip(names, before))
    return hits / queries, served


def send(url: str, bodies: list[dict]) -> list[str]:
    """One at a time, as a stream, so that each request meets the caches the
    ones before it left; returns the worker that served each."""
    served = []
    for body in bodies:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as r:  # fmt: skip
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            served.append(r.headers["x-deepinfer-worker"])
    return served


@pytest.fixture(scope="module")
def cluster():
    """Two workers; a round-robin router with quick health checks, and a prefix
    router whose health checks are too slow to notice a death by themselves."""
    with running(("serve", str(TINY), *WORKER_ARGS), ("serve", str(TINY), *WORKER_ARGS)) as ws:
        urls = [a for w in ws for a in ("--worker", w.url)]
        with running(
            ("router", *urls, "--policy", "round-robin", "--health-interval", "0.5"),
            ("router", *urls, "--model", str(TINY), "--health-interval", "600"),
        ) as (rr, prefix):
            yield ws, rr, prefix


def test_prefix_affinity_beats_round_robin_and_survives_a_dead_worker(cluster) -> None:
    workers, rr, prefix = cluster
    rr_rate, rr_served = hit_rate(workers, lambda: send(rr.url, workload("a")))
    bodies = workload("b")  # other system prompts: the caches hold none of them yet
    prefix_rate, served = hit_rate(workers, lambda: send(prefix.url, bodies))
    ARTIFACTS.mkdir(exist_ok=True)
    report = {"requests": len(bodies), "round_robin": rr_rate, "prefix_affinity": prefix_rate}
    (ARTIFACTS / "router-hit-rates.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"prefix-cache hit rate: round-robin {rr_rate:.1%}, prefix affinity {prefix_rate:.1%}")
    assert len(set(rr_served)) == 2  # round-robin used both
    assert prefix_rate > rr_rate
    # Each system prompt went to one worker under affinity.
    per_prompt = Counter((b["messages"][0]["content"], w) for b, w in zip(bodies, served))
    assert len(per_prompt) == len(system_prompts("b"))

    # Kill the worker that owns some prompts; send those again.
    dead = max(workers, key=lambda w: served.count(w.url))
    alive = workers[1] if dead is workers[0] else workers[0]
    dead.kill()
    orphans = [b for b, w in zip(bodies, served) if w == dead.url]
    retries = metric(prefix.url, "deepinfer_router:retries_total")
    assert send(prefix.url, orphans) == [alive.url] * len(orphans)  # none lost
    assert metric(prefix.url, "deepinfer_router:retries_total") == retries + 1  # once, then down
    assert metric(prefix.url, 'deepinfer_router:worker_up{worker="' + dead.url + '"}') == 0
    # The round-robin router's health checks find the death on their own.
    assert send(rr.url, orphans[:4]) == [alive.url] * 4
    up = metric(rr.url, 'deepinfer_router:worker_up{worker="' + dead.url + '"}')
    assert up == 0


def test_the_router_refuses_a_body_over_its_limit(cluster) -> None:
    """It reads a body whole to hash its prompt, so it bounds it as the workers do."""
    _, rr, prefix = cluster
    big = b'{"model": "deepinfer-tiny", "prompt": "' + b"x" * (5 * 2**20) + b'"}'
    for router in (rr, prefix):
        reply = httpx.post(router.url + "/v1/completions", content=big, timeout=30,
                           headers={"content-type": "application/json"})  # fmt: skip
        assert reply.status_code == 413, reply.text
        assert "larger than" in reply.json()["error"]["message"]
