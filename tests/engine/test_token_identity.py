"""The oracle: the engine's greedy tokens equal transformers' generate, token for
token, for a batch of prompts of different lengths, under every scheduling
regime the engine has: plain, chunked prefill, preemption, shared prefixes,
all three at once, one-token blocks and large blocks."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts

MAX_TOKENS = 24

# A shared 40-token "system prompt" in front of half the prompts.
PREFIX = random_prompts(1, seed=7, low=40, high=41)[0]
PROMPTS = [PREFIX + p for p in random_prompts(5, seed=8, low=2, high=30)] + random_prompts(
    6, seed=9
)

CONFIGS = {
    "defaults": {},
    "chunked-prefill": {"max_num_batched_tokens": 24},
    "preemption": {"num_kv_blocks": 12},
    "prefix-sharing": {"max_num_seqs": 3},
    # Chunks, preemptions and prefix hits in the same run: a block published
    # before all of its tokens are computed is hit by another request.
    "chunked-preempted-shared": {
        "max_num_batched_tokens": 12,
        "num_kv_blocks": 26,
        "block_size": 4,
    },
    "block-size-1": {"block_size": 1},
    "block-size-128": {"block_size": 128},
    # The CPU default decodes through the C++ operator; the reference torch path
    # must keep matching too.
    "torch-backend": {"attention_backend": "torch", "max_num_batched_tokens": 24},
}


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    _, _, model = checkpoint
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_greedy_tokens_match_transformers(checkpoint, reference, config) -> None:
    arch, path, _ = checkpoint
    llm = LLM(path, dtype="float32", **CONFIGS[config])
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    assert [o.prompt_token_ids for o in outputs] == PROMPTS  # nothing dropped, order kept
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.token_ids == ref, f"{arch}/{config}: prompt {i} differs"
        assert out.finish_reason == ("stop" if ref[-1] == 2 and len(ref) < MAX_TOKENS else "length")
    stats = llm.stats
    if config in ("chunked-prefill", "chunked-preempted-shared", "torch-backend"):
        assert stats.partial_prefills > 0, stats
    if config in ("preemption", "chunked-preempted-shared"):
        assert stats.preemptions > 0, stats
    if config in ("prefix-sharing", "chunked-preempted-shared"):
        assert stats.prefix_cache_hit_tokens > 0, stats
    if config == "defaults":  # all admitted in one step: the shared prefix computed once
        full_blocks = len(PREFIX) // 16
        assert stats.prefix_cache_hit_tokens == 4 * full_blocks * 16, stats
