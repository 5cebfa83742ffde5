"""The Triton FP8 GEMM (DeepGEMM's scheme) against float64, in Triton's interpreter, on
fresh random inputs every run (the seed is in each failure; KERNELS_SEED replays it).

The activation codes and scales are compared exactly with engine.kernels.reference's
torch version of DeepGEMM's rule (torch's own E4M3 cast rounds them). The product is
compared element by element with the float64 sum of the same codes and scales, within
a bound derived from the kernel's float32 arithmetic (see `bound`).
"""

from __future__ import annotations

import pytest
import torch

# First: sets TRITON_INTERPRET=1 and imports Triton afresh if it must.
from tests.kernels.test_kernels import poison, seed  # noqa: F401

# isort: split
from engine.kernels import fp8_gemm, quantize_per_token, reference
from engine.layers.quantization.fp8 import FP8, Fp8Linear, expand_block_scales
from tests.kernels.test_fp8_linear import random_fp8

pytestmark = pytest.mark.triton

GROUP = 128
U = 2.0**-24  # float32's unit roundoff
# The output's rounding, relative: float16 rounds to nearest (2^-11, and below 2^-14
# half its smallest step, 2^-25); the interpreter truncates float32 to bfloat16 where a
# GPU rounds (2^-7, one unit in the last place).
OUTPUT_ROUNDING = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-7}
OUTPUT_TINY = {torch.float32: 0.0, torch.float16: 2.0**-25, torch.bfloat16: 0.0}


def bound(x: torch.Tensor, q: torch.Tensor, row_scales: torch.Tensor, bias) -> torch.Tensor:
    """How far the kernel may be from reference.fp8_gemm, element by element.

    With P_k = sum over block k of |a_j q_j| (codes) and S_k = sa_k * sw_k, T = sum_k P_k S_k:
    a block's float32 dot of 128 exact products, in any order, errs by at most 127 u P_k;
    rounding S_k and P_k * S_k adds 2 u each; adding the nk partial sums and the bias
    into the float32 accumulator adds at most u (T + |bias|) each. So
    |out - ref| <= (128 + 2 + nk + 1) u (T + |bias|), then the output's own rounding."""
    codes, scales = reference.quantize_per_token(x)
    a, w = codes.double().abs(), q.double().abs()
    total = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64)
    for k in range(scales.shape[1]):
        part = a[:, k * GROUP : (k + 1) * GROUP] @ w[:, k * GROUP : (k + 1) * GROUP].T
        total += part * (scales[:, k, None].double() * row_scales[None, :, k].double())
    if bias is not None:
        total += bias.double().abs()
    return total * (GROUP + 3 + scales.shape[1]) * U


def check_gemm(x, q, row_scales, bias, seed_: int) -> torch.Tensor:
    """Run the kernel and compare it with float64 within `bound`; returns its output."""
    out = fp8_gemm(x, q, row_scales, bias)
    ref = reference.fp8_gemm(x, q, row_scales, bias)
    rounding = OUTPUT_ROUNDING[x.dtype]
    allowed = bound(x, q, row_scales, bias) * (1 + rounding) + ref.abs() * rounding
    allowed += OUTPUT_TINY[x.dtype]
    replay = f"seed={seed_} (KERNELS_SEED={seed_})"
    assert out.dtype == x.dtype and out.shape == ref.shape, replay
    assert not out.isnan().any(), f"NaN in the output; {replay}"
    excess = ((out.double() - ref).abs() - allowed).max().item()
    assert excess <= 0, f"error above its bound by {excess:.3g}; {replay}"
    return out


