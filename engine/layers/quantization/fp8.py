"""A linear layer that keeps DeepSeek's FP8 weights and their block scales.

A checkpoint stores W as FP8 e4m3 values Q and one float32 scale S per 128 x 128
block: W[i, j] = Q[i, j] * S[i // 128, j // 128], the product taken in float32,
as DeepSeek's own weight_dequant computes it (deepseek-ai/DeepSeek-V3,
inference/kernel.py). A weight whose rows or columns are not a multiple of 128
ends in a partial block, which has a scale of its own all the same.

The engine keeps Q and the scales, a byte a weight. A CPU multiplies by dequantizing
tiles of rows into the activations' dtype (the whole matrix is never in full precision
at once); CUDA with Triton runs DeepGEMM's scheme (engine/kernels/fp8_gemm.py). The
scales are kept one row per weight row (each block's scale repeated down its rows), so
that fused layers (q, k and v in one matrix) can stack checkpoint tensors whose row
counts are not multiples of 128; that costs 4 bytes per 128 weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import csrc
from engine.config.fp8_format import BLOCK
from engine.utils import cdiv

FP8 = torch.float8_e4m3fn
TILE_BYTES = 1 << 18  # a dequantized tile of rows: about a core's L2 share
GEMV_TOKENS = 16  # up to this many tokens, the C++ operator (engine/csrc/fp8_linear.cpp)


def dequantize(q: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = Q * S in float32, then rounded to ``dtype``: Q [rows, cols] FP8, row_scales
    [rows, ceil(cols / 128)] float32, a partial last column block included. On a
    CPU through the C++ operator (torch's own FP8 conversion is about 30 times
    slower there), else dequantize_torch."""
    if dtype in (torch.float32, torch.bfloat16) and q.device.type == "cpu" and csrc.load():
        return torch.ops.deepinfer.fp8_block_dequantize(q, row_scales, dtype == torch.bfloat16)
    return dequantize_torch(q, row_scales, dtype)


def dequantize_torch(q: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize in torch's own operations, for any device and dtype."""
    rows, cols = q.shape
    full = cols // BLOCK * BLOCK
    out = torch.empty(rows, cols, dtype=torch.float32, device=q.device).copy_(q)  # exact
    if full:
        out[:, :full].view(rows, full // BLOCK, BLOCK).mul_(row_scales[:, : full // BLOCK, None])
    if full < cols:
        out[:, full:].mul_(row_scales[:, -1:])
    return out if dtype == torch.float32 else out.to(dtype)


def fp8_linear(
    x: torch.Tensor, q: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [tokens, cols] times the dequantized weight, transposed, plus bias. A few
    tokens (a decode step) go through the C++ operator, which reads the FP8 bytes
    and applies each block's scale to its 128 products' sum; more are computed by
    dequantizing one tile of rows at a time for oneDNN's matmul, so that the
    full-precision copy never exists. benchmarks/weight_linear.py times both."""
    if x.shape[0] <= GEMV_TOKENS and x.device.type == "cpu" and csrc.load():
        y = torch.ops.deepinfer.fp8_block_gemv(x, q, row_scales)
        return y if bias is None else y + bias
    return fp8_tiled_linear(x, q, row_scales, bias)


def fp8_tiled_linear(
    x: torch.Tensor, q: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """fp8_linear by tiles of dequantized rows, whatever the number of tokens."""
    rows, cols = q.shape
    tile = max(1, TILE_BYTES // (4 * cols))
    if tile >= rows:
        return F.linear(x, dequantize(q, row_scales, x.dtype), bias)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, tile):
        end = min(rows, start + tile)
        w = dequantize(q[start:end], row_scales[start:end], x.dtype)
        part = None if bias is None else bias[start:end]
        out[:, start:end] = F.linear(x, w, part)
    return out


@torch.library.custom_op("deepinfer::fp8_linear", mutates_args=())
def fp8_linear_op(
    x: torch.Tensor, q: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """fp8_forward, opaque to torch.compile: tile loops and launches sized on the host."""
    return fp8_forward(x, q, row_scales, bias)


@fp8_linear_op.register_fake
def _(x: torch.Tensor, q: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None):
    return x.new_empty(x.shape[0], q.shape[0])


class Fp8Linear(nn.Module):
    """nn.Linear's forward from FP8 weights and their block scales (module doc)."""

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        weight = torch.empty(out_features, in_features, dtype=FP8)
        scales = torch.empty(out_features, cdiv(in_features, BLOCK), dtype=torch.float32)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)  # DeepSeek's name
        self.bias = bias

    @classmethod
    def replacing(cls, linear: nn.Linear) -> Fp8Linear:
        return cls(linear.in_features, linear.out_features, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.deepinfer.fp8_linear(flat, self.weight, self.weight_scale_inv, self.bias)
        else:
            y = fp8_forward(flat, self.weight, self.weight_scale_inv, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def expand_block_scales(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's [ceil(rows / 128), ceil(cols / 128)] block scales as one row
    of scales per weight row."""
    return scales.repeat_interleave(BLOCK, dim=0)[:rows].contiguous()


def uses_triton_gemm(device: torch.device) -> bool:
    """Whether a layer on `device` runs the Triton FP8 GEMM: on CUDA, with Triton.
    (Imported here, so that a CPU process never imports Triton for this.)"""
    if device.type != "cuda":
        return False
    from engine.kernels.availability import available

    return available(device)


def fp8_forward(
    x: torch.Tensor, q: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The layer's product: the Triton FP8 GEMM (DeepGEMM's scheme) where
    uses_triton_gemm, else fp8_linear."""
    if uses_triton_gemm(x.device):
        from engine.kernels.fp8_gemm import fp8_gemm

        return fp8_gemm(x, q, row_scales, bias)
    return fp8_linear(x, q, row_scales, bias)
