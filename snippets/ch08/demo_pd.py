"""Demo: prefill/decode disaggregation, as real processes on loopback. One
prefill worker and two decode workers share a directory store behind the PD
router; a plain worker answers the same requests alone.

1. The official client asks both, greedy and seeded, streamed and not (four
   ways): the texts must match, and the decode workers' /metrics say how many
   prompt tokens came through the store during each way.
2. A prefix one decode worker computed is a store hit on the other.
3. Six seeded streams run; once the first decode worker holds one, it is
   SIGKILLed. Every stream must still end whole, with one worker's text.

How many streams the router resumed depends on timing, so that count goes to
stderr, outside the record."""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from engine.tools.launch import launched, launched_process

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
NAME = os.path.basename(MODEL)
WORKER = ("--dtype", "float32", "--no-compile-decode")
WORDS = ["the", "cache", "block", "store", "prefill", "decode", "token", "router", "worker"]
LONG = 96  # tokens per stream in part 3: still running when the worker dies


def prompts(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 60))) for _ in range(n)]


def counter(url: str, name: str) -> int:
    """A series from a server's /metrics, summed over its labels, as an integer."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    found = [line for line in lines if line.startswith((name + " ", name + "{"))]
    if not found:
        raise KeyError(name)
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in found))


def text(url: str, prompt: str, stream: bool, seed: int | None, n: int = 16) -> str:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    kw = dict(temperature=0.0) if seed is None else dict(temperature=1.0, seed=seed)
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, stream=stream, **kw)
    if stream:
        return "".join(c.choices[0].text for c in reply if c.choices)
    return reply.choices[0].text


def same_texts(plain: str, router: str, decoders: list[str], batch: list[str]) -> dict:
    """Part 1: each prompt four ways, through the router and on one worker: for
    each way, whether the texts agree, and the prompt tokens the decode workers
    loaded from the store during it."""
    cases = {"whole, greedy": (False, None), "streamed, greedy": (True, None)}
    cases |= {"whole, seeded": (False, 7), "streamed, seeded": (True, 7)}
    ways = {}
    for how, c in cases.items():
        before = handed_on(decoders)
        same = [text(router, p, *c) for p in batch] == [text(plain, p, *c) for p in batch]
        ways[how] = (same, handed_on(decoders) - before)
    return ways


def handed_on(decoders: list[str]) -> int:
    return sum(counter(d, "deepinfer:kv_store_handoff_tokens_total") for d in decoders)


def store_hit(first: str, second: str) -> int:
    """Part 2: prompt tokens the second worker loads of a prefix the first computed."""
    system = " ".join(prompts(1)[0].split()[:40]) * 2
    saved = counter(first, "deepinfer:kv_store_saved_blocks_total")
    text(first, system + " first question", False, None)
    deadline = time.monotonic() + 60  # its blocks are saved beside its steps, after the reply
    while counter(first, "deepinfer:kv_store_saved_blocks_total") == saved:
        if time.monotonic() > deadline:
            raise RuntimeError("the first worker never saved the prefix")
        time.sleep(0.02)
    name = "deepinfer:kv_store_hit_tokens_total"
    before = counter(second, name)
    text(second, system + " second question", False, None)
    return counter(second, name) - before


def kill_mid_stream(plain: str, router: str, victim: str, pid: int, batch: list[str]) -> list[bool]:
    """Part 3: SIGKILL a decode worker once it holds a stream; each stream's text
    against one worker's."""
    want = [text(plain, p, True, 3, LONG) for p in batch]
    with ThreadPoolExecutor(len(batch)) as pool:
        futures = [pool.submit(text, router, p, True, 3, LONG) for p in batch]
        deadline = time.monotonic() + 60
        while counter(victim, "deepinfer:num_requests_running") < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("no stream reached the first decode worker")
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        return [f.result(timeout=120) == w for f, w in zip(futures, want)]


def main() -> dict:
    batch = prompts(6)
    with tempfile.TemporaryDirectory() as store:
        decoding = (*WORKER, "--kv-store", store, "--role", "decode", "--kv-store-load", "always")
        with (
            launched("serve", MODEL, *WORKER) as plain,
            launched("serve", MODEL, *WORKER, "--kv-store", store, "--role", "prefill") as pre,
            launched_process("serve", MODEL, *decoding) as (victim, proc),
            launched("serve", MODEL, *decoding) as other,
            launched("router", "--prefill", pre, "--decode", victim, "--decode", other) as router,
        ):
            ways = same_texts(plain, router, [victim, other], batch)
            handed = handed_on([victim, other])
            failed = sum(
                counter(d, "deepinfer:kv_store_failed_blocks_total") for d in (victim, other)
            )
            hit = store_hit(victim, other)
            whole = kill_mid_stream(plain, router, victim, proc.pid, batch)
            resumed = counter(router, "deepinfer_router:pd_resumed_total")
    print(f"Through the router: {len(batch)} prompts, four ways:")
    print(f"   {'way':<17} {'same text':<10} tokens loaded")
    for how, (ok, loaded) in ways.items():
        print(f"   {how:<17} {ok!s:<10} {loaded}")
    print(f"   blocks that failed their check: {failed}")
    print(f"A prefix on the other worker: {hit} tokens loaded")
    print(f"A worker killed under {len(whole)} streams:")
    print(f"   each ended with one worker's text: {all(whole)}")
    print(f"   the router resumed some: {resumed > 0}")
    print(f"(this run resumed {resumed} streams)", file=sys.stderr)
    loads = [loaded for _, loaded in ways.values()]
    return {
        "prompts": len(batch),
        "all_same": all(ok for ok, _ in ways.values()),
        "handoff_tokens": handed,
        "first_way_tokens": loads[0],
        "later_ways_tokens": sum(loads[1:]),
        "failed_blocks": failed,
        "second_tier_hit_tokens": hit,
        "streams_killed": len(whole),
        "all_whole": all(whole),
        "some_resumed": resumed > 0,
    }


if __name__ == "__main__":
    main()
