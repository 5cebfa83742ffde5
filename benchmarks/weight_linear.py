"""One linear layer, each weight format the engine serves, on this CPU.

    python benchmarks/weight_linear.py                    # Qwen3-0.6B's MLP shapes
    python benchmarks/weight_linear.py --shapes 1024x3072 --batches 1,8 --threads 2

For each shape (in x out) and batch, the median time of y = x W^T (+ nothing) in
bfloat16 activations from: bf16 row-major (F.linear), bf16 packed for oneDNN (the
engine's PackedLinear), DeepSeek FP8 with 128 x 128 block scales (the engine's
Fp8Linear: the C++ operator up to 16 tokens, else row tiles dequantized by torch
then F.linear; and the tiles alone), torch._scaled_mm (FP8
activations too, one scale per tensor: the only FP8 GEMM torch has on a CPU; not
what a block-scaled checkpoint needs, shown for scale), int8 and int4 (the
engine's int8_linear and int4_linear: up to 16 rows through their C++
operators, more dequantized a slice at a time, then F.linear; and torch's own
kernels alone, aten _weight_int8pack_mm and _weight_int4pack_mm_for_cpu, the
latter on its own layout). It prints each time, its ratio to packed bf16 and
the weight bytes read per second. One run, on
whatever else the machine is doing: read the ratios. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.layers.quantization.fp8 import (
    FP8,
    expand_block_scales,
    fp8_linear,
    fp8_tiled_linear,
)
from engine.layers.quantization.int_weight import (
    int4_linear,
    int4_pack,
    int4_quantize,
    int8_linear,
    int8_quantize,
)


def times_us(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, fastest) of ``repeats`` calls, after three to warm up: on a
    shared machine the fastest is the nearer to what the code costs alone."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, min(times) * 1e6


def median_us(fn: Callable[[], object], repeats: int) -> float:
    return times_us(fn, repeats)[0]


def formats(w: torch.Tensor, x: torch.Tensor) -> dict[str, tuple[Callable[[], object], float]]:
    """Each format's call, and its weight bytes."""
    rows, cols = w.shape
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    q8 = (w.float() / 2.0**-6).clamp(-448, 448).to(FP8)
    scales = expand_block_scales(torch.full((-(-rows // 128), -(-cols // 128)), 2.0**-6), rows)
    i8, s8 = int8_quantize(w, w.dtype)
    q4, s4 = int4_quantize(w, 128, w.dtype)
    i4c, i4s = int4_pack(q4, s4, w.dtype)
    # torch's own layout: codes blocked for its kernel, and a zero point beside each scale
    i4p = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q4 + 8).to(torch.int32), 1)
    i4t = torch.stack([s4.T, torch.zeros_like(s4.T)], dim=2).contiguous()
    x8, one = x.float().clamp(-448, 448).to(FP8), torch.tensor(1.0)
    return {
        "bf16 row-major": (lambda: F.linear(x, w), 2 * w.numel()),
        "bf16 packed": (
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            2 * w.numel(),
        ),
        "fp8 block (engine)": (lambda: fp8_linear(x, q8, scales, None), w.numel() * 1.03),
        "fp8 block tiles": (lambda: fp8_tiled_linear(x, q8, scales, None), w.numel() * 1.03),
        "fp8 _scaled_mm": (
            lambda: torch._scaled_mm(x8, q8.T, one, one, out_dtype=torch.bfloat16),
            w.numel(),
        ),
        "int8 (engine)": (lambda: int8_linear(x, i8, s8), w.numel()),
        "int8 aten": (lambda: torch.ops.aten._weight_int8pack_mm(x, i8, s8), w.numel()),
        "int4 (engine)": (lambda: int4_linear(x, i4c, i4s), w.numel() / 2 + i4s.numel() * 2),
        "int4 aten": (
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, i4p, 128, i4t),
            w.numel() / 2 + i4t.numel() * 2,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1024x3072,3072x1024,1024x6144")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'shape':>10} {'batch':>5} {'format':>20} {'us':>9} {'vs packed':>9} {'GB/s':>7}")
    for shape in args.shapes.split(","):
        cols, rows = (int(n) for n in shape.split("x"))
        w = torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, cols, dtype=torch.bfloat16)
            timed = {
                name: (median_us(fn, args.repeats), nbytes)
                for name, (fn, nbytes) in formats(w, x).items()
            }
            base = timed["bf16 packed"][0]
            for name, (us, nbytes) in timed.items():
                print(
                    f"{shape:>10} {batch:>5} {name:>20} {us:9.1f} {base / us:8.2f}x "
                    f"{nbytes / us / 1e3:7.1f}"
                )


if __name__ == "__main__":
    main()
