"""The async-scheduling benchmark runs at a size a test can afford, and reports
a row for each setting and a ratio for each batch. It asserts no speed."""

from __future__ import annotations

import re

import pytest
import torch

from engine.core.trace import Span
from engine.tools.overlap_bench import busy_seconds, run


def test_overlap_bench_reports_both_settings_and_their_ratios(qwen3) -> None:
    out = run(str(qwen3[0]), [2, 3], (3, 6), output_len=3)
    for batch in (2, 3):
        for setting in ("off", "on"):
            row = rf"^\s+{batch}\s+{setting}\s+[\d.]+\s+[\d.]+%\s+0$"
            assert re.search(row, out, re.M), out
        assert re.search(rf"^\s+{batch}\s+[\d.]+x\s+([\d.]+|nan)x$", out, re.M), out


def test_busy_time_counts_overlapping_forwards_once() -> None:
    spans = [
        Span(1, "forward", "gpu", 0.0, 2.0),
        Span(2, "forward", "gpu", 1.0, 3.0),  # overlaps the first
        Span(3, "forward", "gpu", 5.0, 6.0),
        Span(3, "forward", "main", 3.0, 5.0),  # another lane
        Span(3, "update", "gpu", 3.0, 5.0),  # another stage
    ]
    assert busy_seconds(spans, "gpu", 0.0, 10.0) == 4.0
    assert busy_seconds(spans, "gpu", 1.5, 5.5) == 2.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the GPU run measures")
def test_the_gpu_run_says_that_no_gpu_was_lent(qwen3) -> None:
    out = run(str(qwen3[0]), [2], (3, 6), output_len=3, device="cuda")
    assert "no GPU was lent" in out and "requests" not in out
