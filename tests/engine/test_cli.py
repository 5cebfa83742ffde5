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
    proc = deepinfer(
        "generate", "--model", str(qwen3[0]), "--dtype", "float32", "--max-tokens", "12", prompt
    )
    assert proc.returncode == 0, proc.stderr
    expected = LLM(qwen3[0], dtype="float32").generate(
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


def test_bench_prints_both_sides_and_the_ratios(qwen3) -> None:
    """The table's numbers agree with each other: 4 prompts of 4 tokens are 16
    output tokens per run on each side, best and median over 2 repeats, and the
    ratios are the rates' quotients; transformers' padding and the decode step's
    floor are stated."""
    proc = deepinfer(
        "bench",
        "--model",
        str(qwen3[0]),
        "--dtype",
        "float32",
        "--num-prompts",
        "4",
        "--input-len",
        "8:16",
        "--output-len",
        "4",
        "--repeats",
        "2",
        "--compare-hf",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    rates = [float(v) for v in table_row(out, "output tokens/s")]
    seconds = [float(v) for v in table_row(out, "total seconds")]
    assert len(rates) == len(seconds) == 4, out  # engine best, median; transformers alike
    for rate, s in zip(rates, seconds):  # printed to 0.1 tokens/s and 0.01 s
        assert 16 / (s + 0.005) - 0.05 <= rate <= 16 / max(s - 0.005, 1e-3) + 0.05, out
    assert rates[0] >= rates[1] and rates[2] >= rates[3], out  # the best is no worse
    for label in ("TTFT mean (ms)", "inter-token mean (ms)"):
        cells = [float(v) for v in table_row(out, label)]
        assert len(cells) == 4 and all(c > 0 for c in cells), out
    rss = [float(v) for v in table_row(out, "peak RSS (MB)")]
    assert len(rss) == 2 and all(r > 0 for r in rss), out
    best, median = re.search(
        r"engine / transformers output tokens/s: ([\d.]+)x best to best, ([\d.]+)x median", out
    ).groups()
    for ratio, (a, b) in ((float(best), rates[0::2]), (float(median), rates[1::2])):
        bound = 0.005 + 0.05 * (1 + ratio) / (b - 0.05)  # rates rounded by 0.05, ratio 0.005
        assert abs(ratio - a / b) <= bound, out
    share = re.search(
        r"decode step at batch 4: ([\d.]+) ms on fresh prompts, ([\d.]+)% of it \(([\d.]+) ms\)",
        out,
    )
    assert share and 0 < float(share[2]) < 100, out
    step, percent, host = map(float, share.groups())  # host = step x share, each rounded
    assert abs(host - step * percent / 100) <= 0.0005 + 0.005 * percent / 100 + step * 0.0005, out
    # The host's share by stage: each stage's mean ms a step, summing to that share.
    stages = re.search(
        r"of which, ms a step: schedule ([\d.]+), inputs ([\d.]+), sampling (-?[\d.]+), "
        r"update ([\d.]+), outputs ([\d.]+), other (-?[\d.]+)",
        out,
    )
    assert stages, out
    parts = [float(v) for v in stages.groups()]
    assert all(v > 0 for v in parts[:2] + parts[3:5]), out  # each traced stage took time
    assert abs(sum(parts) - host) <= 0.0005 * 7 + step * 0.0005 + 0.0005, out
    assert re.search(r"decode step floor: [\d.]+ ms \(matmul .* GFLOP/s", out), out
    mean = re.search(r"4 prompts of 8-16 tokens \(mean (\d+)\), 4 output tokens each", out)
    assert mean and 8 <= int(mean[1]) <= 16, out
    pad = re.search(r"pads every prompt to (\d+) tokens: (\d+) of its (\d+) prefill", out)
    width, padding, positions = map(int, pad.groups())
    assert 8 <= width <= 16 and positions == 4 * width and 0 <= padding <= 4 * (width - 8), out


def test_generate_with_expert_parallelism_and_eplb(deepseek) -> None:
    """Two ranks, EPLB on a clock: the same greedy text as one process."""
    prompt = "def schedule(self):"
    flags = [
        "--dtype",
        "float32",
        "--expert-parallel-size",
        "2",
        "--eplb",
        "--num-redundant-experts",
        "2",
    ]
    proc = deepinfer("generate", "--model", str(deepseek[0]), "--max-tokens", "12", *flags, prompt)
    assert proc.returncode == 0, proc.stderr
    expected = LLM(deepseek[0], dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert proc.stdout == prompt + expected[0].text + "\n"


def test_serve_can_be_batch_invariant(qwen3) -> None:
    """`deepinfer serve --batch-invariant` runs the engine's batch-invariant mode,
    and leaves the compiled decode off unless asked for."""
    from engine.tools.cli import build_parser, serve_engine_config

    parse = build_parser().parse_args
    plain = serve_engine_config(parse(["serve", str(qwen3[0]), "--dtype", "float32"]))
    assert not plain.batch_invariant and plain.compile_decode is None
    args = parse(["serve", str(qwen3[0]), "--dtype", "float32", "--batch-invariant"])
    invariant = serve_engine_config(args)
    assert invariant.batch_invariant and invariant.compile_decode is False
    assert invariant.attention_backend == "torch"  # its split-KV path
