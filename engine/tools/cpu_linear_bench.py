"""A tied output head on the CPU: F.linear (x Wᵀ) against SharedWeightLinear
(engine/layers/linear.py) with torch.mv (W x) for a single row, more rows
through F.linear. It also prints which of the two the engine takes for one
row on this CPU (gemv_reads_faster).

    python -m engine.tools.cpu_linear_bench [--vocab 151936] [--hidden 1024] [--threads N]

A tied head cannot be packed for oneDNN without a second copy of the embedding
table, so it multiplies a row-major weight. Both sides are first checked
against the float64 reference on the same random inputs; then each row times
one call at a batch size, the two sides taking turns, and reports the fastest
of each side's repeats and their ratio, from the same run. The weight is larger
than the caches at the default size, as a real vocabulary's is.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from engine.layers.linear import SharedWeightLinear, gemv_reads_faster
from engine.tools.sampler_bench import best_ms

BATCHES = (1, 8, 64, 256)


def check(head: nn.Linear, ours: SharedWeightLinear, x: torch.Tensor) -> str:
    """Both within bfloat16's rounding of the float64 product."""
    exact = x.double() @ head.weight.double().T
    scale = exact.abs().max().item()
    for name, got in (("F.linear", head(x)), ("SharedWeightLinear", ours(x))):
        err = (got.double() - exact).abs().max().item() / scale
        if err > 2e-2:  # bfloat16 keeps 8 bits of mantissa
            return f"FAILED: {name} is off by {err:.2e} of the largest logit"
    return "ok"


def run(vocab: int, hidden: int, repeats: int, batches: tuple[int, ...] = BATCHES) -> str:
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) / hidden**0.5)
    ours = SharedWeightLinear(head, gemv=True)
    weight_gb = vocab * hidden * 2 / 1e9
    lines = [
        f"tied output head: vocabulary {vocab}, hidden {hidden}, bfloat16, "
        f"{torch.get_num_threads()} threads, best of {repeats}",
        f"the engine takes {'torch.mv' if gemv_reads_faster() else 'F.linear'} for one row here",
        "",
        f"{'batch':>6}{'F.linear ms':>13}{'ours ms':>9}{'ratio':>8}{'ours GB/s':>11}  check",
    ]
    with torch.inference_mode():
        for batch in batches:
            x = torch.randn(batch, hidden, generator=gen).to(torch.bfloat16)
            status = check(head, ours, x)
            head(x), ours(x)  # warm up
            old, new = [], []
            for _ in range(repeats):  # take turns, so that both see the same machine
                old.append(best_ms(lambda x=x: head(x), 1))
                new.append(best_ms(lambda x=x: ours(x), 1))
            a, b = min(old), min(new)
            lines.append(
                f"{batch:>6}{a:13.2f}{b:9.2f}{a / b:7.2f}x{weight_gb / (b / 1e3):11.1f}  {status}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen3's
    parser.add_argument("--hidden", type=int, default=1024)  # Qwen3-0.6B's
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(run(args.vocab, args.hidden, args.repeats))


if __name__ == "__main__":
    main()