def block_scales(rows: int, cols: int, low: int, high: int) -> torch.Tensor:
    """One float32 scale per 128 x 128 block, 2^e * [0.5, 1.5) with e in [low, high],
    as Fp8Linear keeps them: repeated down each block's rows."""
    grid = (-(-rows // GROUP), -(-cols // GROUP))
    exponents = torch.randint(low, high + 1, grid).double()
    scales = ((torch.rand(grid, dtype=torch.float64) + 0.5) * 2.0**exponents).float()
    return expand_block_scales(scales, rows)


def weight(rows: int, cols: int) -> torch.Tensor:
    return random_fp8(rows, cols, torch.Generator().manual_seed(torch.seed()))


# ---------------------------------------------------------------------------- activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(17, 200), (3, 128), (1, 1)], ids=str)
def test_activation_codes_and_scales_are_deepgemms(shape, dtype, seed: int) -> None:  # noqa: F811
    """Exactly DeepGEMM's rule: scales, and every code byte (signed zeros included),
    on random rows, a row of mixed magnitudes and an all-zero group (scale 1e-4 / 448)."""
    x = torch.randn(shape) * torch.exp2(torch.randint(-12, 12, (shape[0], 1)).float())
    if shape[1] > GROUP:
        x[0, GROUP:] = 0.0  # an all-zero partial group
    x = x.to(dtype)
    codes, scales = quantize_per_token(x)
    ref_codes, ref_scales = reference.quantize_per_token(x)
    assert codes.dtype == FP8 and scales.dtype == torch.float32
    assert torch.equal(scales, ref_scales), f"seed={seed}"
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), f"seed={seed}"
    if shape[1] > GROUP:
        assert (
            scales[0, 1] == torch.tensor(1e-4) / 448
            and not codes.view(torch.uint8)[0, GROUP:].any()
        )


def test_every_code_and_every_tie_rounds_as_e4m3() -> None:
    """A group whose amax is 448 has scale 1 exactly, so its values are coded as they are:
    every finite E4M3 value, both signs, must come back as its own code, and every
    midpoint between neighbours must round to the even one."""
    values = torch.arange(127, dtype=torch.uint8).view(FP8).float()  # codes 0..126: 0 to 448
    mids = (values[:-1] + values[1:]) / 2  # exact in float32
    x = torch.zeros(2, 2 * GROUP)
    x[0, :127], x[0, 127] = values, 448.0
    x[0, GROUP : GROUP + 127], x[0, 2 * GROUP - 1] = -values, -0.0
    x[1, :126], x[1, 126] = mids, 448.0
    x[1, GROUP : GROUP + 126], x[1, GROUP + 126] = -mids, -448.0
    codes, scales = quantize_per_token(x)
    assert torch.equal(scales, torch.ones(2, 2))
    ref_codes, _ = reference.quantize_per_token(x)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(codes.view(torch.uint8)[0, :127], torch.arange(127, dtype=torch.uint8))
    even = (ref_codes.view(torch.uint8)[1, :126] & 1) == 0
    assert even.all()  # the reference's own cast breaks ties to even, as it must


# ---------------------------------------------------------------------------- the GEMM


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_gemm_with_partial_blocks_and_zero_blocks(tokens, dtype, seed: int, poison: None) -> None:  # noqa: F811
    """576 rows (4.5 blocks, V3's kv_a_proj_with_mqa) and 200 columns (a partial last K
    block): partial row and token tiles, a zero weight block, a zero weight scale, a
    zero activation group."""
    rows, cols = 576, 200
    q = weight(rows, cols)
    q.view(torch.uint8)[GROUP : 2 * GROUP, :GROUP] = 0  # a zero weight block
    row_scales = block_scales(rows, cols, -12, -4)
    row_scales[: 2 * GROUP, 1] = 0.0  # a zero weight scale (blocks (0, 1) and (1, 1))
    x = torch.randn(tokens, cols).to(dtype)
    x[0, GROUP:] = 0  # a zero activation group: its scale is floored, never 0 / 0
    bias = torch.randn(rows).to(dtype) if tokens != 3 else None
    out = check_gemm(x, q, row_scales, bias, seed)
    if bias is None:  # token 0's rows 128..255: a zero weight block, then a zero scale
        assert not out[0, GROUP : 2 * GROUP].any(), f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemm_with_extreme_scales(dtype, seed: int, poison: None) -> None:  # noqa: F811
    """Weight scales from 2^-100 to 2^60 (about 1e-30 to 1e18) and tokens from 2^-10
    to 2^40 in size, whose products stay inside float32; bias included."""
    rows, cols, tokens = 130, 300, 5
    q = weight(rows, cols)
    row_scales = block_scales(rows, cols, -100, 60)
    x = torch.randn(tokens, cols) * torch.exp2(torch.randint(-10, 41, (tokens, 1)).float())
    x = x.to(dtype)
    check_gemm(x, q, row_scales, torch.randn(rows).to(dtype), seed)


def test_gemm_of_one_column_and_of_whole_blocks(seed: int, poison: None) -> None:  # noqa: F811
    """K = 1 (a single, nearly empty block) and K = 256 (two whole blocks), float16 out."""
    for rows, cols in ((70, 1), (128, 256)):
        x = torch.randn(2, cols).half()
        check_gemm(x, weight(rows, cols), block_scales(rows, cols, -8, -2), None, seed)


def test_no_tokens_and_bad_input() -> None:
    q, row_scales = weight(4, 130), block_scales(4, 130, -4, -4)
    assert fp8_gemm(torch.zeros(0, 130), q, row_scales, None).shape == (0, 4)
    with pytest.raises(ValueError, match="130 columns"):
        fp8_gemm(torch.zeros(2, 129), q, row_scales, None)
    with pytest.raises(ValueError, match="row_scales must be float32"):
        fp8_gemm(torch.zeros(2, 130), q, row_scales[:, :1], None)
    with pytest.raises(ValueError, match="q must be float8_e4m3fn"):
        fp8_gemm(torch.zeros(2, 130), q.float(), row_scales, None)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        fp8_gemm(torch.zeros(2, 130), q, row_scales, torch.zeros(5))


# ---------------------------------------------------------------------------- the layer


def test_fp8_linear_runs_the_gemm_where_told(monkeypatch, seed: int) -> None:  # noqa: F811
    """Fp8Linear.forward takes the Triton GEMM when uses_triton_gemm says so (on CUDA with
    Triton; here forced, on the interpreter), with its leading dimensions and bias; on a
    CPU it never does."""
    import engine.layers.quantization.fp8 as fp8

    assert not fp8.uses_triton_gemm(torch.device("cpu"))
    layer = Fp8Linear(200, 150, torch.nn.Parameter(torch.randn(150), requires_grad=False))
    layer.weight.data = weight(150, 200)
    layer.weight_scale_inv.data = block_scales(150, 200, -10, -6)
    calls = []
    monkeypatch.setattr(fp8, "uses_triton_gemm", lambda device: calls.append(device) or True)
    x = torch.randn(2, 3, 200)
    y = layer(x)
    assert calls and y.shape == (2, 3, 150)
    flat = x.reshape(6, 200)
    ref = reference.fp8_gemm(flat, layer.weight, layer.weight_scale_inv, layer.bias)
    allowed = bound(flat, layer.weight, layer.weight_scale_inv, layer.bias)
    assert ((y.reshape(6, 150).double() - ref).abs() <= allowed).all(), f"seed={seed}"
