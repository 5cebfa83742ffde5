"""The deepinfer command: generate streams text, bench prints its table, and
bad input is one clear line, not a traceback."""

from __future__ import annotations

import os
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


def test_bench_prints_both_columns_and_the_ratio(qwen3) -> None:
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
    for row in (
        "output tokens/s",
        "TTFT mean (ms)",
        "inter-token mean (ms)",
        "outside the model forward",
        "engine / transformers output tokens/s",
    ):
        assert row in out, out
