"""Speculative decoding in the engine (engine/spec_decode/): the configuration,
the n-gram proposer, and verification.

Greedy: n-gram speculation gives the tokens of decoding without it, on
deepinfer-tiny and the random tiny checkpoints, under chunked prefill,
preemption and prefix caching. Seeded: a request's tokens with n-gram drafts
are its tokens without them (its one-hot drafts are checked against the very
draws it makes without speculation), alone, in a crowd, preempted and with
another k; with drafts sampled from a q, they are the same alone, in a crowd and
preempted. Sampled: with drafts from an unrelated q, the first three tokens are
distributed as the target's filtered distribution (a chi-square test against
the enumeration). The cache: after every step of a run that speculates and
preempts, reference counts are the holders, each sequence holds blocks for its
computed tokens only, and every block ever published holds real tokens."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.entrypoints.engine_core import CoreStats
from engine.entrypoints.metrics import ServerMetrics
from engine.kv.hashing import chain_hash
from engine.spec_decode import Draft, DraftRequest, SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer, propose_ngram
from engine.stats import EngineStats, SpecDecodeStats
from engine.utils import cdiv
from tests.engine.chi_square import chi_square
from tests.engine.conftest import VOCAB, random_prompts
from tests.engine.test_drafts import use_proposer
from tests.engine.test_rejection_sampler import reference_filter

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "snippets/models/deepinfer-tiny"
DRAFT = ROOT / "snippets/models/deepinfer-tiny-draft"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


def ngram(k: int = 4, **kw: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **kw}


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "config,match",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "must be one of ngram"),
        (ngram(0), "num_speculative_tokens must be >= 1"),
        (ngram(-2), "num_speculative_tokens must be >= 1"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        (ngram(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min <= prompt_lookup_max"),
        (ngram(prompt_lookup_min=0), "1 <= prompt_lookup_min"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/draft"},
            "'/no/such/draft' is not a directory",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 1},
            "'mtp' needs a model with multi-token prediction weights",
        ),
        ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
        (ngram(num_lookahead=3), "unknown key 'num_lookahead'"),
        ('{"method": "ngram", ', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_speculative_configs_fail_at_construction(config, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(TINY, speculative_config=config)


def test_speculation_refuses_async_scheduling() -> None:
    with pytest.raises(ValueError, match="needs async_scheduling=False: a step's drafts"):
        LLM(TINY, speculative_config=ngram(), async_scheduling=True)


def test_the_config_takes_json_as_the_command_line_gives_it() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 7}'
    assert SpeculativeConfig.parse(text) == SpeculativeConfig("ngram", 3, prompt_lookup_max=7)


# ---------------------------------------------------------------- the n-gram proposer


def test_ngram_prefers_the_longest_suffix_and_its_most_recent_occurrence() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 1, 2, 3, 4, 5, 9, 2, 3, 6, 1, 2, 3]
    assert propose_ngram(tokens, 1, 3, 2) == [4, 5]  # [1, 2, 3] at 1, not [2, 3] at 7
    assert propose_ngram(tokens, 1, 2, 2) == [6, 1]  # [2, 3]: its latest, at 7
    assert propose_ngram(tokens, 1, 2, 9) == [6, 1, 2, 3]  # no further than the end
    assert propose_ngram(tokens, 4, 5, 2) == []  # no 4-gram recurs
    assert propose_ngram([5, 6, 7, 8], 1, 3, 4) == []
    # A token whose bytes straddle two others' is no match: 256 packs as 00 01 00 00.
    assert propose_ngram([1, 0, 0, 256, 9, 1], 1, 1, 2) == [0, 0]


def test_ngram_proposer_drafts_only_where_a_match_exists() -> None:
    seqs = [
        DraftRequest("a", SamplingParams(), 0, 2, [1, 2, 3, 1, 2]),
        DraftRequest("b", SamplingParams(), 0, 2, [1, 2]),
    ]
    drafts = NgramProposer(3, 2, 4).propose(seqs)
    assert drafts == {"a": Draft([3, 1, 2])}


# ---------------------------------------------------------------- greedy identity


def book_prompts(n: int, length: int, seed: int) -> list[str]:
    """Windows of the engine's own code: text that prompt lookup can continue."""
    rng = random.Random(seed)
    files = sorted((ROOT / "engine").glob("**/*.py"))
    long = [t for f in files if len(t := f.read_text()) >= 2 * length]  # whole windows only
    texts = rng.sample(long, n)
    return [t[(start := rng.randrange(max(1, len(t) - length))) : start + length] for t in texts]


