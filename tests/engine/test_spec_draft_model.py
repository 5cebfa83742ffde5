"""The draft-model proposer (engine/spec_decode/draft_model.py) and the
confidence-scheduled verify length (verify_length.py).

Greedy: drafts from deepinfer-tiny-draft, and from an unrelated random model,
leave the target's tokens as they are without speculation, under chunked
prefill, preemption and prefix caching. Sampled: drafts drawn from the draft's
q keep the target's distribution (a chi-square test against the enumeration)
and a seeded request's tokens alone, in a crowd and preempted. The draft's own
cache is rolled back to the tokens it got right, and gives every block back.
The schedule: it never verifies more than its budget, gives confident drafts
more length than unsure ones, and takes a draft only while it pays."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sequence import Sequence
from engine.spec_decode import Draft
from engine.spec_decode.draft_kv import DraftKV, common_prefix
from engine.spec_decode.verify_length import (
    ConfidenceSchedule,
    StepShape,
    StepTimeProfile,
    choose_lengths,
    gains,
)
from tests.engine.conftest import build_checkpoint, random_prompts
from tests.engine.test_spec_decode import (
    DRAFT,
    GREEDY,
    TINY,
    assert_first_three_are_exact,
    book_prompts,
    case_kwargs,
    case_ran,
    check_blocks,
    enumerate_first_three,
    generate,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


def draft_model(k: int = 4, model=DRAFT, **kw) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": k, "model": str(model), **kw}


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A random Llama with the test tokenizer: a draft that knows nothing of the target."""
    path = tmp_path_factory.mktemp("llama-draft")
    build_checkpoint("llama", path, seed=1)
    return path


@pytest.fixture(scope="module")
def near_draft(qwen3, tmp_path_factory):
    """The random target with noise on every weight: a draft that agrees with it
    often, but not always, so that both acceptance and rejection happen."""
    from safetensors.torch import load_file, save_file

    target, _ = qwen3
    path = tmp_path_factory.mktemp("qwen3-near")
    for f in target.iterdir():
        if f.suffix != ".safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    g = torch.Generator().manual_seed(5)
    weights = load_file(target / "model.safetensors")
    noisy = {n: w + 0.1 * w.std() * torch.randn(w.shape, generator=g) if w.numel() > 1 else w
             for n, w in weights.items()}  # fmt: skip
    save_file(noisy, path / "model.safetensors", metadata={"format": "pt"})
    return path


def free_draft_blocks(llm: LLM) -> tuple[int, int]:
    """The draft's free blocks and all its blocks, once the model runner has heard
    of every finish. The runner hears of a finish with the next step's
    SchedulerOutput (finished_req_ids), so after the last step the draft may
    still hold blocks, but only those of requests that finished since: the
    scheduler's list of them is what that next step would send."""
    engine = llm.llm_engine
    drafter = engine.executor.model_runner.drafter
    kv = drafter.proposer.kv
    assert set(kv.shadows) <= set(engine.scheduler.finished_req_ids)
    drafter.forget(engine.scheduler.finished_req_ids)
    return kv.blocks.num_free_blocks, len(kv.blocks.blocks)


# ---------------------------------------------------------------- configuration


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(tmp_path, random_draft) -> None:
    with pytest.raises(ValueError, match="has a vocabulary of 320 tokens; the target's has"):
        LLM(TINY, speculative_config=draft_model(2, random_draft))
    other = tmp_path / "draft"
    other.mkdir()
    for f in DRAFT.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[3:5]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swap their tokens
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="different tokenizer from the target's"):
        LLM(TINY, speculative_config=draft_model(2, other))


