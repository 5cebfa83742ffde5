"""Sampling: seeded requests are reproducible whatever shares their batch, the
filters behave as documented, and logprobs are those of the model."""

from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import random_prompts

PROMPTS = random_prompts(8, seed=21)


@pytest.fixture(scope="module")
def llm(qwen3) -> LLM:
    return LLM(qwen3[0])


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True, **kw)


def test_same_seed_same_tokens_whatever_the_batch(llm, qwen3) -> None:
    target = PROMPTS[0]
    alone = llm.generate([target], seeded(1234), use_tqdm=False)[0].token_ids
    # In a batch, at a different position, with other seeded and unseeded requests.
    others = [seeded(i) for i in range(1, 7)] + [SamplingParams(temperature=0.8, max_tokens=12)]
    batch = PROMPTS[1:] + [target]
    mixed = llm.generate(batch, others + [seeded(1234)], use_tqdm=False)[-1].token_ids
    assert mixed == alone
    # Under memory pressure, with preemption and recompute.
    tight = LLM(qwen3[0], num_kv_blocks=8)
    squeezed = tight.generate(batch, others + [seeded(1234)], use_tqdm=False)[-1].token_ids
    assert tight.stats.preemptions > 0
    assert squeezed == alone


def test_different_seeds_differ_and_sampling_is_not_greedy(llm) -> None:
    outs = llm.generate([PROMPTS[0]] * 6, [seeded(s) for s in range(6)], use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_unseeded_requests_are_reproducible_from_the_engine_seed(qwen3) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    a = LLM(qwen3[0], seed=5).generate(PROMPTS[:4], params, use_tqdm=False)
    b = LLM(qwen3[0], seed=5).generate(PROMPTS[:4], params, use_tqdm=False)
    c = LLM(qwen3[0], seed=6).generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_top_k_1_and_tiny_top_p_are_greedy(llm) -> None:
    greedy = llm.generate(
        PROMPTS[:3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        hot = SamplingParams(temperature=1.5, max_tokens=10, seed=99, ignore_eos=True, **kw)
        outs = llm.generate(PROMPTS[:3], hot, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in greedy], kw


def test_logprobs_are_the_models(llm) -> None:
    out = llm.generate(
        PROMPTS[:2],
        SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )
    for o in out:
        assert len(o.logprobs) == len(o.token_ids) == 5
        for token, entry in zip(o.token_ids, o.logprobs):
            assert token in entry and len(entry) == 3  # greedy token is in the top 3
            assert entry[token] == max(entry.values())
            assert all(v <= 0 for v in entry.values())
            assert sum(math.exp(v) for v in entry.values()) <= 1 + 1e-5
