"""The sampler benchmark runs, and its checks pass, at a size a test can afford."""

from __future__ import annotations

import re

import torch

from engine.tools.sampler_bench import CASES, run


def test_sampler_bench_checks_pass_and_every_case_has_a_ratio() -> None:
    out = run(batch=8, vocab=500, repeats=1, device=torch.device("cpu"))
    for case in CASES:
        row = re.search(rf"^{re.escape(case)}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x  (.*)$", out, re.M)
        assert row, out
        assert row[4] == "ok", out
    assert re.search(r"geometric mean: [\d.]+x$", out), out
