"""A prompt of megabytes must not stall the server: it is refused from a bound on
its token count before it is tokenized, text that must be tokenized is
tokenized off the event loop, and /health answers meanwhile."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers, pre_tokenizers

from engine.entrypoints.prompt_tokens import PromptTokenizer, bytes_per_token
from tests.server.conftest import TINY, auth

TOKENIZER = Tokenizer.from_file(str(TINY / "tokenizer.json"))
MODEL = "deepinfer-tiny"


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=400))
def test_the_bound_never_exceeds_the_true_token_count(text: str) -> None:
    prompts = PromptTokenizer(TOKENIZER, max_model_len=10**9)
    try:
        ids = TOKENIZER.encode(text).ids
    except Exception:  # text the tokenizer itself cannot take (a lone surrogate)
        return
    assert prompts.at_least(text) <= len(ids)


def test_the_bound_is_the_byte_count_over_the_longest_token() -> None:
    """In UTF-8 bytes of the vocabulary's strings: 'Ġ' (a byte-level space) counts
    two, so the bound errs low, never high."""
    per_token = bytes_per_token(TOKENIZER)
    assert per_token == max(len(t.encode()) for t in TOKENIZER.get_vocab(with_added_tokens=True))
    prompts = PromptTokenizer(TOKENIZER, 10**9)
    assert prompts.at_least("a" * per_token * 5) == 5
    assert prompts.at_least("a" * (per_token * 5 + 1)) == 6


def _with(normalizer=None, pre=None) -> Tokenizer:
    tok = Tokenizer.from_str(TOKENIZER.to_str())
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre is not None:
        tok.pre_tokenizer = pre
    return tok


def test_text_that_a_tokenizer_may_drop_turns_the_bound_off() -> None:
    plain = bytes_per_token(TOKENIZER)
    assert bytes_per_token(_with(normalizers.NFC())) == 3 * plain
    assert (
        bytes_per_token(_with(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])))
        == 9 * plain
    )
    assert bytes_per_token(_with(normalizers.Strip())) is None
    assert bytes_per_token(_with(pre=pre_tokenizers.Whitespace())) is None
    assert bytes_per_token(_with(pre=pre_tokenizers.Split(" ", behavior="removed"))) is None
    stripped = PromptTokenizer(_with(normalizers.Strip()), max_model_len=8)
    assert stripped.at_least(" " * 10_000) == 0  # all of it may go: no refusal from the bound


def test_long_text_is_tokenized_in_a_thread_and_the_loop_goes_on() -> None:
    """The same ids as tokenizing inline, while a 5 ms ticker in the loop keeps
    ticking: its longest pause is a fraction of the time tokenizing took."""
    rng = random.Random(0)
    words = ["block", "step", "cache", "ünïcode", "数据", "\n", "def", "("]
    text = " ".join(rng.choice(words) for _ in range(200_000))
    prompts = PromptTokenizer(TOKENIZER, max_model_len=10**9)

    async def run() -> tuple[list[int], float, float]:
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        ids = await prompts.encode(text)
        took = time.perf_counter() - start
        task.cancel()
        inside = [t for t in ticks if t >= start - 0.01]
        return ids, took, max(b - a for a, b in zip(inside, inside[1:]))

    ids, took, pause = asyncio.run(run())
    assert ids == TOKENIZER.encode(text).ids
    assert pause < took / 2, f"the loop paused {pause:.3f} s of {took:.3f} s"


@pytest.mark.timeout(120)
def test_huge_prompts_are_refused_while_health_answers(server) -> None:
    """Three 3.9 MB prompts (under the 4 MiB body limit) against the session
    server (128-token context): each a 400 that says why, and /health keeps
    answering. Before the fix /health took seconds here; the bound is generous."""
    prompt = ("lorem ipsum dolor sit amet " * 150_000)[:3_900_000]

    async def run() -> tuple[list[httpx.Response], list[float]]:
        async with httpx.AsyncClient(timeout=60, headers=auth()) as client:
            latencies: list[float] = []
            big = [
                asyncio.create_task(
                    client.post(
                        server.url + "/v1/completions",
                        json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                    )
                )
                for _ in range(3)
            ]
            while not all(t.done() for t in big):
                start = time.perf_counter()
                await client.get(server.url + "/health")
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.01)
            return [t.result() for t in big], latencies

    replies, latencies = asyncio.run(run())
    for reply in replies:
        assert reply.status_code == 400, reply.text
        error = json.loads(reply.text)["error"]
        assert error["param"] == "prompt" and "at least" in error["message"], error
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s"
