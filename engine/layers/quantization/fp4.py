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
two for a scale it is exact. The engine multiplies by dequantizing one tile of
rows at a time, with torch's own operations: each byte looks up its two values
in a 256-entry table, and the tile is scaled and handed to oneDNN's matmul.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.config.fp8_format import FP4_GROUP

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
TILE_VALUES = 1 << 16  # weights dequantized at once: a float32 tile of 256 KiB


@functools.cache
def byte_values(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two e2m1 values each byte holds, low nibble first."""
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([table[codes & 15], table[codes >> 4]], dim=1).to(device)


def fp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = E2M1[code] * scale in float32, then rounded to ``dtype``: packed [rows,
    cols / 2] uint8, scales [rows, ceil(cols / 32)] float32 or float8_e8m0fnu."""
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
    """x [tokens, cols] times the dequantized weight, transposed, one tile of rows
    at a time: the full-precision matrix never exists at once."""
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
