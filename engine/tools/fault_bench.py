"""`python -m engine.tools.fault_bench`: the server and router under the faults a
real deployment meets, counted. Three scenarios, each on fresh processes:

  big-prompts  three prompts of about 3.9 MB (under the body limit, far over the
               context) while four streams run: how long /health takes, on the
               worker and through the router, and the longest pause in a stream.
  stall        two workers behind the router, one frozen with SIGSTOP: of N
               requests, how many succeed, fail with an error, or hang past the
               client's timeout.
  kill         two workers behind the router, one SIGKILLed under streaming load:
               how many streams end with [DONE], end with an error event, or are
               cut with neither.

Figures are wall-clock and vary with the machine; the counts are what to compare
before and after a change.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import time
from collections import Counter
from collections.abc import Iterator

import httpx

from engine.tools.launch import launched_process

WORKER = ("--no-compile-decode", "--dtype", "float32")


@contextlib.contextmanager
def cluster(model: str, workers: int, policy: str = "round-robin") -> Iterator[tuple]:
    """`workers` servers and a router over them: (router URL, [(url, proc)])."""
    with contextlib.ExitStack() as stack:
        started = [
            stack.enter_context(launched_process("serve", model, *WORKER)) for _ in range(workers)
        ]
        flags = [a for url, _ in started for a in ("--worker", url)]
        router, _ = stack.enter_context(
            launched_process("router", *flags, "--policy", policy, "--model", model)
        )
        yield router, started


async def _probe(client: httpx.AsyncClient, url: str, until: float) -> list[float]:
    """GET /health every 20 ms until ``until``: each answer's latency in seconds."""
    latencies = []
    while time.perf_counter() < until:
        start = time.perf_counter()
        with contextlib.suppress(httpx.HTTPError):
            await client.get(url + "/health", timeout=60)
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.02)
    return latencies


async def _stream_gaps(client: httpx.AsyncClient, url: str, model: str) -> float:
    """The longest pause, in seconds, between one stream's events."""
    body = dict(model=model, prompt="Once upon a time", max_tokens=400, ignore_eos=True)
    last, gap = time.perf_counter(), 0.0
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        async for _ in r.aiter_lines():
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
    return gap


async def big_prompts(model: str, mb: float) -> dict:
    prompt = ("lorem ipsum dolor sit amet " * int(mb * 1e6 / 27))[: int(mb * 1e6)]
    with cluster(model, 1, policy="prefix") as (router, [(worker, _)]):
        async with httpx.AsyncClient(timeout=120) as client:
            for url in (worker, router):  # warm up
                await client.post(
                    url + "/v1/completions",
                    json=dict(model=model_name(model), prompt="hi", max_tokens=2),
                )
            until = time.perf_counter() + 8
            name = model_name(model)
            big = [
                client.post(
                    url + "/v1/completions", json=dict(model=name, prompt=prompt, max_tokens=4)
                )
                for url in (worker, router, worker)
            ]
            probes = [_probe(client, worker, until), _probe(client, router, until)]
            streams = [_stream_gaps(client, worker, name) for _ in range(4)]
            results = await asyncio.gather(*probes, *big, *streams)
    worker_lat, router_lat = results[0], results[1]
    statuses = Counter(r.status_code for r in results[2:5])
    return {
        "big-prompt statuses": dict(statuses),
        "worker /health max ms": round(max(worker_lat) * 1e3, 1),
        "worker /health p50 ms": round(statistics.median(worker_lat) * 1e3, 1),
        "router /health max ms": round(max(router_lat) * 1e3, 1),
        "router /health p50 ms": round(statistics.median(router_lat) * 1e3, 1),
        "longest stream pause ms": round(max(results[5:]) * 1e3, 1),
    }


def model_name(model: str) -> str:
    return os.path.basename(model.rstrip("/"))


async def _timed_request(client: httpx.AsyncClient, url: str, body: dict, timeout: float) -> str:
    try:
        reply = await client.post(url + "/v1/completions", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError:
        return "failed"
    return "ok" if reply.status_code == 200 else f"http {reply.status_code}"


async def stall(model: str, requests: int, client_timeout: float) -> dict:
    with cluster(model, 2) as (router, [(_, frozen), _]):
        body = dict(model=model_name(model), prompt="The engine", max_tokens=8)
        async with httpx.AsyncClient() as client:
            await _timed_request(client, router, body, client_timeout)
            os.kill(frozen.pid, signal.SIGSTOP)
            try:
                gate = asyncio.Semaphore(10)

                async def one() -> str:
                    async with gate:
                        return await _timed_request(client, router, body, client_timeout)

                start = time.perf_counter()
                outcomes = Counter(await asyncio.gather(*(one() for _ in range(requests))))
                seconds = time.perf_counter() - start
            finally:
                os.kill(frozen.pid, signal.SIGCONT)
    return {"outcomes": dict(outcomes), "seconds": round(seconds, 1)}


async def _stream_outcome(client: httpx.AsyncClient, url: str, body: dict) -> str:
    """How one stream ended: done, error (an error event), cut, or http N."""
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                return f"http {r.status_code}"
            error = done = False
            async for line in r.aiter_lines():
                done |= line == "data: [DONE]"
                error |= line.startswith("data: ") and '"error"' in line
            return "error event" if error else "done" if done else "cut"
    except httpx.HTTPError:
        return "cut"


async def kill(model: str, requests: int) -> dict:
    with cluster(model, 2) as (router, [(_, victim), _]):
        body = dict(
            model=model_name(model), prompt="A story:", max_tokens=64, ignore_eos=True, stream=True
        )
        async with httpx.AsyncClient() as client:
            gate = asyncio.Semaphore(20)
            finished = 0

            async def one() -> str:
                nonlocal finished
                async with gate:
                    outcome = await _stream_outcome(client, router, body)
                finished += 1
                return outcome

            async def killer() -> None:
                while finished < requests // 5:
                    await asyncio.sleep(0.05)
                victim.send_signal(signal.SIGKILL)

            *outcomes, _ = await asyncio.gather(*(one() for _ in range(requests)), killer())
    return {"outcomes": dict(Counter(outcomes))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="snippets/models/deepinfer-tiny")
    parser.add_argument(
        "--scenario", choices=["big-prompts", "stall", "kill", "all"], default="all"
    )
    parser.add_argument("--mb", type=float, default=3.9, help="size of each big prompt")
    parser.add_argument("--requests", type=int, default=60, help="for stall; kill sends 150")
    parser.add_argument("--client-timeout", type=float, default=30.0)
    args = parser.parse_args()
    chosen = ["big-prompts", "stall", "kill"] if args.scenario == "all" else [args.scenario]
    for scenario in chosen:
        if scenario == "big-prompts":
            result = asyncio.run(big_prompts(args.model, args.mb))
        elif scenario == "stall":
            result = asyncio.run(stall(args.model, args.requests, args.client_timeout))
        else:
            result = asyncio.run(kill(args.model, 150))
        print(scenario, json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
