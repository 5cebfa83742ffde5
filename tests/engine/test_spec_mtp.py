"""Speculative decoding with DeepSeek-V3's MTP module (engine/spec_decode/mtp.py),
on the trained deepinfer-tiny-moe.

Greedy: MTP drafts give the tokens of decoding without them, for k = 1 and 2,
under chunked prefill, preemption and prefix caching. The drafts themselves are
the module's: each one the engine kept is what the module computes from scratch
over the whole sequence (one prompt, no cache read), through chunked prompts,
preemptions and verify steps. Seeded: a sampled request's tokens are its tokens
without speculation, alone, in a crowd and preempted (its drafts are one-hot).
The stats count the drafts; under expert parallelism every rank drafts as one
process does; and an engine without MTP weights is refused."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_mtp import run, step_meta
from tests.engine.test_spec_decode import case_ran

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "snippets/models/deepinfer-tiny"
TINY_MOE = ROOT / "snippets/models/deepinfer-tiny-moe"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def prose(n: int, length: int, seed: int) -> list[str]:
    """Windows of the book's own chapters: the text the model was trained on."""
    rng = random.Random(seed)
    texts = [f.read_text() for f in sorted((ROOT / "docs").glob("ch0*.md"))]
    return [t[(s := rng.randrange(len(t) - length)) : s + length] for t in rng.sample(texts, n)]


def generate(prompts, params, spec=None, **kwargs) -> tuple[LLM, list]:
    llm = LLM(TINY_MOE, dtype="float32", speculative_config=spec, **kwargs)
    return llm, llm.generate(prompts, params, use_tqdm=False)


# ---------------------------------------------------------------- configuration


def test_mtp_needs_a_model_with_mtp_weights(deepseek_yarn) -> None:
    """deepinfer-tiny is a Qwen3; the random DeepSeek-V3 has no MTP module."""
    for path in (TINY, deepseek_yarn[0]):
        with pytest.raises(ValueError, match="needs a model with multi-token prediction weights"):
            LLM(path, speculative_config=mtp(1))
    with pytest.raises(ValueError, match="method 'mtp' takes no model"):
        LLM(TINY_MOE, speculative_config={**mtp(1), "model": str(TINY)})


def test_the_mtp_cache_lives_in_the_pool_with_room_for_chained_drafts() -> None:
    llm = LLM(
        TINY_MOE,
        dtype="float32",
        num_kv_blocks=20,
        max_num_seqs=3,
        block_size=4,
        speculative_config=mtp(6),
    )
    runner = llm.llm_engine.executor.model_runner
    main, [module] = runner.model.attention_layers(), runner.model.mtp_attention_layers()
    assert module in runner.kv_cache.layers and len(runner.kv_cache.layers) == len(main) + 1
    # Drafts 2..6 reach 5 positions past a request's blocks: 2 blocks of 4 each.
    assert module.kv_cache.rows.shape[0] == 20 + 3 * 2
    assert main[0].kv_cache.rows.shape[0] == llm.llm_engine.block_manager.num_free_blocks == 20


# ---------------------------------------------------------------- greedy identity

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
CASES = {
    "chunked": dict(max_num_batched_tokens=24),
    "preempted": dict(num_kv_blocks=60, block_size=4),
    "prefix": dict(enable_prefix_caching=True, block_size=4),
}


@pytest.fixture(scope="module")
def plain_outputs() -> dict[str, tuple[list[str], list[list[int]]]]:
    """Each case's prompts and their tokens without speculation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one_thread does for each test
    outputs = {}
    for case, kwargs in CASES.items():
        prompts = prose(4, 300, seed=3)
        if case == "prefix":  # later prompts begin with earlier ones
            prompts += [prompts[0] + prompts[1][:120], prompts[1] + prompts[0][:60]]
        _, outs = generate(prompts, GREEDY, **kwargs)
        outputs[case] = prompts, [o.token_ids for o in outs]
    torch.set_num_threads(threads)
    return outputs


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_greedy_mtp_gives_the_tokens_of_decoding_without_it(plain_outputs, case, k) -> None:
    prompts, expected = plain_outputs[case]
    llm, outs = generate(prompts, GREEDY, mtp(k), **CASES[case])
    assert [o.token_ids for o in outs] == expected
    s = llm.stats
    assert 0 < s.spec_decode.num_accepted_tokens < s.spec_decode.num_draft_tokens
    assert case_ran(s, case)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == len(bm.blocks)


# ---------------------------------------------------------------- the drafts are the module's


def drafts_from_scratch(llm: LLM, tokens: list[int], k: int) -> tuple[list[int], float]:
    """The k drafts after tokens[-1], from the whole sequence at once: the main
    model over tokens[:-1] as one prompt, the module over its rows with each
    next token, then chained on its own state. Also the smallest gap between a
    draft's logit and the next best, which says how far rounding is from a tie."""
    runner = llm.llm_engine.executor.model_runner
    model, ids = runner.model, torch.tensor(tokens)
    n = len(tokens) - 1
    pos = torch.arange(n)
    hidden = run(runner, step_meta(pos.tolist(), n, False), lambda: model(ids[:-1], pos))
    next_ids, drafts, gap = ids[1:], [], float("inf")
    for _ in range(k):
        p = torch.arange(len(next_ids))
        meta = step_meta(p.tolist(), len(p), False)
        normed, state = run(runner, meta, partial(model.mtp_hidden_states, p, hidden, next_ids))
        top = model.compute_logits(normed[-1]).float().topk(2)
        drafts.append(top.indices[0].item())
        gap = min(gap, (top.values[0] - top.values[1]).item())
        hidden = torch.cat([hidden, state[-1:]])
        next_ids = torch.cat([next_ids, top.indices[:1]])
    return drafts, gap


