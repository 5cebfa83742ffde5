"""engine/tools/kv_quality.py, the table `deepinfer bench --kv-quality` prints,
at small sizes: exact agrees with a separate exact run everywhere, fp8 and int8
take fewer bytes per token than exact, a window that bites changes the
perplexity and holds fewer blocks, and every perplexity is finite."""

from __future__ import annotations

import math

import pytest
import torch

from engine.tools.cli import build_parser
from engine.tools.kv_quality import DSA_MODEL, Sizes, format_rows, measure

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
    dense, sparse = [r for r in rows if r.model == DSA_MODEL]
    assert dense.agreement == 1.0 and dense.first_difference is None
    assert sparse.cache == "DSA top-k 8"
    for r in rows:
        assert math.isfinite(r.perplexity) and r.perplexity > 1, r
        assert 0 <= r.agreement <= 1 and r.bytes_per_token > 0
    table = format_rows(rows)
    assert all(r.cache in table for r in rows)


def test_bench_takes_the_flag_without_a_model() -> None:
    args = build_parser().parse_args(["bench", "--kv-quality"])
    assert args.kv_quality and args.model is None
