"""`deepinfer bench --serve`: the same workload through `deepinfer serve` (HTTP,
streaming, N concurrent clients) and through LLM.generate offline, measured in
one run, so that the ratio is the server's overhead.

Each client sends its next request as soon as its last one ends. Offline, the
same prompts go through LLM.generate in waves of N, so that neither side ever
has more than N requests in the batch. Time to first token is measured from the
request's sending (server) or its arrival in the engine (offline); inter-token
latency is a request's (last token - first token) / (tokens - 1). Under each
table, the server's own TTFT histogram (from /metrics) splits its TTFT at the
engine's door: what is left is HTTP, in and out, and the clients' own loop.

Each number of clients gets prompts of its own, and the warm-up others again:
a prompt either side has seen would find all but its last partial block in the
prefix cache and skip that much prefill.

The clients are aiohttp's, as in vLLM's serving benchmark. They share the
machine with the server, so their own cost is in the figures: httpx's client,
whose cost per event is higher, left the server measurably slower at 64
clients on two cores (stop 41's closing note has the figures).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
import urllib.request

import aiohttp
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tools.bench import Result, random_prompts
from engine.tools.launch import launched


class Measured(Result):
    """bench's Result, and the tail of its TTFTs."""

    def p99_ttft(self) -> float:
        ordered = sorted(self.ttft_ms)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def offline(llm: LLM, prompts: list[list[int]], output_len: int, clients: int) -> Measured:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), clients):
        outputs += llm.generate(prompts[i : i + clients], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = [(o.times.first_token - o.times.arrival) * 1e3 for o in outputs]
    itl = [
        (o.times.finished - o.times.first_token) * 1e3 / (len(o.token_ids) - 1)
        for o in outputs
        if len(o.token_ids) > 1
    ]
    return Measured(seconds, sum(len(o.token_ids) for o in outputs), ttft, itl)


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float, int]:
    """(TTFT s, ITL s, tokens) of one streamed completion."""
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.content:  # one server-sent event line at a time
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            now = time.perf_counter()
            if chunk["choices"]:
                first = first or now
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    itl = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return first - sent, itl, tokens


async def served(
    url: str, model: str, prompts: list[list[int]], output_len: int, clients: int
) -> Measured:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[tuple[float, float, int]] = []
    body = dict(model=model, max_tokens=output_len, temperature=0, ignore_eos=True, stream=True)
    body["stream_options"] = {"include_usage": True}

    async def client_loop(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            results.append(await _one(session, url, {**body, "prompt": prompt}))

    connector = aiohttp.TCPConnector(limit=clients + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(session) for _ in range(clients)))
        seconds = time.perf_counter() - start
    return Measured(
        seconds,
        sum(r[2] for r in results),
        [r[0] * 1e3 for r in results],
        [r[1] * 1e3 for r in results if r[2] > 1],
    )


def engine_ttft(url: str) -> tuple[float, int]:
    """The server's own TTFT histogram, from its /metrics: (sum in s, count).
    It starts at the request's arrival in the server's engine, after HTTP."""
    with urllib.request.urlopen(url + "/metrics") as reply:
        text = reply.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name == "deepinfer:time_to_first_token_seconds":
            found = {s.name.rsplit("_", 1)[1]: s.value for s in family.samples}
    return found.get("sum", 0.0), int(found.get("count", 0))


def _in_engine(before: tuple[float, int], after: tuple[float, int], s: Measured) -> str:
    """The server's TTFT split at its engine's door."""
    count = after[1] - before[1]
    if not count:
        return "the server's engine reported no first tokens"
    inside = (after[0] - before[0]) * 1e3 / count
    outside = statistics.mean(s.ttft_ms) - inside
    return (
        f"server TTFT from arrival in its engine: {inside:.1f} ms mean; "
        f"HTTP and the clients: {outside:.1f} ms"
    )


def _row(label: str, m: Measured) -> str:
    itl = statistics.mean(m.itl_ms) if m.itl_ms else float("nan")
    return (
        f"{label:<10}{m.tokens_per_s:>10.1f}{statistics.mean(m.ttft_ms):>12.1f}"
        f"{m.p99_ttft():>12.1f}{itl:>10.1f}"
    )


def _ratio(s: Measured, o: Measured) -> str:
    def r(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    itl_s = statistics.mean(s.itl_ms) if s.itl_ms else 0.0
    itl_o = statistics.mean(o.itl_ms) if o.itl_ms else 0.0
    cells = [
        r(s.tokens_per_s, o.tokens_per_s),
        r(statistics.mean(s.ttft_ms), statistics.mean(o.ttft_ms)),
        r(s.p99_ttft(), o.p99_ttft()),
        r(itl_s, itl_o),
    ]
    return f"{'ratio':<10}" + "".join(f"{c:>{w}}" for c, w in zip(cells, (10, 12, 12, 10)))


def run(
    model: str,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: int,
    concurrency: list[int],
    seed: int = 0,
    device: str | None = None,
    threads: int = 1,
    engine_core: str = "process",
) -> str:
    """The table. Both sides get ``threads`` torch threads: on a two-core machine
    the server's HTTP side and the clients need the other core."""
    torch.set_num_threads(threads)
    llm = LLM(model, seed=seed, device=device, max_num_seqs=max(concurrency))
    hf = llm.llm_engine.config.hf_config
    # Fresh prompts for the warm-up and for each number of clients: prompts the
    # prefix cache has seen would skip most of their prefill on both sides.
    sets = random_prompts(num_prompts * len(concurrency) + 4, *input_len, hf.vocab_size, seed)
    warm = sets[:4]
    name = os.path.basename(os.path.normpath(model))
    lines = [
        f"model: {hf.architecture}, {hf.num_hidden_layers} layers, hidden {hf.hidden_size}; "
        f"{llm.llm_engine.config.device}, {threads} torch thread(s) on each side",
        f"{num_prompts} prompts of {input_len[0]}-{input_len[1]} tokens, "
        f"{output_len} output tokens each, greedy",
        f"server: deepinfer serve (engine core in a {engine_core}), streaming over "
        "loopback HTTP; offline: LLM.generate in waves of N",
        "",
    ]
    # The same engine on both sides: the server compiles its decode step by
    # default, LLM does not, and the table measures serving, not compiling.
    serve = ["serve", model, "--max-num-seqs", str(max(concurrency)), "--no-compile-decode"]
    serve += ["--engine-core", engine_core]
    serve += ["--device", device] if device else []
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    with launched(*serve, env=env) as url:
        offline(llm, warm, 2, len(warm))
        asyncio.run(served(url, name, warm, 2, len(warm)))
        for i, clients in enumerate(concurrency):
            prompts = sets[4 + i * num_prompts : 4 + (i + 1) * num_prompts]
            before = engine_ttft(url)
            s = asyncio.run(served(url, name, prompts, output_len, clients))
            after = engine_ttft(url)
            o = offline(llm, prompts, output_len, clients)
            lines += [
                f"{clients} concurrent clients",
                f"{'':<10}{'tok/s':>10}{'TTFT mean':>12}{'TTFT p99':>12}{'ITL mean':>10}  (ms)",
                _row("server", s),
                _row("offline", o),
                _ratio(s, o),
                _in_engine(before, after, s),
                "",
            ]
    return "\n".join(lines).rstrip()
