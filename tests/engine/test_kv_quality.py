"""engine/tools/kv_quality.py, the table `deepinfer bench --kv-quality` prints,
at small sizes: exact agrees with a separate exact run everywhere, fp8 and int8
take fewer bytes per token than exact, a window that bites changes the
perplexity and holds fewer blocks, and every perplexity is finite; the
bootstrap's intervals hold their estimates, exact's gap to itself is nothing,
and teacher-forced agreement counts a flip once where free-running counts every
position after it."""

from __future__ import annotations

import math

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tools.cli import build_parser
from engine.tools.kv_quality import (
    DEFAULT_MODELS,
    DSA_MODEL,
    Sizes,
    WindowScore,
    bootstrap,
    forced_agreement,
    format_rows,
    measure,
    perplexity,
    resamples,
)

# Windows of 48 tokens scored in 8-token chunks; 8-token prompts and 24 generated
# tokens: 4 blocks of 8 without a window, at most 3 with 4 sinks and 8 recent.
SIZES = Sizes(
    context=48,
    heldout_tokens=192,
    num_prompts=2,
    prompt_len=8,
    gen_tokens=24,
    block_size=8,
    window=(4, 8),
    index_topk=8,
)


@pytest.fixture(scope="module")
def rows():
    threads = torch.get_num_threads()
    rows = measure(sizes=SIZES)
    assert torch.get_num_threads() == threads  # measure ran on one, and put them back
    return rows


def test_the_rows_hold_what_the_caches_promise(rows) -> None:
    models = list(dict.fromkeys(r.model for r in rows))
    assert models == ["deepinfer-tiny", "deepinfer-tiny-moe", DSA_MODEL]
    for model in models[:2]:
        by = {r.cache: r for r in rows if r.model == model}
        assert list(by) == ["exact", "fp8_e4m3", "int8", "window 4+8"]
        exact, window = by["exact"], by["window 4+8"]
        assert (exact.agreement, exact.first_difference, exact.bytes_ratio) == (1.0, None, 1.0)
        assert by["fp8_e4m3"].bytes_ratio < 1 and by["int8"].bytes_ratio < 1
        assert window.bytes_ratio == 1.0 and window.peak_blocks < exact.peak_blocks
        assert window.perplexity != exact.perplexity  # the window bites
        assert exact.gap_interval == (0.0, 0.0) and exact.forced_agreement == 1.0
    first_of = {r.model: r.perplexity for r in reversed(rows)}  # each table's first row
    dense, sparse = [r for r in rows if r.model == DSA_MODEL]
    assert dense.agreement == 1.0 and dense.first_difference is None
    assert sparse.cache == "DSA top-k 8"
    for r in rows:
        assert math.isfinite(r.perplexity) and r.perplexity > 1, r
        assert 0 <= r.agreement <= 1 and r.bytes_per_token > 0
        low, high = r.perplexity_interval
        assert low <= r.perplexity <= high, r
        assert r.gap_interval[0] <= r.perplexity - first_of[r.model] <= r.gap_interval[1], r
        assert 0 <= r.forced_agreement <= 1
    # On the trained models, a reply that flips early loses every later position
    # free-running, and few forced.
    trained = [r for r in rows if r.model != DSA_MODEL]
    flipped = [r for r in trained if r.first_difference is not None and r.first_difference < 4]
    assert flipped and all(r.forced_agreement > r.agreement for r in flipped)
    table = format_rows(rows)
    assert all(r.cache in table for r in rows)


def test_bench_takes_the_flag_without_a_model() -> None:
    args = build_parser().parse_args(["bench", "--kv-quality"])
    assert args.kv_quality and args.model is None


def test_the_gap_interval_is_paired() -> None:
    """Windows whose perplexities differ widely make a wide interval for each
    cache; a cache that adds the same NLL to every window still has a gap
    interval above zero, because the windows are drawn alike for both."""
    text = [WindowScore(nll=n * 10.0, tokens=10) for n in (2, 3, 4, 5, 6, 7)]
    worse = [WindowScore(nll=s.nll + 0.5, tokens=10) for s in text]
    draws = resamples(len(text), draws=500)
    (low, high), (gap_low, gap_high) = bootstrap(worse, text, draws)
    assert low < perplexity(worse) < high and high - low > 100
    assert 0 < gap_low < gap_high < high - low
    assert bootstrap(text, text, draws)[1] == (0.0, 0.0)


def test_forced_agreement_compares_each_reply_position_once() -> None:
    """Along the engine's own greedy replies every position is its top 1; change
    each reply's last token and exactly one position a reply stops agreeing."""
    llm = LLM(DEFAULT_MODELS[0], dtype="float32", block_size=8, seed=0)
    prompts = [[5, 9, 14, 2, 7], [11, 3, 8]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    replies = [
        o.token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    ]
    assert forced_agreement(llm, prompts, replies) == 1.0
    changed = [r[:-1] + [(r[-1] + 1) % 50] for r in replies]
    assert forced_agreement(llm, prompts, changed) == 1 - 1 / 6