@pytest.mark.parametrize("k,block_size", [(1, 4), (2, 4), (5, 2)])
def test_each_kept_draft_is_the_module_s_over_the_whole_sequence(k: int, block_size: int) -> None:
    """Drafts made through chunked prompts (held rows), preemptions (recomputed
    rows), prefix hits on a request's own blocks, verify steps that rejected
    drafts (rows written again) and, for k = 5 on blocks of 2, chained drafts two
    blocks past a request's own, against the module run from scratch."""
    llm = LLM(
        TINY_MOE,
        dtype="float32",
        max_num_batched_tokens=20,
        num_kv_blocks=160 // block_size,
        block_size=block_size,
        speculative_config=mtp(k),
    )
    kept = kept_drafts(llm, prose(5, 200, seed=8), max_tokens=24)
    s = llm.stats
    assert s.preemptions > 0 and s.partial_prefills > 0 and s.prefix_cache_hit_tokens > 0
    assert 0 < s.spec_decode.num_accepted_tokens < s.spec_decode.num_draft_tokens
    checked = checked_from_scratch(TINY_MOE, kept, k)
    assert len(kept) >= 40 and checked > 0.9 * len(kept)


def kept_drafts(llm: LLM, prompts: list, max_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """Run ``prompts`` greedily step by step; by each request's tokens at the
    time, the drafts the engine kept after them."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    kept: dict[tuple[int, ...], list[int]] = {}
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.spec_token_ids and seq.spec_at == seq.num_tokens:
                kept[tuple(seq.token_ids)] = seq.spec_token_ids
    return kept


def checked_from_scratch(model: Path, kept: dict[tuple[int, ...], list[int]], k: int) -> int:
    """Each kept draft against ``model``'s module run from scratch over its whole
    sequence; how many were checked (a near-tie, which rounding may break either
    way, is left out)."""
    reference = LLM(
        model, dtype="float32", block_size=16, num_kv_blocks=16, speculative_config=mtp(k)
    )
    checked = 0
    for tokens, drafts in kept.items():
        expected, gap = drafts_from_scratch(reference, list(tokens), k)
        if gap > 1e-3:
            assert drafts == expected, f"after {len(tokens)} tokens"
            checked += 1
    return checked


# ---------------------------------------------------------------- seeded requests


def seeded(prompts: list[str], crowd: int, k: int | None, **kwargs) -> list[int]:
    """The first prompt's tokens, seeded, among ``crowd`` other sampled requests."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=11)]
    params += [SamplingParams(temperature=1.0, max_tokens=32)] * crowd
    llm, outs = generate(prompts[: 1 + crowd], params, None if k is None else mtp(k), **kwargs)
    if k is not None:
        assert llm.stats.spec_decode.num_accepted_tokens > 0
    return outs[0].token_ids


def test_a_seeded_request_keeps_its_tokens_with_mtp_alone_crowded_and_preempted() -> None:
    prompts = prose(6, 250, seed=5)
    reference = seeded(prompts, 0, None)
    assert seeded(prompts, 0, 2) == reference
    assert seeded(prompts, 5, 2) == reference
    assert seeded(prompts, 5, 1, num_kv_blocks=40, block_size=4) == reference
    assert seeded(prompts, 5, 2, max_num_batched_tokens=32) == reference


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("k", [1, 2])
def test_stats_count_mtp_drafts_and_acceptances(k: int) -> None:
    """One request, its prompt in chunks: every step that samples gives its
    accepted drafts and one token more."""
    llm, [out] = generate(prose(1, 400, seed=9), GREEDY, mtp(k), max_num_batched_tokens=32)
    s, spec = llm.stats, llm.stats.spec_decode
    assert s.partial_prefills > 0
    assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens <= k * spec.num_drafts
    assert sum(spec.accepted_lengths) == spec.num_drafts and len(spec.accepted_lengths) <= k + 1
    assert sum(n * c for n, c in enumerate(spec.accepted_lengths)) == spec.num_accepted_tokens
    sampling_forwards = s.steps - s.partial_prefills
    assert len(out.token_ids) == spec.num_accepted_tokens + sampling_forwards
    assert s.generated_tokens == len(out.token_ids)
    # Every decode step verified drafts, but one at max_tokens - 1, which has no room.
    assert sampling_forwards - 2 <= spec.num_drafts <= sampling_forwards - 1


# ---------------------------------------------------------------- expert parallelism


def test_mtp_under_expert_parallelism_drafts_as_one_process() -> None:
    """Every rank runs the module's MoE layer on rank 0's tokens: the same tokens,
    drafts and routing as one process, under chunked prefill and preemption."""
    stress = dict(max_num_batched_tokens=16, num_kv_blocks=14, block_size=4)
    prompts = prose(4, 40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=16)
    _, plain = generate(prompts, params, **stress)
    one, outs = generate(prompts, params, mtp(2), **stress)
    llm, ep_outs = generate(prompts, params, mtp(2), expert_parallel_size=2, **stress)
    try:
        assert [o.token_ids for o in ep_outs] == [o.token_ids for o in plain]
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        ep = llm.stats
        assert ep.preemptions > 0 and ep.partial_prefills > 0
        assert ep.spec_decode == one.stats.spec_decode and ep.spec_decode.num_accepted_tokens
        assert torch.equal(ep.expert_tokens, one.stats.expert_tokens)  # the MTP layer's too
    finally:
        llm.shutdown()