def generate(path, prompts, params, spec=None, **kwargs) -> tuple[LLM, list]:
    llm = LLM(path, dtype="float32", speculative_config=spec, **kwargs)
    return llm, llm.generate(prompts, params, use_tqdm=False)


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
TINY_CASES = {
    "plain": dict(),
    "chunked": dict(max_num_batched_tokens=48),
    "preempted": dict(num_kv_blocks=40, block_size=8),
    "prefix": dict(enable_prefix_caching=True, block_size=4),
}


def case_kwargs(case: str, prompts: list[str]) -> dict:
    """The engine settings of a case; "preempted" gets a cache of the first two
    prompts' blocks and one more, so that those two run, grow, and one must give
    way, whatever the prompts (book_prompts samples the engine's own files)."""
    kwargs = TINY_CASES[case]
    if case == "preempted":
        tokenizer = LLM(TINY, dtype="float32").llm_engine.tokenizer
        lengths = [len(tokenizer.encode(p).ids) for p in prompts]
        bs = kwargs["block_size"]
        blocks = cdiv(lengths[0], bs) + cdiv(lengths[1], bs) + 1
        # any one request fits whole, drafts and all, so the engine can always finish it
        assert cdiv(max(lengths) + 2 * GREEDY.max_tokens, bs) <= blocks, lengths
        kwargs = dict(kwargs, num_kv_blocks=blocks)
    return kwargs


def case_ran(stats: EngineStats, case: str) -> bool:
    """Did the run do what its case is about: chunk a prompt, preempt, hit the prefix cache?"""
    return {
        "chunked": stats.partial_prefills,
        "preempted": stats.preemptions,
        "prefix": stats.prefix_cache_hit_tokens,
    }[case] > 0


@pytest.mark.parametrize("case", TINY_CASES)
def test_greedy_ngram_gives_the_tokens_of_decoding_without_it(case: str) -> None:
    prompts = book_prompts(4, 600, seed=3)
    if case == "prefix":  # later prompts begin with earlier ones
        prompts += [prompts[0] + prompts[1][:200], prompts[1] + prompts[0][:100]]
    kwargs = case_kwargs(case, prompts)
    _, plain = generate(TINY, prompts, GREEDY, **kwargs)
    llm, spec = generate(TINY, prompts, GREEDY, ngram(4), **kwargs)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    s = llm.stats
    assert s.spec_decode.num_accepted_tokens > 0
    if case != "plain":  # the others each exercise one mechanism
        assert case_ran(s, case)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == len(bm.blocks)


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts that repeat themselves, so that prompt lookup finds matches."""
    return [p + p[: len(p) // 2] + p for p in random_prompts(n, seed, low=6, high=20)]


def test_greedy_ngram_matches_no_speculation_on_the_random_tiny_models(checkpoint) -> None:
    _, path, _ = checkpoint
    prompts = repetitive_prompts(5, seed=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(block_size=4, num_kv_blocks=36, max_num_batched_tokens=40)
    _, plain = generate(path, prompts, params, **kwargs)
    llm, spec = generate(path, prompts, params, ngram(3, prompt_lookup_min=1), **kwargs)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.stats.spec_decode.num_draft_tokens > 0
    assert llm.stats.preemptions > 0 and llm.stats.partial_prefills > 0


# ---------------------------------------------------------------- seeded requests


def one_seeded(prompts, crowd: int, k: int | None, **kwargs) -> list[int]:
    """The first prompt's tokens, seeded, among ``crowd`` other requests."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=11)]
    params += [SamplingParams(temperature=1.0, max_tokens=32)] * crowd
    spec = None if k is None else ngram(k)
    _, outs = generate(TINY, prompts[: 1 + crowd], params, spec, **kwargs)
    return outs[0].token_ids