@pytest.mark.parametrize(
    "config,match",
    [
        (draft_model(verify_schedule="longest"), "verify_schedule must be one of fixed"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "verify_schedule": "confidence"},
            "'confidence' needs a proposer that says how sure",
        ),
        (draft_model(verify_budget=-1), "verify_budget must be >= 0"),
        (draft_model(step_time_profile="/no/profile.json"), "is not a file"),
    ],
)
def test_bad_verify_schedules_fail_at_construction(config, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(TINY, speculative_config=config)


# ---------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("case", ["chunked", "preempted", "prefix"])
def test_greedy_draft_model_gives_the_tokens_of_decoding_without_it(case: str) -> None:
    prompts = book_prompts(4, 500, seed=4)
    if case == "prefix":  # later prompts begin with earlier ones
        prompts += [prompts[0] + prompts[1][:150]]
    kwargs = case_kwargs(case, prompts)
    _, plain = generate(TINY, prompts, GREEDY, **kwargs)
    llm, spec = generate(TINY, prompts, GREEDY, draft_model(3), **kwargs)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    s = llm.stats
    assert 0 < s.spec_decode.num_accepted_tokens < s.spec_decode.num_draft_tokens
    assert case_ran(s, case)
    free, total = free_draft_blocks(llm)
    assert free == total, "the draft kept blocks of finished requests"


def test_an_unrelated_random_draft_leaves_the_random_targets_tokens(qwen3, random_draft) -> None:
    path, _ = qwen3
    prompts = random_prompts(5, seed=8, low=6, high=30)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(block_size=4, num_kv_blocks=36, max_num_batched_tokens=40)
    _, plain = generate(path, prompts, params, **kwargs)
    llm, spec = generate(path, prompts, params, draft_model(3, random_draft), **kwargs)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.stats.spec_decode.num_draft_tokens > 0
    assert llm.stats.preemptions > 0 and llm.stats.partial_prefills > 0


# ---------------------------------------------------------------- sampled requests


def test_drafts_from_a_draft_model_keep_the_target_distribution(qwen3, near_draft) -> None:
    """N requests of one prompt, seeds 0..N-1, with 2 drafts a step from a
    noisy copy of the target: the counts of the first three tokens against the
    enumeration of the target's filtered distribution, chi-square at 1e-3."""
    path, _ = qwen3
    prompt = random_prompts(1, seed=12, low=8, high=9)[0]
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, max_tokens=1)
    exact, _ = enumerate_first_three(LLM(path, dtype="float32"), prompt, params)
    n = 2500
    many = [replace(params, max_tokens=4, seed=s) for s in range(n)]
    llm, outs = generate(path, [prompt] * n, many, draft_model(2, near_draft))
    assert_first_three_are_exact(outs, exact)
    spec = llm.stats.spec_decode
    assert 0.05 * spec.num_draft_tokens < spec.num_accepted_tokens < spec.num_draft_tokens


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_that_is_the_target_has_every_draft_accepted(temperature: float) -> None:
    """q = p, so u * q(x) < p(x) whatever the uniform u: if a draft were drawn
    from another position's stream, or checked against another position's p,
    some would be rejected."""
    params = [
        SamplingParams(temperature=temperature, top_k=4, top_p=0.9, max_tokens=24, seed=s)
        for s in range(8)
    ]
    llm, _ = generate(TINY, book_prompts(8, 200, seed=2), params, draft_model(3, TINY))
    spec = llm.stats.spec_decode
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens


def test_a_seeded_request_keeps_its_tokens_alone_crowded_and_preempted() -> None:
    prompts = book_prompts(5, 300, seed=6)
    first = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=11)
    crowd = [first] + [SamplingParams(temperature=1.0, max_tokens=32)] * 4
    _, [alone] = generate(TINY, prompts[:1], [first], draft_model(3))
    _, crowded = generate(TINY, prompts, crowd, draft_model(3))
    llm, squeezed = generate(TINY, prompts, crowd, draft_model(3), num_kv_blocks=40, block_size=8)
    assert crowded[0].token_ids == alone.token_ids
    assert squeezed[0].token_ids == alone.token_ids
    assert llm.stats.preemptions > 0
    spec = llm.stats.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


# ---------------------------------------------------------------- the draft's cache


def test_the_draft_keeps_the_tokens_it_got_right_and_recomputes_the_rest() -> None:
    assert common_prefix([1, 2, 3, 7, 8], [1, 2, 3, 4, 5, 6], 5) == 3  # wrong from the 4th
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 3) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3], 3) == 2  # the newest is always fed again
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5], 2) == 2  # only what was computed
    kv = DraftKV(num_blocks=6, block_size=2)
    seq = Sequence("a", [5, 6, 7], SamplingParams())
    shadow = kv.catch_up(seq, 4, {"a"})
    assert (shadow.num_computed_tokens, len(shadow.block_table)) == (0, 3)  # 3 + 3 slots
    for guess in (1, 2, 3):
        kv.wrote(shadow, guess)
    seq.token_ids += [1, 9]  # the first guess accepted, the second rejected
    shadow = kv.catch_up(seq, 1, {"a"})
    assert shadow.num_computed_tokens == 4 and shadow.token_ids == [5, 6, 7, 1, 9]
    assert len(shadow.block_table) == 3 and kv.blocks.num_free_blocks == 3
    other = Sequence("b", list(range(9)), SamplingParams())
    assert kv.catch_up(other, 4, {"b"}) is not None  # made room by dropping idle "a"
    assert "a" not in kv.shadows
    assert kv.catch_up(Sequence("c", [1], SamplingParams()), 4, {"b", "c"}) is None


