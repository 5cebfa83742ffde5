"""Prefill/decode disaggregation through real processes on loopback (Chapter 8):
one prefill worker and two decode workers sharing a directory store, behind the
PD router, against one plain worker. The official client gets the same text
from both, greedy and seeded, streamed and not; the decode workers' metrics show
the prompts' blocks came through the store; a decode worker SIGKILLed mid-stream
loses no stream and changes no text; and a router whose workers serve another
model's key space refuses to start. Every wait is bounded."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import TINY, metric, running, spawn, stop
from tests.server.test_router_endpoints import GETS, same_answers

WORKER_ARGS = ("--dtype", "float32", "--num-kv-blocks", "512", "--no-compile-decode")
MODEL = "deepinfer-tiny"
WORDS = [
    "the",
    "cache",
    "block",
    "store",
    "prefill",
    "decode",
    "token",
    "router",
    "worker",
    "stream",
]
pytestmark = pytest.mark.timeout(420)
MAX_LONG = 96  # tokens: a stream still running when its worker is killed


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("kv-store"))
    pd = ("--kv-store", store)
    decoding = (*pd, "--role", "decode", "--kv-store-load", "always")
    with running(
        ("serve", str(TINY), *WORKER_ARGS),
        ("serve", str(TINY), *WORKER_ARGS, *pd, "--role", "prefill"),
        ("serve", str(TINY), *WORKER_ARGS, *pd, "--role", "prefill"),
        ("serve", str(TINY), *WORKER_ARGS, *decoding),
        ("serve", str(TINY), *WORKER_ARGS, *decoding),
    ) as (plain, *workers):
        prefill, decode = workers[:2], workers[2:]
        urls = [a for p in prefill for a in ("--prefill", p.url)]
        urls += [a for d in decode for a in ("--decode", d.url)]
        args = ("--model", str(TINY), "--block-size", "16", "--health-interval", "0.5")
        with running(("router", *urls, *args)) as (router,):
            yield plain, prefill, decode, router


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)


def text(url: str, prompt: str, stream: bool, seed: int | None, max_tokens: int = 24) -> str:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=stream)
    kw |= dict(temperature=0.0) if seed is None else dict(temperature=1.0, seed=seed)
    reply = client(url).completions.create(**kw)
    if not stream:
        return reply.choices[0].text
    return "".join(chunk.choices[0].text for chunk in reply if chunk.choices)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [None, 11])
def test_pd_gives_a_single_workers_text(cluster, stream: bool, seed: int | None) -> None:
    plain, prefill, decode, router = cluster
    before = sum(metric(d.url, "deepinfer:kv_store_handoff_tokens_total") for d in decode)
    batch = prompts(32, seed=2 * stream + (seed is not None))
    with ThreadPoolExecutor(4) as pool:
        want = list(pool.map(lambda p: text(plain.url, p, stream, seed), batch))
        got = list(pool.map(lambda p: text(router.url, p, stream, seed), batch))
    assert got == want
    after = sum(metric(d.url, "deepinfer:kv_store_handoff_tokens_total") for d in decode)
    assert after > before  # the prompts' blocks came through the store
    handed = metric(router.url, "deepinfer_router:pd_handoffs_total")
    assert handed >= 1
    for worker, direction, total in [
        *((d, "load", "loaded_bytes") for d in decode),
        *((p, "save", "saved_bytes") for p in prefill),
    ]:  # each request's transfer, observed once, adds up to the counter
        moved = by_direction(worker.url, "deepinfer:kv_store_request_bytes_sum", direction)
        assert moved == metric(worker.url, f"deepinfer:kv_store_{total}_total")
    loads = sum(
        by_direction(d.url, "deepinfer:kv_store_request_bytes_count", "load") for d in decode
    )
    assert loads == sum(metric(d.url, "deepinfer:kv_store_loads_total") for d in decode)
    hits = sum(metric(d.url, "deepinfer:kv_store_backend_hits_total") for d in decode)
    assert hits * 16 >= after  # every handed-on block was a verified read of the store


def by_direction(url: str, name: str, direction: str) -> float:
    """A per-request histogram's series for loads or for saves, from /metrics."""
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    label = f'direction="{direction}"'
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(name) and label in ln)


