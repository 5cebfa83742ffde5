"""Benchmark async scheduling: the engine with async_scheduling off and on, on
the same requests, in one run, each setting in a process of its own.

    python -m engine.tools.overlap_bench [--model PATH] [--num-prompts 64 256]
                                         [--output-len 32] [--device cuda]

For each batch it reports output tokens per second and the share of wall time
in which no forward pass was running ("forward idle"), read from the engine's
step trace (engine/core/trace.py), and the ratios on/off. On a CPU the forward is
timed on the thread that runs it; on a GPU (--device cuda) the trace times it
with CUDA events on the stream, so "forward idle" is the GPU's idle time
between kernels of consecutive steps. Every run generates exactly output-len
tokens per request (ignore_eos), so both settings do the same work.

The GPU run, prepared for a machine with one (on a machine without, it says
that no GPU was lent and measures nothing):

    python -m engine.tools.overlap_bench --device cuda --num-prompts 64 256
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

from engine.core.trace import Span
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tools.bench import in_own_process, random_prompts

DEFAULT_MODEL = "snippets/models/deepinfer-tiny"


@dataclass
class Measured:
    seconds: float
    output_tokens: int
    forward_idle: float  # share of the wall time with no forward pass running
    discarded: int  # late-finish tokens: none here, as every request ends by length

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _start(span: Span) -> float:
    return span.start


def busy_seconds(spans: list[Span], lane: str, start: float, end: float) -> float:
    """How long, between start and end, at least one forward ran on ``lane``."""
    busy, reached = 0.0, start
    for s in sorted((s for s in spans if s.stage == "forward" and s.lane == lane), key=_start):
        lo, hi = max(s.start, reached), min(s.end, end)
        if hi > lo:
            busy += hi - lo
            reached = hi
    return busy


def measure(llm: LLM, prompts: list[list[int]], output_len: int) -> Measured:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    first = len(engine.trace.spans)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    spans = engine.trace.spans[first:]
    window = (min(s.start for s in spans), max(s.end for s in spans))
    lane = "gpu" if engine.config.device.startswith("cuda") else None
    if lane is None:  # the forward's thread: the worker with async on, else main
        lane = "worker" if engine.config.async_scheduling else "main"
    busy = busy_seconds(spans, lane, *window)
    tokens = sum(len(o.token_ids) for o in outputs)
    return Measured(seconds, tokens, 1 - busy / (window[1] - window[0]), llm.stats.discarded_tokens)


def side(
    model: str,
    batch: int,
    async_scheduling: bool,
    input_len: tuple[int, int],
    output_len: int,
    device: str | None,
    seed: int,
    threads: int,
) -> tuple[Measured, str]:
    """One setting, in a process of its own (in_own_process): on a CPU, a second
    thread that has run torch's parallel operators slows every forward pass
    after it (runner/torch_thread.py), so the settings cannot share a process."""
    torch.set_num_threads(threads)
    llm = LLM(
        model,
        seed=seed,
        device=device,
        max_num_seqs=batch,
        async_scheduling=async_scheduling,
        trace=True,
    )
    vocab = llm.llm_engine.config.hf_config.vocab_size
    prompts = random_prompts(batch, *input_len, vocab, seed)
    # Warm up on these very requests: torch's first passes at new shapes are slow.
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    cfg = llm.llm_engine.config
    setup = f"{cfg.device}, {str(cfg.dtype).removeprefix('torch.')}"
    return measure(llm, prompts, output_len), setup


def run(
    model: str,
    batches: list[int],
    input_len: tuple[int, int],
    output_len: int,
    device: str | None = None,
    seed: int = 0,
    threads: int = 1,
) -> str:
    lines = []
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        return (
            f"--device {device}: no GPU was lent to this run, so nothing was measured.\n"
            "  Run the same command where torch sees a GPU."
        )
    if device is None and not torch.cuda.is_available():
        lines += [
            "no GPU here: this run is on the CPU. On a machine with one,",
            "  --device cuda measures the GPU's idle time from CUDA events.",
        ]
    results, setup = {}, ""
    for batch in batches:
        for async_scheduling in (False, True):
            args = model, batch, async_scheduling, input_len, output_len, device, seed, threads
            results[batch, async_scheduling], setup = in_own_process(side, *args)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines += [
        f"model {model}; {setup}, {threads} torch threads; each setting in its own process",
        f"{os.cpu_count()} CPUs, load average {load:.1f} (other processes' too)",
        f"prompts of {input_len[0]}-{input_len[1]} tokens, {output_len} output tokens each",
        "",
        f"{'requests':>8} {'async':>5} {'tokens/s':>9} {'forward idle':>13} {'discarded':>9}",
    ]
    for batch in batches:
        for a in (False, True):
            r = results[batch, a]
            on = "on" if a else "off"
            lines.append(
                f"{batch:>8} {on:>5} {r.tokens_per_s:>9.1f} {r.forward_idle:>13.1%}"
                f" {r.discarded:>9}"
            )
    lines += ["", f"{'requests':>8} {'tokens/s on/off':>16} {'forward idle on/off':>20}"]
    for batch in batches:
        off, on = results[batch, False], results[batch, True]
        idle = on.forward_idle / off.forward_idle if off.forward_idle > 0 else float("nan")
        lines.append(f"{batch:>8} {on.tokens_per_s / off.tokens_per_s:>15.2f}x {idle:>19.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--input-len", default="16:64", help="A:B, uniform prompt lengths")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's intra-op threads, for the forward on either thread (default 1)",
    )
    args = parser.parse_args()
    low, _, high = args.input_len.partition(":")
    print(
        run(
            args.model,
            args.num_prompts,
            (int(low), int(high or low)),
            args.output_len,
            args.device,
            args.seed,
            args.threads,
        )
    )


if __name__ == "__main__":
    main()