def test_the_target_cache_stays_consistent_with_a_draft_model_and_preemption() -> None:
    rng = random.Random(3)
    llm = LLM(
        TINY, dtype="float32", block_size=4, num_kv_blocks=40, speculative_config=draft_model(3)
    )
    engine = llm.llm_engine
    for i, text in enumerate(book_prompts(5, 120, seed=3)):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(10, 30), seed=i
        )
        engine.add_request(str(i), engine.tokenizer.encode(text).ids, params)
    while engine.has_unfinished_requests():
        engine.step()
        check_blocks(llm)
    assert llm.stats.preemptions > 0 and llm.stats.spec_decode.num_draft_tokens > 0
    assert free_draft_blocks(llm)[0] == free_draft_blocks(llm)[1]


# ---------------------------------------------------------------- the verify length

FLAT = StepTimeProfile((1, 64), (1.0, 1.0))  # every token free: only the budget binds
LINEAR = StepTimeProfile((1, 2), (1.0, 2.0))  # a token costs as much as the step


def sure(*confidence: float) -> Draft:
    return Draft(list(range(len(confidence))), None, confidence)


def test_confident_drafts_get_more_length_within_the_budget() -> None:
    drafts = {"sure": sure(0.9, 0.9, 0.9, 0.9), "unsure": sure(0.3, 0.9, 0.9, 0.9)}
    lengths = choose_lengths(drafts, StepShape(2, 2), budget=5, profile=FLAT)
    assert lengths == {"sure": 4, "unsure": 1}  # 0.9^4 = 0.66 beats 0.3
    assert sum(choose_lengths(drafts, StepShape(2, 2), 3, FLAT).values()) == 3
    assert choose_lengths(drafts, StepShape(2, 2), 0, FLAT) == {"sure": 0, "unsure": 0}


def test_a_draft_is_taken_only_while_it_pays() -> None:
    """With a step's time linear in its tokens, one decode (1 token, 1 sure
    output): a draft of gain g pays when (1 + g) / 2 > 1 / 1, never. With 8
    decodes (8 tokens): the first draft pays when (8 + g) / 9 > 8 / 8, never
    either; and with a flat profile every draft pays."""
    drafts = {"a": sure(0.99, 0.99)}
    assert choose_lengths(drafts, StepShape(1, 1), 8, LINEAR) == {"a": 0}
    assert choose_lengths(drafts, StepShape(1, 1), 8, FLAT) == {"a": 2}
    fixed_cost = StepTimeProfile((1, 100), (1.0, 1.99))  # 1 + 0.01 per token past the first
    lengths = choose_lengths({"a": sure(0.9, 0.5, 0.005)}, StepShape(1, 1), 8, fixed_cost)
    assert lengths == {"a": 2}  # 0.9 and 0.45 pay for 0.01 each; 0.00225 does not


def test_the_schedule_cuts_each_batch_within_its_budget_and_spends_it_on_the_confident() -> None:
    llm = LLM(
        TINY,
        dtype="float32",
        speculative_config=draft_model(4, verify_schedule="confidence", verify_budget=6),
    )
    scheduler = llm.llm_engine.scheduler
    assert isinstance(scheduler.verify_schedule, ConfidenceSchedule)
    scheduler.verify_schedule.profile = FLAT  # the budget alone binds: a deterministic test
    cuts = []
    cut = scheduler.verify_schedule.cut

    def recording(drafts, step):
        chosen = cut(drafts, step)
        cuts.append((drafts, chosen))
        return chosen

    scheduler.verify_schedule.cut = recording
    prompts = book_prompts(6, 200, seed=7)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert cuts and all(sum(len(d) for d in chosen.values()) <= 6 for _, chosen in cuts)
    ordered = 0
    for drafts, chosen in cuts:
        g = {r: gains(d) for r, d in drafts.items()}
        for a in drafts:
            for b in drafts:  # a's every draft more likely accepted than b's
                if len(g[a]) >= len(g[b]) and all(x > y for x, y in zip(g[a], g[b])):
                    assert len(chosen[a]) >= len(chosen[b])
                    ordered += len(chosen[a]) > len(chosen[b])
    assert ordered > 0, "no step gave its confident drafts more length"
