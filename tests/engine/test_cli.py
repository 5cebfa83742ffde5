"""The deepinfer command: generate streams text, bench prints its table, and
bad input is one clear line, not a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from engine import LLM, SamplingParams
from tests.conftest import ROOT


def deepinfer(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "engine.tools.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_generate_streams_the_greedy_completion(qwen3) -> None:
    prompt = "def schedule(self):"
    proc = deepinfer("generate", "--model", str(qwen3[0]), "--max-tokens", "12", prompt)
    assert proc.returncode == 0, proc.stderr
    expected = LLM(qwen3[0]).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert proc.stdout == prompt + expected[0].text + "\n"


def test_generate_reports_a_bad_model_path(tmp_path) -> None:
    proc = deepinfer("generate", "--model", str(tmp_path / "missing"), "hi")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: model path")
    assert "Traceback" not in proc.stderr


def table_row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return line[len(label) :].split()


def test_bench_prints_both_columns_and_the_ratio(qwen3) -> None:
    """The table's numbers agree with each other: 4 prompts of 4 tokens are 16
    output tokens in each column, and the ratio is the two rates' quotient."""
    proc = deepinfer(
        "bench",
        "--model",
        str(qwen3[0]),
        "--num-prompts",
        "4",
        "--input-len",
        "8:16",
        "--output-len",
        "4",
        "--compare-hf",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    rates = [float(v) for v in table_row(out, "output tokens/s")]
    seconds = [float(v) for v in table_row(out, "total seconds")]
    assert len(rates) == len(seconds) == 2, out
    for rate, s in zip(rates, seconds):  # printed to 0.1 tokens/s and 0.01 s
        assert 16 / (s + 0.005) - 0.05 <= rate <= 16 / max(s - 0.005, 1e-3) + 0.05, out
    ttft, itl = table_row(out, "TTFT mean (ms)"), table_row(out, "inter-token mean (ms)")
    assert float(ttft[0]) > 0 and float(itl[0]) > 0 and ttft[1] == itl[1] == "-", out
    ratio = float(re.search(r"engine / transformers output tokens/s: ([\d.]+)x", out)[1])
    # Both rates are rounded by up to 0.05, the ratio by up to 0.005.
    bound = 0.005 + 0.05 * (1 + ratio) / (rates[1] - 0.05)
    assert abs(ratio - rates[0] / rates[1]) <= bound, out
    share = re.search(r"decode step at batch 4: [\d.]+ ms, ([\d.]+)% of it outside", out)
    assert share and 0 < float(share[1]) < 100, out
    mean = re.search(r"4 prompts of 8-16 tokens \(mean (\d+)\), 4 output tokens each", out)
    assert mean and 8 <= int(mean[1]) <= 16, out


def test_generate_with_expert_parallelism_and_eplb(deepseek) -> None:
    """Two ranks, EPLB on a clock: the same greedy text as one process."""
    prompt = "def schedule(self):"
    flags = ["--expert-parallel-size", "2", "--eplb", "--num-redundant-experts", "2"]
    proc = deepinfer("generate", "--model", str(deepseek[0]), "--max-tokens", "12", *flags, prompt)
    assert proc.returncode == 0, proc.stderr
    expected = LLM(deepseek[0]).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert proc.stdout == prompt + expected[0].text + "\n"