def test_a_seeded_request_keeps_its_tokens_alone_crowded_preempted_and_with_another_k() -> None:
    prompts = book_prompts(6, 500, seed=5)
    reference = one_seeded(prompts, 0, None)
    assert one_seeded(prompts, 0, 4) == reference
    assert one_seeded(prompts, 5, 4) == reference
    assert one_seeded(prompts, 5, 4, num_kv_blocks=48, block_size=8) == reference
    assert one_seeded(prompts, 5, 2, max_num_batched_tokens=64) == reference


# ---------------------------------------------------------------- drafts drawn from q


class SampledProposer:
    """Drafts drawn from a q that knows nothing of the target: random logits,
    raised on some random tokens, drawn with a stream of the request's seed and
    tokens (so a request gets the same drafts whatever else runs), one after
    the other, each from its own q."""

    def __init__(self, k: int, vocab: int, boost: dict[tuple[int, ...], list[int]] | None = None):
        self.k, self.vocab, self.boost = k, vocab, boost or {}
        self.proposed = 0

    def q(self, context: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        logits = torch.randn(self.vocab, generator=g) * 2
        logits[self.boost.get(context, torch.randint(self.vocab, (6,), generator=g))] += 4
        return logits.softmax(-1)

    def propose(self, seqs: list[DraftRequest]) -> dict[str, Draft]:
        drafts = {}
        for seq in seqs:
            context, tokens, rows = tuple(seq.token_ids), [], []
            g = torch.Generator().manual_seed(hash((seq.seed, context)) & (2**62 - 1))
            for _ in range(self.k):
                rows.append(self.q(context, g))
                tokens.append(torch.multinomial(rows[-1], 1, generator=g).item())
                context += (tokens[-1],)
            drafts[seq.request_id] = Draft(tokens, torch.stack(rows))
            self.proposed += self.k
        return drafts

    def forget(self, req_ids: list[str]) -> None:
        pass  # it keeps nothing between steps


def with_proposer(path, prompts, params, proposer, **kwargs) -> tuple[LLM, list]:
    llm = LLM(path, dtype="float32", **kwargs)
    use_proposer(llm, proposer)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def test_sampled_drafts_keep_a_seeded_request_alone_crowded_and_preempted(qwen3) -> None:
    """q is raised on the tokens the request draws without speculation, so that
    some drafts are accepted and some rejected."""
    path, _ = qwen3
    prompts = random_prompts(6, seed=4, low=20, high=40)
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=24, seed=3)]
    params += [SamplingParams(temperature=1.0, max_tokens=24)] * 5
    _, [plain] = generate(path, prompts[:1], params[:1])
    tokens = prompts[0] + plain.token_ids
    likely = {tuple(tokens[:i]): [tokens[i]] for i in range(len(prompts[0]), len(tokens))}
    runs = [
        with_proposer(path, prompts[:1], params[:1], SampledProposer(3, VOCAB, likely)),
        with_proposer(path, prompts, params, SampledProposer(3, VOCAB, likely)),
        with_proposer(
            path,
            prompts,
            params,
            SampledProposer(3, VOCAB, likely),
            num_kv_blocks=20,
            block_size=4,
        ),
    ]
    first = [outs[0].token_ids for _, outs in runs]
    assert first[1] == first[0] and first[2] == first[0]
    assert runs[2][0].stats.preemptions > 0
    for llm, _ in runs:
        spec = llm.stats.spec_decode
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_sampled_drafts_keep_the_target_distribution(qwen3) -> None:
    """N requests of one prompt, seeds 0..N-1, each drafting 2 tokens from q after
    its first: the counts of the first three tokens against the enumeration of
    the target's filtered distribution (the model's logprobs, then temperature,
    top-k and top-p as the engine applies them), chi-square at alpha = 1e-3."""
    path, _ = qwen3
    prompt = random_prompts(1, seed=12, low=8, high=9)[0]
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, max_tokens=1)
    raw = LLM(path, dtype="float32")
    exact, tops = enumerate_first_three(raw, prompt, params)
    n = 3000
    proposer = SampledProposer(2, VOCAB, boost=tops)
    many = [replace(params, max_tokens=4, seed=s) for s in range(n)]
    llm, outs = with_proposer(path, [prompt] * n, many, proposer)
    assert_first_three_are_exact(outs, exact)
    spec = llm.stats.spec_decode
    assert 0.1 * spec.num_draft_tokens < spec.num_accepted_tokens < spec.num_draft_tokens


