"""Experiment 23: the same row, summed in batches of different sizes.

Float addition is not associative. A GPU library that splits one row's sum
into partial sums (split-K) when the batch is too small to keep its cores
busy adds the same numbers in a different order, and the bits change. This
model sums one row of float32 numbers (rounded with struct, as float32
hardware rounds each addition) the way such a kernel would for each batch
size, and then with one fixed order for every batch.
"""

from __future__ import annotations

import math
import random
import struct

SEED = 23
ROW = 4096  # products summed for one output: the reduction length
UNITS = 64  # cores to keep busy; a small batch splits its rows to fill them
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


def f32(x: float) -> float:
    """x rounded to the nearest float32, as float32 arithmetic stores it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def f32_step(x: float) -> float:
    """The gap between neighbouring float32 values near x (24-bit significand)."""
    return 2.0 ** (math.frexp(x)[1] - 24)


def splits_for(batch: int) -> int:
    """The library's choice: split each row so batch * splits fills the cores."""
    return max(1, UNITS // batch)


def reduce(row: list[float], splits: int) -> float:
    """Each split sums its own chunk in order; then the partials are summed."""
    size = len(row) // splits
    partials = []
    for s in range(splits):
        acc = 0.0
        for x in row[s * size : (s + 1) * size]:
            acc = f32(acc + x)
        partials.append(acc)
    total = 0.0
    for p in partials:
        total = f32(total + p)
    return total


def main() -> dict:
    a, b, c = 0.1, 0.2, 0.3
    print(f"({a} + {b}) + {c} = {(a + b) + c!r}")
    print(f"{a} + ({b} + {c}) = {a + (b + c)!r}")
    rng = random.Random(SEED)
    row = [f32(rng.gauss(0.0, 1.0) * rng.gauss(0.0, 1.0)) for _ in range(ROW)]
    exact = sum(row)  # float64 reference, for scale
    print()
    print(f"one row of {ROW} float32 products, {UNITS} cores")
    print(f"{'batch':>6} {'splits':>7} {'sum':>13}  same bits as batch {BATCHES[0]}")
    alone = reduce(row, splits_for(BATCHES[0]))
    variant = []
    for batch in BATCHES:
        total = reduce(row, splits_for(batch))
        variant.append(total)
        print(f"{batch:>6} {splits_for(batch):>7} {total:>13.9f}  {total == alone}")
    fixed = [reduce(row, 1) for _ in BATCHES]
    print()
    print(f"fixed order (no split) at every batch size: {len(set(fixed))} value")
    spread = max(variant) - min(variant)
    splits = len({splits_for(b) for b in BATCHES})
    print(f"split counts the library used: {splits}")
    print(f"distinct sums with the library's choice: {len(set(variant))}")
    print(f"their spread: {spread:.3g}, float64 sum: {exact:.9f}")
    step = f32_step(alone)
    steps = round(spread / step)
    print(f"float32 values near the sum are {step:.3g} apart:")
    print(f"  the spread is {steps} such steps, {steps + 1} values to land on")
    return {
        "row": ROW,
        "units": UNITS,
        "left_first": repr((a + b) + c),
        "right_first": repr(a + (b + c)),
        "distinct_variant": len(set(variant)),
        "distinct_fixed": len(set(fixed)),
        "batches": len(BATCHES),
        "batch_sizes": BATCHES,
        "spread": spread,
        "same_as_alone": sum(t == alone for t in variant),
        "others_same_as_alone": sum(t == alone for t in variant[1:]),
        "others": len(BATCHES) - 1,
        "split_counts": splits,
        "float_step": step,
        "spread_steps": steps,
        "landing_values": steps + 1,
    }


if __name__ == "__main__":
    main()
