"""DeepSeek-V4's FP4 experts: one expert matrix, each way the engine can multiply it, on this CPU.

    python benchmarks/fp4_linear.py                   # V4-Flash's expert shapes
    python benchmarks/fp4_linear.py --shapes 2048x4096 --batches 1,8 --threads 2

For each shape (in x out) and batch, the median time of y = x W^T in bfloat16
activations from: bfloat16 row-major (F.linear, 2 bytes a weight); the engine's
FP4 layer (layers/quantization/fp4.py: the C++ operator reading the packed bytes
up to 16 tokens, else row tiles the C++ operator dequantizes, then F.linear);
the C++ tiles alone; and the same tiles dequantized by torch's own operations
(the path off the CPU). Packed FP4 with one e8m0 scale per 32 weights is 0.53
bytes a weight. It prints each way's median and fastest time and their ratios to
bfloat16's. One run, on whatever else the machine is doing: read the ratios. Not
part of `make test`.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from weight_linear import times_us  # beside this file: python benchmarks/fp4_linear.py

from engine.layers.quantization import fp4


def torch_tiles(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp4_tiled_linear with torch's dequantization instead of the C++ operator's."""
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    tile = max(1, fp4.TILE_VALUES // cols)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype)
    for start in range(0, rows, tile):
        end = min(rows, start + tile)
        w = fp4.fp4_dequantize_torch(packed[start:end], scales[start:end], x.dtype)
        out[:, start:end] = F.linear(x, w)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4096x2048,2048x4096")  # V4-Flash: w1/w3, w2
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        cols, rows = (int(v) for v in shape.split("x"))
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        exponents = torch.randint(120, 124, (rows, -(-cols // 32)), dtype=torch.uint8, generator=g)
        scales = exponents.view(torch.float8_e8m0fnu)
        w = fp4.fp4_dequantize(packed, scales, torch.bfloat16)
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, cols, generator=g).bfloat16()
            base = None
            for name, fn, *inputs in (
                ("bf16 F.linear", F.linear, x, w),
                ("FP4 layer", fp4.fp4_linear, x, packed, scales),
                ("FP4 C++ tiles", fp4.fp4_tiled_linear, x, packed, scales),
                ("FP4 torch tiles", torch_tiles, x, packed, scales),
            ):
                us, fastest = times_us(lambda fn=fn, inputs=inputs: fn(*inputs), args.repeats)
                base = base or (us, fastest)
                print(
                    f"{shape} batch {batch:>3}  {name:<16} median {us:>9,.0f} us "
                    f"{us / base[0]:5.2f}x   fastest {fastest:>9,.0f} us {fastest / base[1]:5.2f}x"
                )


if __name__ == "__main__":
    main()
