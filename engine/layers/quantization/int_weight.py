"""Weight-only int8 and int4, symmetric, quantized at load (vLLM's names).

int8: one scale per output row, the row's largest magnitude over 127; each
weight is round(w / scale), in -127..127. int4: one scale per group of 128 input
columns of a row (64 or 32 where the row is shorter), the group's largest
magnitude over 7; each weight is round(w / scale), in -7..7, stored two to a
byte. Either way w is read back as q times its scale. The activations stay in
the model's dtype. int4 is multiplied by torch's own CPU kernel, straight from
the packed bytes: aten._weight_int4pack_mm_for_cpu, which reads (q + 8) - 8
times the scale, plus a zero point, which is 0 here. int8's few rows (decode
steps) go through the engine's C++ operator, engine/csrc/int8_linear.cpp, and
many rows (a prompt) through torch's matmul, from the weights dequantized a slice
at a time (int8_linear says why).
"""

from __future__ import annotations

import torch

from engine import csrc

INT4_GROUP = 128
INT4_GROUPS = (128, 64, 32)  # the first that divides a row's length is its group
INT8_GEMV_TOKENS = 16  # up to this many tokens, the C++ operator (engine/csrc/int8_linear.cpp)
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
    """torch's CPU int4 layout: the codes q + 8 two to a byte, and a [groups, rows, 2]
    table of (scale, zero point 0) in the activations' dtype."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q + 8).to(torch.int32), 1)
    table = torch.stack([scales.T, torch.zeros_like(scales.T)], dim=2)
    return packed, table.to(dtype).contiguous()


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
    return dequantized_linear(x, q, scales)


def dequantized_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x times the int8 weight, transposed, by F.linear on DEQUANTIZED_ROWS rows
    of the weight at a time, each dequantized to x's dtype (q and its scale are
    exact there, so their product is rounded once): a prompt's many rows make the product compute-bound, and torch's dense
    matmul computes faster than any kernel reading the codes. A slice at a time
    keeps the temporary small, even for a 151,936-row output head."""
    out = x.new_empty(x.shape[0], q.shape[0])
    for r in range(0, q.shape[0], DEQUANTIZED_ROWS):
        rows = slice(r, r + DEQUANTIZED_ROWS)
        w = q[rows].to(x.dtype) * scales[rows, None].to(x.dtype)  # exact product, rounded once
        out[:, rows] = torch.nn.functional.linear(x, w)
    return out


@torch.library.custom_op("deepinfer::int8_linear", mutates_args=())
def int8_linear_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8_linear, opaque to torch.compile, which chooses the kernel on the host."""
    return int8_linear(x, q, scales)


@int8_linear_op.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def int4_linear(x: torch.Tensor, packed: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    group = 2 * packed.shape[1] // table.shape[0]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, table)
