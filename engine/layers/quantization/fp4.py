"""DeepSeek-V4's FP4 routed experts, kept as they are stored: half a byte a weight.

A checkpoint stores an expert matrix W [rows, cols] as bytes P [rows, cols / 2],
byte j of a row holding column 2j in its low four bits and column 2j + 1 in its
high four (torch's float4_e2m1fn_x2, as which DeepSeek's inference code reads
the int8 bytes), and one scale per row and group of 32 columns, S [rows,
ceil(cols / 32)], float8_e8m0fnu (a power of two) under scale_fmt ue8m0, float32
otherwise: W[i, j] = E2M1[code] * S[i, j // 32]. An e2m1 code is a sign bit, two
exponent bits and one mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. A row whose
columns are not a multiple of 32 ends in a partial group with a scale of its own
(DeepSeek's own matrices never do; transformers sizes the scales that way).

The product is taken in float32, as the FP8 layers' is (fp8.py); with a power of
two for a scale it is exact. On a CPU the C++ operators (engine/csrc/fp4_linear.cpp)
decode 16 bytes at a time in registers: a few tokens (a decode step) are
multiplied straight from the packed bytes, more by dequantizing one tile of rows
at a time for oneDNN's matmul. Elsewhere torch's own operations do the same
(each byte looks up its two values in a 256-entry table).
benchmarks/fp4_linear.py times them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine import csrc
from engine.config.fp8_format import FP4_GROUP

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
TILE_VALUES = 1 << 18  # weights a tile: 512 KiB in bfloat16; the best of 2^16..2^19 measured
GEMV_TOKENS = 16  # up to this many tokens, the C++ operator reads the packed bytes


@functools.cache
def byte_values(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two e2m1 values each byte holds, low nibble first."""
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([table[codes & 15], table[codes >> 4]], dim=1).to(device)


def fp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = E2M1[code] * scale in float32, then rounded to ``dtype``: packed [rows,
    cols / 2] uint8, scales [rows, ceil(cols / 32)] float32 or float8_e8m0fnu. On a
    CPU through the C++ operator, else fp4_dequantize_torch."""
    if dtype in (torch.float32, torch.bfloat16) and packed.device.type == "cpu" and csrc.load():
        return torch.ops.deepinfer.fp4_dequantize(packed, scales, dtype == torch.bfloat16)
    return fp4_dequantize_torch(packed, scales, dtype)


def fp4_dequantize_torch(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """fp4_dequantize in torch's own operations, for any device and dtype."""
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    out = F.embedding(packed.int(), byte_values(packed.device)).view(rows, cols)
    s = scales.float()
    full = cols // FP4_GROUP * FP4_GROUP
    if full:
        out[:, :full].view(rows, -1, FP4_GROUP).mul_(s[:, : full // FP4_GROUP, None])
    if full < cols:
        out[:, full:].mul_(s[:, -1:])
    return out if dtype == torch.float32 else out.to(dtype)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [tokens, cols] times the dequantized weight, transposed: a few tokens
    through the C++ operator, which reads the packed bytes; more one tile of rows
    at a time. The full-precision matrix never exists at once."""
    if x.shape[0] <= GEMV_TOKENS and x.device.type == "cpu" and csrc.load():
        return torch.ops.deepinfer.fp4_gemv(x, packed, scales)
    return fp4_tiled_linear(x, packed, scales)


def fp4_tiled_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp4_linear by tiles of dequantized rows, whatever the number of tokens."""
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    tile = max(1, TILE_VALUES // cols)
    if tile >= rows:
        return F.linear(x, fp4_dequantize(packed, scales, x.dtype))
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, tile):
        end = min(rows, start + tile)
        w = fp4_dequantize(packed[start:end], scales[start:end], x.dtype)
        out[:, start:end] = F.linear(x, w)
    return out
