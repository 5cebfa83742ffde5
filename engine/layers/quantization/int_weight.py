"""Weight-only int8 and int4, symmetric, quantized at load (vLLM's names).

int8: one scale per output row, the row's largest magnitude over 127; each
weight is round(w / scale), in -127..127. int4: one scale per group of 128 input
columns of a row (64 or 32 where the row is shorter), the group's largest
magnitude over 7; each weight is round(w / scale), in -7..7, stored as q + 8,
two to a byte. Either way w is read back as q times its scale. The activations
stay in the model's dtype. A few rows (decode steps) go through the engine's
C++ operators, engine/csrc/int8_linear.cpp and int4_linear.cpp, which read each
code once; many rows (a prompt) through torch's matmul, from the weights
dequantized a slice at a time (int8_linear and int4_linear say why).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine import csrc

INT4_GROUP = 128
INT4_GROUPS = (128, 64, 32)  # the first that divides a row's length is its group
INT8_GEMV_TOKENS = 16  # up to this many tokens, the C++ operator (engine/csrc/int8_linear.cpp)
INT4_GEMV_TOKENS = 16  # and engine/csrc/int4_linear.cpp
DEQUANTIZED_ROWS = 4096  # more tokens: weight rows dequantized at a time, 8 MB at 1,024 columns


def int8_quantize(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [rows, cols], scales [rows] in ``dtype``, the activations'): q * scale ~ w,
    each q rounded against the scale as stored."""
    amax = w.float().abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(dtype).float()
    q = torch.round(w.float() / scales[:, None]).clamp_(-127, 127)
    return q.to(torch.int8), scales.to(dtype)


def int4_group(cols: int) -> int | None:
    """The group length of a row of ``cols`` weights; None if none divides it."""
    return next((g for g in INT4_GROUPS if cols % g == 0), None)


def int4_quantize(
    w: torch.Tensor, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 in -7..7 [rows, cols], scales [rows, cols / group] in ``dtype``)."""
    rows, cols = w.shape
    groups = w.float().view(rows, cols // group, group)
    amax = groups.abs().amax(dim=2)
    scales = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).to(dtype).float()
    q = torch.round(groups / scales[..., None]).clamp_(-7, 7)
    return q.view(rows, cols).to(torch.int8), scales.to(dtype)


def int8_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def int4_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // scales.shape[1]
    return q.float() * scales.float().repeat_interleave(group, dim=1)


def int4_pack(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    """The engine's int4 layout: (codes uint8 [rows, cols / 2], the codes q + 8 of
    columns 2i and 2i + 1 in byte i's low and high four bits; the scales
    [rows, groups] in the activations' dtype)."""
    codes = (q + 8).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales.to(dtype)


def int4_unpack(codes: torch.Tensor) -> torch.Tensor:
    """q int8 [rows, cols] from int4_pack's codes."""
    pairs = torch.stack([codes & 15, codes >> 4], dim=2)
    return pairs.view(codes.shape[0], -1).to(torch.int8) - 8


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [tokens, cols] times the int8 weight, transposed: up to INT8_GEMV_TOKENS
    rows through the C++ operator, more through dequantized_linear. Measured with
    benchmarks/weight_linear.py at Qwen3-0.6B's shapes on an AMD Zen 4: for one
    row (2 threads, idle) the operator took 1.13 to 1.31 times less time than
    torch's aten._weight_int8pack_mm on the layers, and 6.97 ms against 12.83 on
    the 151,936-row head, which no cache holds; for 2, 4 and 8 rows (1 thread)
    1.17 to 1.89 times less on the layers and 1.93 to 2.08 on the head. At 16 rows
    (2 threads, idle) it still took 1.2 to 1.8 times less than either other way;
    from 32 rows dequantized_linear took the least, 2.1 to 3.3 times less than
    aten's kernel at a prompt's 143 rows."""
    if x.shape[0] <= INT8_GEMV_TOKENS and x.device.type == "cpu" and csrc.load():
        return torch.ops.deepinfer.int8_gemv(x, q, scales)
    # q and its scale are exact in x's dtype, so each weight is rounded once
    return dequantized_linear(x, lambda r: q[r].to(x.dtype) * scales[r, None].to(x.dtype), len(q))


def dequantized_linear(
    x: torch.Tensor, rows_of: Callable[[slice], torch.Tensor], rows: int
) -> torch.Tensor:
    """x times a quantized weight of ``rows`` rows, transposed, by F.linear on
    DEQUANTIZED_ROWS rows of it at a time, each slice made by ``rows_of`` in x's
    dtype: a prompt's many rows make the product compute-bound, and torch's dense
    matmul computes faster than any kernel reading the codes. A slice at a time
    keeps the temporary small, even for a 151,936-row output head."""
    out = x.new_empty(x.shape[0], rows)
    for r in range(0, rows, DEQUANTIZED_ROWS):
        part = slice(r, r + DEQUANTIZED_ROWS)
        out[:, part] = torch.nn.functional.linear(x, rows_of(part))
    return out


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [tokens, cols] times the int4 weight, transposed: up to INT4_GEMV_TOKENS
    rows through the C++ operator, more through dequantized_linear (the slices
    made by the C++ operator int4_dequantize on a CPU). Measured against torch's
    aten._weight_int4pack_mm_for_cpu, on its own layout, with
    benchmarks/weight_linear.py at Qwen3-0.6B's MLP shapes on an AMD Zen 4 (bf16
    activations, 2 threads, idle; one weight, called again and again): at one row
    aten's time over the operator's was 0.90 to 1.17; 8 rows took 1.1 to 1.7
    times less, 16 rows 1.1 to 1.5 times less; through the slices, 32 rows 1.3
    to 1.6 times less, and a prompt's 143 rows 1.8 to 2.5 times less."""
    on_cpu = x.device.type == "cpu" and csrc.load()
    if x.shape[0] <= INT4_GEMV_TOKENS and on_cpu:
        return torch.ops.deepinfer.int4_gemv(x, codes, scales)
    by_csrc = on_cpu and x.dtype in (torch.float32, torch.bfloat16)  # its two dtypes
    dequantize = torch.ops.deepinfer.int4_dequantize if by_csrc else int4_dequantize_codes
    return dequantized_linear(x, lambda r: dequantize(codes[r], scales[r].to(x.dtype)), len(codes))


def int4_dequantize_codes(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight int4_pack's codes stand for, in the scales' dtype, each q times
    its scale rounded once (q and the scale are exact there); the C++ operator
    int4_dequantize does the same in one pass."""
    group = 2 * codes.shape[1] // scales.shape[1]
    return int4_unpack(codes).to(scales.dtype) * scales.repeat_interleave(group, dim=1)


def int_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, method: str) -> torch.Tensor:
    """int8_linear or int4_linear, by ``method``."""
    return (int8_linear if method == "int8" else int4_linear)(x, q, scales)


@torch.library.custom_op("deepinfer::int_linear", mutates_args=())
def int_linear_op(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, method: str
) -> torch.Tensor:
    """int_linear, opaque to torch.compile, which chooses the kernel on the host."""
    return int_linear(x, q, scales, method)


@int_linear_op.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, method: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])
