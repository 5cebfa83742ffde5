"""`python -m engine.tools.soak`: does a server's memory stay flat under load?

It starts `deepinfer serve MODEL` as a real process, drives it with the
official `openai` async client through a fixed mix of requests (completions and
chat, streamed and not, short and long prompts, n > 1, logprobs, structured
output with ``response_format`` json_object, and clients that hang up in the
middle of a stream), and reads the server's resident memory (VmRSS, from
/proc/PID/status, summed over the server and its engine core's process) every few requests. It
prints the curve (requests done, RSS MiB) and the ratio of the highest RSS
after the warm-up to the RSS at the warm-up: near 1.0 means flat.

    python -m engine.tools.soak --model snippets/models/deepinfer-tiny \\
        --requests 3000 --concurrency 16 --kv-cache-mib 88

A tool, not a test: it takes minutes. The regression test that can fail is
tests/server/test_no_leak.py, which counts the engine's per-request state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from openai import APIError, AsyncOpenAI

from engine.tools.launch import launched_process, tree_memory

WORDS = ("the", "cache", "holds", "keys", "and", "values", "of", "every", "token", "a")
WORDS += ("request", "scheduler", "decides", "which", "sequences", "run", "in", "each", "step")
KINDS = (
    "completion",
    "completion_stream",
    "chat",
    "chat_stream",
    "completion_n2",
    "completion_logprobs",
    "chat_logprobs",
    "json_object",
    "disconnect",
)

Args = argparse.Namespace  # what parse_args gives


@dataclass
class Server:
    url: str
    proc: subprocess.Popen

    def rss_mib(self) -> float:
        return rss_bytes(self.proc.pid) / 2**20


@dataclass
class Soak:
    """The run's tally: requests done, by outcome, and the RSS curve."""

    done: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    curve: list[tuple[int, float]] = field(default_factory=list)


def rss_bytes(pid: int) -> int:
    """The server's resident memory now, in bytes: its process and its engine
    core's, which runs in a child process."""
    return tree_memory(pid)


def kv_blocks_for(model: str, mib: float, dtype_bytes: int, block_size: int = 16) -> int:
    """How many KV blocks of a dense model's cache fit in ``mib`` MiB."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    per_block = 2 * config["num_hidden_layers"] * heads * head_dim * block_size * dtype_bytes
    return max(1, int(mib * 2**20 // per_block))


def prompt(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))


async def one_request(
    client: AsyncOpenAI, model: str, kind: str, rng: random.Random, a: Args
) -> None:
    """Send one request of ``kind`` and read its answer (or hang up, for "disconnect")."""
    max_tokens = rng.randint(1, a.max_tokens)
    common = dict(model=model, max_tokens=max_tokens, temperature=rng.choice([0.0, 0.8]))
    text = prompt(rng, a.max_prompt_words)
    messages = [{"role": "user", "content": text}]
    if kind == "completion":
        await client.completions.create(prompt=text, **common)
    elif kind == "completion_n2":
        await client.completions.create(prompt=text, n=2, **common)
    elif kind == "completion_logprobs":
        await client.completions.create(prompt=text, logprobs=3, **common)
    elif kind == "chat":
        await client.chat.completions.create(messages=messages, **common)
    elif kind == "chat_logprobs":
        await client.chat.completions.create(
            messages=messages, logprobs=True, top_logprobs=2, **common
        )
    elif kind == "json_object":
        await client.chat.completions.create(
            messages=messages, response_format={"type": "json_object"}, **common
        )
    elif kind == "disconnect":
        await hang_up(client, model, text, a.max_tokens)
    else:
        await read_stream(client, kind, text, messages, common)


async def read_stream(
    client: AsyncOpenAI, kind: str, text: str, messages: list, common: dict
) -> None:
    if kind == "completion_stream":
        stream = await client.completions.create(
            prompt=text, stream=True, stream_options={"include_usage": True}, **common
        )
    else:
        stream = await client.chat.completions.create(messages=messages, stream=True, **common)
    async for _ in stream:
        pass


async def hang_up(client: AsyncOpenAI, model: str, text: str, max_tokens: int) -> None:
    """Stream a long answer and close the connection after its first chunks."""
    stream = await client.completions.create(
        model=model, prompt=text, max_tokens=max(max_tokens, 32), stream=True
    )
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 2:
            break
    await stream.close()


async def drive(server: Server, model: str, a: Args, soak: Soak) -> None:
    """``a.concurrency`` clients, each sending its next request when the last ends,
    until ``a.requests`` are done; the RSS is read every ``a.sample_every``."""
    rng = random.Random(a.seed)
    plan = [rng.choice(KINDS) for _ in range(a.requests)]
    seeds = [rng.getrandbits(32) for _ in range(a.requests)]
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="soak", max_retries=0, timeout=120)
    soak.curve.append((0, server.rss_mib()))
    next_index = iter(range(a.requests))

    async def worker() -> None:
        for i in next_index:
            try:
                await one_request(client, model, plan[i], random.Random(seeds[i]), a)
            except APIError as err:  # counted and shown; the soak goes on
                key = f"{plan[i]}: {type(err).__name__}"
                soak.errors[key] = soak.errors.get(key, 0) + 1
            soak.done += 1
            if soak.done % a.sample_every == 0:
                soak.curve.append((soak.done, server.rss_mib()))

    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    await client.close()


def report(soak: Soak, warmup: int, seconds: float) -> str:
    lines = [f"{soak.done} requests in {seconds:.0f} s", "", f"{'requests':>9}  {'RSS MiB':>8}"]
    lines += [f"{n:>9}  {mib:>8.1f}" for n, mib in soak.curve]
    after = [(n, mib) for n, mib in soak.curve if n >= warmup]
    if after:
        (n0, base), peak = after[0], max(mib for _, mib in after)
        lines += ["", f"RSS at warm-up ({n0} requests): {base:.1f} MiB"]
        lines += [f"max after warm-up / at warm-up: {peak / base:.3f}"]
    if soak.errors:
        lines += ["", "errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(soak.errors.items()))]
    return "\n".join(lines)


def server_argv(a: Args) -> list[str]:
    argv = ["serve", a.model, "--seed", str(a.seed)]
    if a.kv_cache_mib:
        dtype_bytes = 4 if a.dtype == "float32" else 2
        argv += ["--num-kv-blocks", str(kv_blocks_for(a.model, a.kv_cache_mib, dtype_bytes))]
    if a.dtype:
        argv += ["--dtype", a.dtype]
    return argv + a.server_arg


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m engine.tools.soak", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample-every", type=int, default=100, help="requests between RSS reads")
    p.add_argument("--warmup", type=int, default=500, help="requests before the baseline")
    p.add_argument(
        "--kv-cache-mib",
        type=float,
        default=88.0,
        help="the KV cache, as --num-kv-blocks of a dense model's cache (2-byte values unless "
        "--dtype float32); 0: the server's default",
    )
    p.add_argument("--dtype", default=None, help="the server's --dtype (default: its own)")
    p.add_argument("--max-tokens", type=int, default=16, help="each request's at most")
    p.add_argument("--max-prompt-words", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="passed to deepinfer serve")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    root = str(Path(__file__).resolve().parents[2])  # this checkout's engine, not another
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}
    env.update(kv.split("=", 1) for kv in a.env)
    with launched_process(*server_argv(a), env=env) as (url, proc):
        server = Server(url, proc)
        start = time.perf_counter()
        soak = Soak()
        asyncio.run(drive(server, Path(a.model).name, a, soak))
        print(report(soak, a.warmup, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
