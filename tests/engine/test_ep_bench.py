"""The expert-parallel benchmark runs at a size a test can afford, and its table
holds together: a row per size, the first size's ratios 1.00, the same tokens."""

from __future__ import annotations

import re

from engine.tools.ep_bench import run


def test_ep_bench_prints_a_ratio_row_per_size(deepseek) -> None:
    out = run(str(deepseek[0]), sizes=(1, 2), num_prompts=2, input_len=8, output_len=3)
    rows = re.findall(
        r"^\s+(\d)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)\s+([\d.]+)x\s+([\d,]+)  (\w+)$", out, re.M
    )
    assert [r[0] for r in rows] == ["1", "2"], out
    assert rows[0][2] == rows[0][4] == "1.00", out
    assert rows[0][5] == "0" and rows[1][5] != "0", out  # one process sends nothing
    assert all(r[6] == "same" for r in rows), out
