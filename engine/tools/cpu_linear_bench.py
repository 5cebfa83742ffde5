"""A tied output head on the CPU: F.linear (x Wᵀ) against SharedWeightLinear
(engine/layers/linear.py), which takes a single row through torch.mv (W x), by
oneDNN or by torch's own GEMV, a few rows through the engine's C++ operator
where the CPU suits it (engine/csrc/bf16_linear.cpp), and more rows through
F.linear. One column for each of the two one-row kernels and one for the
operator, up to FEW_ROWS rows; it also prints which the engine takes on this
CPU (one_row_kernel, few_rows_kernel).

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

from engine import csrc
from engine.layers.linear import FEW_ROWS, SharedWeightLinear, few_rows_kernel, one_row_kernel
from engine.tools.sampler_bench import best_ms

BATCHES = (1, 2, 4, 8, 64, 256)


def check(head: nn.Linear, sides: dict[str, nn.Module], x: torch.Tensor) -> str:
    """Every side within bfloat16's rounding of the float64 product."""
    exact = x.double() @ head.weight.double().T
    scale = exact.abs().max().item()
    for name, layer in {"F.linear": head, **sides}.items():
        err = (layer(x).double() - exact).abs().max().item() / scale
        if err > 2e-2:  # bfloat16 keeps 8 bits of mantissa
            return f"FAILED: {name} is off by {err:.2e} of the largest logit"
    return "ok"


def run(vocab: int, hidden: int, repeats: int, batches: tuple[int, ...] = BATCHES) -> str:
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) / hidden**0.5)
    one = {k: SharedWeightLinear(head, one_row=k, few_rows=False) for k in ("onednn", "torch")}
    operator = SharedWeightLinear(head, one_row="linear", few_rows=True) if csrc.load() else None
    weight_gb = vocab * hidden * 2 / 1e9
    lines = [
        f"tied output head: vocabulary {vocab}, hidden {hidden}, bfloat16, "
        f"{torch.get_num_threads()} threads, best of {repeats}",
        f"the engine takes {one_row_kernel()!r} for one row here, and for 2 to {FEW_ROWS} "
        f"rows {'the operator' if few_rows_kernel() else 'F.linear'}",
        "ms of F.linear, of torch.mv by each one-row kernel, and of the C++ operator",
        "",
        f"{'batch':>6}{'F.linear':>10}{'onednn':>8}{'torch':>8}{'C++ op':>8}{'ratio':>7}"
        f"{'GB/s':>6}  check",
    ]
    with torch.inference_mode():
        for batch in batches:
            x = torch.randn(batch, hidden, generator=gen).to(torch.bfloat16)
            sides: dict[str, nn.Module] = one if batch == 1 else {}
            if operator is not None and 1 < batch <= FEW_ROWS:
                sides = {"C++ op": operator}
            lines.append(f"{batch:>6}" + timed(head, sides, x, repeats, weight_gb))
    return "\n".join(lines)


def timed(
    head: nn.Linear, sides: dict[str, nn.Module], x: torch.Tensor, repeats: int, gb: float
) -> str:
    """One batch's columns: each side's fastest ms (- where it does not apply),
    F.linear's time over the fastest other side's, and that side's GB/s."""
    status = check(head, sides, x)
    layers = [head, *sides.values()]
    times: list[list[float]] = [[] for _ in layers]
    for layer in layers:
        layer(x)  # warm up
    for _ in range(repeats):  # take turns, so that all see the same machine
        for layer, took in zip(layers, times):
            took.append(best_ms(lambda layer=layer, x=x: layer(x), 1))
    ms = dict(zip(["F.linear", *sides], (min(t) for t in times)))
    cells = [f"{ms[k]:8.2f}" if k in ms else f"{'-':>8}" for k in ("onednn", "torch", "C++ op")]
    best = min((v for k, v in ms.items() if k != "F.linear"), default=ms["F.linear"])
    return (
        f"{ms['F.linear']:10.2f}{''.join(cells)}{ms['F.linear'] / best:6.2f}x"
        f"{gb / (best / 1e3):6.1f}  {status}"
    )


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
