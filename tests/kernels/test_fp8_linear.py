"""The FP8 block-scaled linear layer's arithmetic against float64, on fresh random
inputs every run: DeepSeek's dequantization (each FP8 value times its 128 x 128
block's scale, rounded once to float32) exactly, and the layer's product within
float32's rounding, across block edges, partial blocks, zero blocks, every FP8
code and extreme scales."""

from __future__ import annotations

import pytest
import torch

from engine import csrc
from engine.layers.quantization.fp8 import (
    FP8,
    dequantize,
    dequantize_torch,
    expand_block_scales,
    fp8_linear,
    fp8_tiled_linear,
)

needs_csrc = pytest.mark.skipif(not csrc.load(), reason="no C++ compiler to build engine/csrc")

BLOCK = 128


def random_fp8(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Any finite e4m3 code, subnormals and both zeros included (0x7f and 0xff are NaN)."""
    codes = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    return codes.to(torch.uint8).view(FP8)


def random_scales(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Block scales over 2^-100 .. 2^100 with random mantissas, one block zeroed."""
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    exponents = torch.randint(-100, 101, grid, generator=g).double()
    scales = (torch.rand(grid, generator=g, dtype=torch.float64) + 0.5) * 2.0**exponents
    return scales.float()


def reference_weight(q: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """Element (i, j) is q[i, j] * s[i // 128, j // 128], in float64."""
    rows, cols = q.shape
    s = block_scales.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return q.double() * s[:rows, :cols]


SHAPES = [(1, 1), (128, 128), (160, 576), (576, 160), (257, 129), (3, 700)]


DEQUANTIZE = {"operator": dequantize, "torch": dequantize_torch}


@pytest.mark.parametrize("how", [pytest.param("operator", marks=needs_csrc), "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_dequantize_is_deepseeks_float32_product(shape, how) -> None:
    g = torch.Generator().manual_seed(torch.seed())
    q, s = random_fp8(*shape, g), random_scales(*shape, g)
    w = DEQUANTIZE[how](q, expand_block_scales(s, shape[0]), torch.float32)
    # the float64 product is exact (4 + 24 mantissa bits): rounding it once is float32's
    assert torch.equal(w, reference_weight(q, s).float())
    bf16 = DEQUANTIZE[how](q, expand_block_scales(s, shape[0]), torch.bfloat16)
    assert torch.equal(bf16, reference_weight(q, s).float().bfloat16())


def test_a_zero_block_gives_zeros_whatever_its_scale() -> None:
    g = torch.Generator().manual_seed(torch.seed())
    q, s = random_fp8(160, 300, g), random_scales(160, 300, g)
    q.view(torch.uint8)[128:, 256:] = 0
    w = dequantize(q, expand_block_scales(s, 160), torch.float32)
    assert not w[128:, 256:].any() and w[:128].any()


def gemv(x, q, scales, bias):
    return torch.ops.deepinfer.fp8_block_gemv(x, q, scales) + bias


PATHS = {"gemv": gemv, "tiles": fp8_tiled_linear, "dispatch": fp8_linear}


@pytest.mark.parametrize(
    "path", [pytest.param("gemv", marks=needs_csrc), "tiles", "dispatch"], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 9, 17])
@pytest.mark.parametrize("shape", [(160, 576), (700, 130), (2, 129), (17, 15)], ids=str)
def test_linear_matches_float64(tokens, shape, path, dtype, monkeypatch) -> None:
    """Within float32 rounding of the float64 product, by the C++ operator (block
    sums times scales; activation rows in passes of 8, a tail of columns short of
    16), by tiles of dequantized rows (with a small tile, the row-tile loop and a
    partial last tile run) and by the dispatch between them."""
    import engine.layers.quantization.fp8 as fp8

    monkeypatch.setattr(fp8, "TILE_BYTES", 4 * shape[1] * 7)  # 7 rows a tile
    g = torch.Generator().manual_seed(torch.seed())
    rows, cols = shape
    q = random_fp8(rows, cols, g)
    s = (torch.rand(-(-rows // BLOCK), -(-cols // BLOCK), generator=g) + 0.01) * 2.0**-6
    s[0, 0] = 0.0  # a zero scale: that block contributes nothing
    x = torch.randn(tokens, cols, generator=g).to(dtype)
    bias = torch.randn(rows, generator=g).to(dtype)
    y = PATHS[path](x, q, expand_block_scales(s, rows), bias)
    w = reference_weight(q, s)
    expected = x.double() @ w.T + bias.double()
    bound = (x.double().abs() @ w.abs().T + bias.double().abs()) * cols * 2.0**-23
    if dtype == torch.bfloat16:  # and the result's rounding to bfloat16, and the bias add's
        bound = bound * 2.0**16 / cols + expected.abs() * 2.0**-7
    assert y.dtype == dtype and y.shape == (tokens, rows)
    assert ((y.double() - expected).abs() <= bound + 1e-30).all()


@needs_csrc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operator_decodes_every_code_exactly(dtype) -> None:
    """Identity activations read each weight back: every finite E4M3 code, in a
    row of 254 (a full block of 128, then 7 vectors of 16 and a tail of 14), times
    a scale per block, exactly, and rounded once to bfloat16 for bfloat16 input."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    q = codes.view(FP8)[torch.randperm(254)].view(1, -1).repeat(16, 1)
    scales = torch.tensor([[2.0**-3, 2.0**5]]).repeat(16, 1)
    y = torch.ops.deepinfer.fp8_block_gemv(torch.eye(254, dtype=dtype), q, scales)
    expected = reference_weight(q, scales[:1]).T.float().to(dtype)
    assert y.dtype == dtype and torch.equal(y, expected)