def assert_first_three_are_exact(outs: list, exact: dict[tuple[int, ...], float]) -> None:
    """The outputs' first three tokens, counted, against their exact distribution:
    nothing outside its support, and a chi-square below the 1e-3 critical value."""
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids[:3])] = counts.get(tuple(o.token_ids[:3]), 0) + 1
    cells = list(exact)
    assert set(counts) <= set(cells), "a token outside the filtered support"
    observed = torch.tensor([counts.get(c, 0) for c in cells])
    stat, critical = chi_square(observed, torch.tensor([exact[c] for c in cells]))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


def enumerate_first_three(
    llm: LLM, prompt: list[int], params: SamplingParams
) -> tuple[dict[tuple[int, ...], float], dict[tuple[int, ...], list[int]]]:
    """P(t1, t2, t3) over the filtered support, from the model's own logprobs at
    each prefix; and each prefix's likeliest tokens (for the proposer's q)."""
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    tops: dict[tuple[int, ...], list[int]] = {}
    for _ in range(3):
        prefixes = list(exact)
        full = [prompt + list(p) for p in prefixes]
        raw = SamplingParams(temperature=0, max_tokens=1, logprobs=VOCAB)
        outs = llm.generate(full, raw, use_tqdm=False)
        grown = {}
        for prefix, tokens, out in zip(prefixes, full, outs):
            logprobs = out.logprobs[0]
            logits = torch.tensor([logprobs[t] for t in range(VOCAB)])
            p = reference_filter(logits[None], params)[0]
            tops[tuple(tokens)] = logits.topk(6).indices.tolist()
            for t in p.nonzero().flatten().tolist():
                grown[prefix + (t,)] = exact[prefix] * p[t].item()
        exact = grown
    return exact, tops


# ---------------------------------------------------------------- the cache


def check_blocks(llm: LLM) -> set[bytes]:
    """After a step: reference counts are the holders, each running sequence holds
    blocks for its computed tokens and no more, and its hash chain is its
    tokens'. Returns the hashes now published."""
    engine = llm.llm_engine
    bm, bs = engine.block_manager, engine.block_manager.block_size
    holders: dict[int, int] = {}
    for seq in engine.scheduler.running:
        assert len(seq.block_table) == cdiv(seq.num_computed_tokens, bs)
        assert seq.num_computed_tokens <= seq.num_tokens
        for block_id in seq.block_table:
            holders[block_id] = holders.get(block_id, 0) + 1
        parent = bm.root
        for i, h in enumerate(seq.block_hashes):
            parent = chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            assert h == parent
    for seq in engine.scheduler.waiting:
        assert seq.block_table == []
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    assert bm.num_free_blocks + len(holders) == len(bm.blocks)
    return set(bm.cached_blocks)