def test_chat_and_models_are_served_whole(cluster) -> None:
    plain, _, _, router = cluster
    messages = [{"role": "user", "content": prompts(1, seed=13)[0]}]
    replies = [
        client(url).chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=12, temperature=0
        )
        for url in (plain.url, router.url)
    ]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert [m.id for m in client(router.url).models.list()] == [MODEL]


def test_responses_and_the_tokenizer_routes_are_passed_on(cluster) -> None:
    plain, _, _, router = cluster
    same_answers(plain.url, router.url, GETS)


def test_a_prefix_one_worker_computed_is_a_store_hit_on_another(cluster) -> None:
    """The store as the prefix cache's second tier: plain requests, no handoff."""
    _, _, decode, _ = cluster
    system = prompts(1, seed=21)[0] * 3  # a shared system prompt of several blocks
    saved = "deepinfer:kv_store_saved_blocks_total"
    before_save = metric(decode[0].url, saved)
    text(decode[0].url, system + " first question", False, None)
    deadline = time.monotonic() + 30  # the save runs beside the steps, after the reply
    while metric(decode[0].url, saved) == before_save:
        assert time.monotonic() < deadline, "the first worker never saved the prefix"
        time.sleep(0.05)
    name = "deepinfer:kv_store_hit_tokens_total"
    before = metric(decode[1].url, name)
    text(decode[1].url, system + " second question", False, None)
    assert metric(decode[1].url, name) - before >= 16


def test_a_prefill_worker_killed_is_left_for_the_other(cluster) -> None:
    plain, prefill, _, router = cluster
    batch = prompts(4, seed=9)
    want = [text(plain.url, p, False, None) for p in batch]
    prefill[0].kill()
    assert [text(router.url, p, False, None) for p in batch] == want


def test_a_decode_worker_killed_mid_stream_loses_no_stream(cluster) -> None:
    """Streams long enough to be running when one decode worker is SIGKILLed."""
    plain, _, decode, router = cluster
    batch = prompts(6, seed=5)
    want = [text(plain.url, p, False, 3, max_tokens=MAX_LONG) for p in batch]

    def one(p: str) -> str:
        chunks = client(router.url).completions.create(
            model=MODEL, prompt=p, max_tokens=MAX_LONG, stream=True, temperature=1.0, seed=3
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, p) for p in batch]
        deadline = time.monotonic() + 60
        while metric(decode[0].url, "deepinfer:num_requests_running") < 1:
            assert time.monotonic() < deadline, "no stream reached the first decode worker"
            time.sleep(0.05)
        decode[0].kill()
        got = [f.result(timeout=120) for f in futures]
    assert got == want
    assert metric(router.url, "deepinfer_router:pd_resumed_total") >= 1


@pytest.mark.parametrize(
    "decode_worker",
    [(str(TINY), "--block-size", "8"), (str(TINY.parent / "deepinfer-tiny-moe"),)],
    ids=["another-block-size", "another-model"],
)
def test_a_router_refuses_workers_of_another_key_space(tmp_path, decode_worker) -> None:
    """A decode worker with another block size, or another model, files blocks under
    another root: the router will not pair it with the prefill worker."""
    store = ("--kv-store", str(tmp_path))
    with running(
        ("serve", str(TINY), *WORKER_ARGS, *store, "--role", "prefill"),
        ("serve", *decode_worker, *WORKER_ARGS, *store, "--role", "decode"),
    ) as (prefill, decode):
        router = spawn("router", "--prefill", prefill.url, "--decode", decode.url)
        try:
            code = router.proc.wait(timeout=60)
            log = router.log.read_text()
        finally:
            stop(router)
    assert code != 0
    assert "do not share one KV store key space" in log
