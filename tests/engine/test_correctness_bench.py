"""The correctness benchmark runs at a size a test can afford, and prints every row."""

from __future__ import annotations

import re

from engine.tools.correctness_bench import main


def test_correctness_bench_prints_ratios_counts_and_mask_share(capsys) -> None:
    main(["--requests", "4", "--max-tokens", "3", "--repeats", "5", "--rounds", "1"])
    out = capsys.readouterr().out
    assert re.search(r"off / on: [\d.]+x$", out, re.M), out
    counts = re.findall(r"mode (off|on): (\d+) distinct$", out, re.M)
    assert [mode for mode, _ in counts] == ["off", "on"], out
    assert counts[1][1] == "1", out  # the mode's guarantee, at any size
    assert re.search(r"masks [\d.]+ ms of a [\d.]+ ms step \([\d.]+%\)$", out, re.M), out
