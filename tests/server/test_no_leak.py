"""Nothing of a request stays in the server once it is over (issue 24, item 7).

A few hundred requests of every kind go through a server in this process, with
the official openai client: completions and chat, streamed and not, n > 1,
logprobs, stop strings the front end finds, json_object output, refused
requests, and clients that hang up in the middle of a stream. Afterwards every
per-request structure of the front end, the engine core and the model runner
is empty, and every KV block is free: counted exactly, not read off the RSS
(engine/tools/soak.py measures that, in minutes).

What did grow, measured by the soak, was native: oneDNN's primitive caches,
which the server caps (host_memory.py; checked here in a fresh process, where
the cap can still take effect), and the heap's free pages, which the engine
core gives back when it goes idle.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from openai import AsyncOpenAI, BadRequestError

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from engine.entrypoints.async_llm import AsyncLLM
from engine.entrypoints.host_memory import HeapTrimmer
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.manager import MAX_CACHED_GRAMMARS
from tests.conftest import ROOT
from tests.server.conftest import TINY, in_thread

NUM_REQUESTS = 240
CONCURRENCY = 12
MODEL = "deepinfer-tiny"
KINDS = ("completion", "stream", "chat", "chat_stream", "n3", "logprobs", "stop", "json")
KINDS += ("hang_up", "refused")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, AsyncLLM]]:
    config = EngineConfig(
        model=str(TINY),
        dtype="float32",
        num_kv_blocks=128,
        max_model_len=128,
        max_num_seqs=8,  # fewer than the clients: some requests wait, some are aborted waiting
        compile_decode=False,
    )
    app = build_app(ServerConfig(config))
    with in_thread(app) as url:
        yield url, app.state.llm


async def one(client: AsyncOpenAI, kind: str, rng: random.Random) -> None:
    words = " ".join(rng.choice(["the", "cache", "holds", "keys", "a"]) for _ in range(30))
    common = dict(model=MODEL, max_tokens=rng.randint(1, 12), temperature=1.0)
    chat = [{"role": "user", "content": words}]
    if kind == "completion":
        await client.completions.create(prompt=words, **common)
    elif kind == "n3":
        await client.completions.create(prompt=words, n=3, **common)
    elif kind == "logprobs":
        await client.completions.create(prompt=words, logprobs=2, **common)
    elif kind == "stop":  # most end on a stop string, found by the front end
        await client.completions.create(prompt=words, stop=["e", " "], **common)
    elif kind == "chat":
        await client.chat.completions.create(messages=chat, **common)
    elif kind == "json":
        fmt = {"type": "json_object"}
        await client.chat.completions.create(messages=chat, response_format=fmt, **common)
    elif kind == "refused":
        with pytest.raises(BadRequestError):
            await client.completions.create(prompt=words, model=MODEL, max_tokens=10_000)
    elif kind == "hang_up":
        await hang_up(client, words)
    else:
        await read_stream(client, kind, words, chat, common)


async def read_stream(
    client: AsyncOpenAI, kind: str, words: str, chat: list[dict], common: dict
) -> None:
    if kind == "stream":
        stream = await client.completions.create(prompt=words, stream=True, **common)
    else:
        stream = await client.chat.completions.create(messages=chat, stream=True, **common)
    async for _ in stream:
        pass


async def hang_up(client: AsyncOpenAI, words: str) -> None:
    """Close the connection after the first chunk of a long stream."""
    stream = await client.completions.create(
        model=MODEL, prompt=words, max_tokens=60, stream=True, extra_body={"ignore_eos": True}
    )
    async for _ in stream:
        break
    await stream.close()


async def soak(url: str, llm: AsyncLLM) -> str:
    """The mix; then, once the engine is idle, one last completion: its engine id."""
    rng = random.Random(0)
    plan = iter([rng.choice(KINDS) for _ in range(NUM_REQUESTS)])
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

    async def worker(seed: int) -> None:
        worker_rng = random.Random(seed)
        for kind in plan:
            await one(client, kind, worker_rng)

    await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))
    await idle(llm)  # the hung-up streams' aborts applied too
    last = await client.completions.create(model=MODEL, prompt="the end", max_tokens=2)
    await client.close()
    await idle(llm)
    return f"{last.id}-0"


async def idle(llm: AsyncLLM, timeout_s: float = 10.0) -> None:
    """Until the core has applied every abort and finished every request."""
    deadline = time.monotonic() + timeout_s
    while llm.core.engine.has_unfinished_requests() or llm.sinks or not llm.core.inbox.empty():
        assert time.monotonic() < deadline, "the engine did not go idle"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the core's last turn: its idle bookkeeping after the step


def test_no_request_state_outlives_its_request(served: tuple[str, AsyncLLM]) -> None:
    """Bug guarded: a per-request entry that is not dropped when its request
    finishes, fails or is aborted (a dict that grows with the server's traffic)."""
    url, llm = served
    llm.core.trimmer.interval_s = 0.0  # every time the core goes idle
    trims = llm.core.trimmer.num_trims
    last_id = asyncio.run(soak(url, llm))
    engine = llm.core.engine
    scheduler, blocks = engine.scheduler, engine.block_manager
    assert (len(llm.sinks), len(llm.timing), len(llm.processor.states)) == (0, 0, 0)
    assert (len(scheduler.requests), len(scheduler.waiting), len(scheduler.running)) == (0, 0, 0)
    assert (len(scheduler.kv.loading), len(scheduler.kv.saving)) == (0, 0)
    # The model runner forgets a request at the step after it finished: only the
    # last one is left, its id waiting for the next step.
    assert set(engine.executor.model_runner.requests) <= {last_id}
    assert scheduler.finished_req_ids == [last_id]
    assert blocks.num_free_blocks == len(blocks.blocks)
    assert all(b.ref_count == 0 for b in blocks.blocks)
    assert len(engine.output_processor.outputs) == 0  # the core's outbox
    assert llm.core.trimmer.num_trims > trims  # the idle core gave its free pages back


def test_compiled_grammars_are_a_bounded_cache(served: tuple[str, AsyncLLM]) -> None:
    """Bug guarded: a compiled grammar kept for every distinct schema ever sent."""
    manager = served[1].core.engine.structured_output

    def schema(i: int) -> StructuredOutputsParams:
        return StructuredOutputsParams(json={"properties": {f"field_{i}": {"type": "integer"}}})

    first = manager.compile(schema(0))
    for i in range(1, MAX_CACHED_GRAMMARS + 8):
        manager.compile(schema(i))
    assert len(manager.grammars) == MAX_CACHED_GRAMMARS
    newest = schema(MAX_CACHED_GRAMMARS + 7)
    assert manager.compile(newest) is manager.compile(newest)  # kept: compiled once
    assert manager.compile(schema(0)) is not first  # the oldest was dropped, compiled anew
    assert len(manager.grammars) == MAX_CACHED_GRAMMARS


def test_heap_trimmer_trims_at_most_once_per_interval() -> None:
    now = [100.0]
    trimmer = HeapTrimmer(interval_s=5.0, clock=lambda: now[0])
    if trimmer.malloc_trim is None:
        pytest.skip("no glibc malloc_trim here")
    assert not trimmer.maybe_trim()
    now[0] += 5.0
    assert trimmer.maybe_trim()
    now[0] += 1.0
    assert not trimmer.maybe_trim()
    assert trimmer.num_trims == 1


# In a fresh process, after the server's engine core has loaded a model: 600
# packed linear calls, each with a batch of a new size, and the heap bytes that
# the second 300 of them left in use (glibc's mallinfo2). Capped, the caches
# are full by then; each new primitive replaces an old one.
ONEDNN_PROBE = f"""
import ctypes, torch
from engine.config import EngineConfig
from engine.entrypoints.engine_core import EngineCore
from engine.layers.linear import PackedLinear
EngineCore(EngineConfig(model={str(TINY)!r}, dtype="bfloat16", num_kv_blocks=8, compile_decode=False))
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "a b c d e f g used free k".split()]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = Info
torch.set_num_threads(1)
layer = PackedLinear(torch.nn.Linear(256, 768, bias=False).to(torch.bfloat16))
with torch.inference_mode():
    for rows in range(1, 601):
        if rows == 301:
            before = mallinfo2().used
        layer(torch.randn(rows, 256, dtype=torch.bfloat16))
print((mallinfo2().used - before) / 2**20)
"""


def onednn_growth_mib(env: dict[str, str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        env.setdefault(name, "")
        if not env[name]:
            del env[name]
    done = subprocess.run(
        [sys.executable, "-c", ONEDNN_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


def test_onednn_primitive_caches_are_capped_unless_the_user_says_otherwise() -> None:
    """Bug guarded: a oneDNN primitive (about half a MiB) cached for every
    batch size a server sees, up to 1,024 of them in each of two caches."""
    import torch

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    capped = onednn_growth_mib({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "", "LRU_CACHE_CAPACITY": ""})
    users = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}
    uncapped = onednn_growth_mib(users)  # the user's value is kept: oneDNN's default
    assert capped < 8, f"{capped:.1f} MiB more kept for 300 more batch sizes, caches capped"
    assert uncapped > 64, f"the probe saw no growth uncapped ({uncapped:.1f} MiB)"
