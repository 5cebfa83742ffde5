"""Benchmark the batched sampler against the per-row loop it replaced.

    python -m engine.tools.sampler_bench [--batch 256] [--vocab 151936] [--device cuda]

The per-row loop (one torch.Generator and one filter pass per request, and a
wait for the device per row) lives only here, for the comparison. Before
timing, both are checked to filter to the same distributions and to agree on
greedy rows; then each case prints the two times and their ratio, from one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from engine.sample.sampler import Sampler, SamplingMetadata, SamplingRow, apply_filters
from engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


# --- The per-row sampler the batched one replaced ------------------------------


def request_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    return torch.Generator(device=device).manual_seed(mixed)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def per_row_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    tokens = logits.argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        if row.params.greedy:
            continue
        probs = filter_logits(logits[i].float(), row.params).softmax(-1)
        gen = request_generator(row.seed, row.step, logits.device)
        race = torch.empty_like(probs).exponential_(generator=gen)
        tokens[i] = int((probs / race).argmax())
    return tokens


# --- The comparison ---------------------------------------------------------------

FILTERED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05)
CASES: dict[str, Callable[[int], SamplingParams]] = {
    "temperature only": lambda i: SamplingParams(temperature=1.0),
    "top-k, top-p, min-p": lambda i: FILTERED,
    "half greedy, half filtered": lambda i: FILTERED if i % 2 else SamplingParams(temperature=0),
    "greedy": lambda i: SamplingParams(temperature=0),
}


def batched_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    md = SamplingMetadata.from_rows(rows, logits.shape[-1], logits.device)
    return Sampler()(logits, md).sampled_token_ids.tolist()  # the step's one wait


def check(logits: torch.Tensor, rows: list[SamplingRow]) -> str:
    """The two filter to the same probabilities, and agree where they are greedy."""
    md = SamplingMetadata.from_rows(rows, logits.shape[-1], logits.device)
    if md.random is not None:
        drawn_logits = logits[md.random.rows]
        filtered, ids = apply_filters(drawn_logits, md.random)
        new = filtered.softmax(-1)
        if ids is not None:  # only the candidates, most likely first: put them back
            new = torch.zeros_like(drawn_logits).scatter_(1, ids, new)
        drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
        old = torch.stack([filter_logits(logits[i], rows[i].params) for i in drawn])
        err = (new - old.softmax(-1)).abs().max().item()
        if err > 1e-5:
            return f"FAILED: filtered probabilities differ by {err:.2e}"
    ours, theirs = batched_sample(logits, rows), per_row_sample(logits, rows)
    if any(ours[i] != theirs[i] for i, r in enumerate(rows) if r.params.greedy):
        return "FAILED: greedy rows differ"
    return "ok"


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def run(batch: int, vocab: int, repeats: int, device: torch.device) -> str:
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g, device=device) * 3
    lines = [
        f"sampler: batch {batch}, vocabulary {vocab}, {device}, best of {repeats}",
        "",
        f"{'case':28}{'per-row ms':>12}{'batched ms':>12}{'ratio':>8}  check",
    ]
    ratios = []
    for name, params in CASES.items():
        rows = [SamplingRow(params(i), seed=i, step=7) for i in range(batch)]
        status = check(logits, rows)
        batched_sample(logits, rows)  # warm up (and fill the token-hash cache)
        old = best_ms(lambda rows=rows: per_row_sample(logits, rows), repeats)
        new = best_ms(lambda rows=rows: batched_sample(logits, rows), repeats)
        ratios.append(old / new)
        lines.append(f"{name:28}{old:12.2f}{new:12.2f}{old / new:7.1f}x  {status}")
    lines += ["", f"per-row / batched, geometric mean: {statistics.geometric_mean(ratios):.1f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    print(run(args.batch, args.vocab, args.repeats, torch.device(args.device)))


if __name__ == "__main__":
    main()