def real_chains(llm: LLM, token_lists: list[list[int]]) -> set[bytes]:
    """The hash of every full block of every request's real tokens."""
    bm = llm.llm_engine.block_manager
    hashes = set()
    for tokens in token_lists:
        parent = bm.root
        for i in range(len(tokens) // bm.block_size):
            parent = chain_hash(parent, tokens[i * bm.block_size : (i + 1) * bm.block_size])
            hashes.add(parent)
    return hashes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blocks_stay_consistent_after_every_step_of_speculation_and_preemption(seed: int) -> None:
    rng = random.Random(seed)
    llm = LLM(
        TINY,
        dtype="float32",
        block_size=4,
        num_kv_blocks=rng.randint(32, 44),
        speculative_config=ngram(rng.randint(2, 6), prompt_lookup_min=1),
    )
    engine = llm.llm_engine
    prompts = [engine.tokenizer.encode(p).ids for p in book_prompts(6, rng.randint(80, 160), seed)]
    for i, p in enumerate(prompts):
        temp = rng.choice([0.0, 0.8])
        params = SamplingParams(temperature=temp, max_tokens=rng.randint(10, 40), seed=i)
        engine.add_request(str(i), p, params)
    published, finished = set(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.prompt_token_ids + out.token_ids
        published |= check_blocks(llm)
    assert llm.stats.preemptions > 0 and llm.stats.spec_decode.num_draft_tokens > 0
    assert llm.stats.spec_decode.num_accepted_tokens < llm.stats.spec_decode.num_draft_tokens
    assert published <= real_chains(llm, list(finished.values())), "a rejected draft published"
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


# ---------------------------------------------------------------- statistics


# A prompt that repeats itself, so that prompt lookup drafts and some drafts are
# accepted. Fixed here: a window of the engine's own files (book_prompts) moves with
# every change to them, and some windows get no draft accepted at all.
REPEATING = "def add(a, b):\n    return a + b\n\n" * 12


def test_stats_count_drafts_acceptance_and_forwards() -> None:
    llm, outs = generate(TINY, [REPEATING], GREEDY, ngram(5))
    s = llm.stats
    spec = s.spec_decode
    assert sum(spec.accepted_lengths) == spec.num_drafts > 0
    assert sum(n * c for n, c in enumerate(spec.accepted_lengths)) == spec.num_accepted_tokens
    assert len(spec.accepted_lengths) <= 6
    assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert spec.acceptance_rate == spec.num_accepted_tokens / spec.num_draft_tokens
    assert s.forwards_per_output_token == s.steps / len(outs[0].token_ids) < 1


def test_metrics_show_speculation() -> None:
    metrics = ServerMetrics("m")
    first = SpecDecodeStats(2, 8, 5, [0, 1, 0, 0, 1], [1, 0, 0, 0, 2])
    later = SpecDecodeStats(3, 12, 5, [1, 1, 0, 0, 1], [1, 0, 0, 0, 3])
    for spec, fwd in ((first, 0.5), (later, 0.6)):
        metrics.core_stats(CoreStats(1, 0, 0.1, 0, spec, fwd))
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    assert value("deepinfer:spec_decode_num_drafts_total", labels) == 3
    assert value("deepinfer:spec_decode_num_draft_tokens_total", labels) == 12
    assert value("deepinfer:spec_decode_num_accepted_tokens_total", labels) == 5
    assert value("deepinfer:spec_decode_accepted_length_count", labels) == 3
    assert value("deepinfer:spec_decode_accepted_length_sum", labels) == 5
    assert value("deepinfer:spec_decode_accepted_length_bucket", {**labels, "le": "0.0"}) == 1
    assert value("deepinfer:spec_decode_chosen_length_count", labels) == 4
    assert value("deepinfer:spec_decode_chosen_length_sum", labels) == 12
    assert value("deepinfer:spec_decode_chosen_length_bucket", {**labels, "le": "0.0"}) == 1
    assert value("deepinfer:spec_decode_forwards_per_output_token", labels) == 0.6


# ---------------------------------------------------------------- structured output

WORDS = r"((prefill|decode|tokens|blocks) ){6,12}"


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_drafts_under_a_grammar_are_masked_at_every_verified_position(temperature: float) -> None:
    """Prompt lookup proposes from the prompt, whose words the grammar only
    partly allows: the drafts it allows are verified, each position under its
    own mask, and the output is the output without speculation, and valid."""
    from engine import StructuredOutputsParams

    prompts = ["blocks decode prefill tokens, prefill decode: " * 3, "decode tokens blocks " * 4]
    params = SamplingParams(
        temperature=temperature,
        seed=7,
        max_tokens=64,
        structured_outputs=StructuredOutputsParams(regex=WORDS),
    )
    _, plain = generate(TINY, prompts, params)
    llm, spec = generate(TINY, prompts, params, ngram(4, prompt_lookup_min=1))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(re.fullmatch(WORDS, o.text) for o in spec), [o.text for o in spec]
    assert all(o.finish_reason == "stop" for o in spec)  # the grammar completed
    assert llm.stats.spec_decode.num_accepted_tokens > 0
