"""Packed linear layers (engine/layers/linear.py): the same numbers as nn.Linear,
the original weights let go, and a tied output head left unpacked: a single row
through torch.mv in bfloat16, and left alone in float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import csrc
from engine.layers import linear as linear_module
from engine.layers.linear import PackedLinear, SharedWeightLinear, can_pack, pack_linears
from engine.tools.cpu_linear_bench import run as linear_bench

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="this torch has no oneDNN"
)
# bfloat16 packs only where oneDNN can (can_pack): on an AVX2-only CPU, or under
# DNNL_MAX_CPU_ISA=AVX2, it refuses, and the engine keeps bf16 weights row-major there
# (ModelRunner asks can_pack first), so there is nothing packed to check.
PACKABLE_DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not can_pack(torch.device("cpu"), torch.bfloat16),
            reason="oneDNN cannot pack bfloat16 on this CPU (needs AVX-512 BW, VL, DQ or AVX-NE-CONVERT)",
        ),
    ),
]


@pytest.mark.parametrize("dtype", PACKABLE_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (3, 5, 96)], ids=["1", "7", "3x5"])
def test_packed_linear_matches_nn_linear(dtype, bias, shape) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    expected = linear(x).double()
    got = PackedLinear(linear)(x)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 keeps 8 bits of mantissa
    err = (got.double() - expected).abs().max() / expected.abs().max()
    assert err < tol, err


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as many small models are


@pytest.mark.parametrize("one_row", ["onednn", "torch", "linear"])
@pytest.mark.parametrize("few_rows", [False, True], ids=["F.linear", "operator"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (3, 5, 96), (1, 1, 96), (2, 4, 96)])
def test_weight_major_linear_matches_the_float64_product(
    one_row, few_rows, dtype, bias, shape
) -> None:
    """Fresh random inputs each run, against the float64 product: one row goes
    through torch.mv, by oneDNN or by torch's own kernel, or through F.linear;
    2 to 8 bf16 rows through the C++ operator or F.linear; more through F.linear."""
    if few_rows and not csrc.load():
        pytest.skip("the C++ operators could not be built here")
    gen = torch.Generator().manual_seed(torch.seed())
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen))
    x = torch.randn(shape, generator=gen).to(dtype)
    got = SharedWeightLinear(linear, one_row=one_row, few_rows=few_rows)(x)
    expected = x.double() @ linear.weight.double().T
    if bias:
        expected = expected + linear.bias.double()
    assert got.shape == expected.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 keeps 8 bits of mantissa
    err = (got.double() - expected).abs().max() / expected.abs().max()
    assert err < tol, err


def test_the_linear_bench_checks_both_sides() -> None:
    out = linear_bench(vocab=300, hidden=64, repeats=1, batches=(1, 5))
    rows = [line for line in out.splitlines() if line.strip().startswith(("1 ", "5 "))]
    assert len(rows) == 2 and all(row.endswith("  ok") for row in rows), out


@pytest.mark.parametrize("dtype", PACKABLE_DTYPES, ids=["fp32", "bf16"])
def test_pack_linears_replaces_weights_and_skips_tied_ones(dtype) -> None:
    model = Tiny().to(dtype)
    before = sum(p.numel() for p in model.parameters())
    up = model.up.weight
    assert pack_linears(model) == 2
    assert isinstance(model.up, PackedLinear) and isinstance(model.down, PackedLinear)
    head = SharedWeightLinear if dtype == torch.bfloat16 else nn.Linear
    assert type(model.head) is head and model.head.weight is model.embed.weight
    assert sum(p.numel() for p in model.parameters()) == before  # counted as before
    packed = [p for p in model.parameters() if p.layout == torch._mkldnn]
    assert len(packed) == 2 and all(p is not up for p in model.parameters())  # not kept twice


@pytest.mark.parametrize(
    ("one_row", "rows", "calls"),
    [("onednn", 1, [True]), ("torch", 1, [False]), ("linear", 1, []), ("torch", 2, [])],
)
def test_one_row_takes_torch_mv_by_the_kernel_chosen(monkeypatch, one_row, rows, calls) -> None:
    """One row goes through torch.mv, with oneDNN on or (torch's own GEMV) off for
    that call alone; more rows, or "linear", never call it."""
    seen = []
    mv = torch.mv
    monkeypatch.setattr(
        torch, "mv", lambda *a: seen.append(torch.backends.mkldnn.enabled) or mv(*a)
    )
    linear = nn.Linear(16, 40, bias=False).to(torch.bfloat16)
    SharedWeightLinear(linear, one_row=one_row)(torch.randn(rows, 16).to(torch.bfloat16))
    assert seen == calls
    assert torch.backends.mkldnn.enabled  # switched back on


@pytest.mark.parametrize(
    ("few_rows", "rows", "calls"),
    [(True, 2, 1), (True, 8, 1), (True, 9, 0), (True, 1, 0), (False, 2, 0)],
)
def test_a_few_rows_take_the_operator_where_chosen(monkeypatch, few_rows, rows, calls) -> None:
    """2 to FEW_ROWS rows go through the C++ operator when few_rows is set; one
    row, more rows, or few_rows off never call it."""
    seen = []
    monkeypatch.setattr(linear_module, "bf16_gemv", lambda x, w: seen.append(x.shape) or x @ w.T)
    linear = nn.Linear(16, 40, bias=False).to(torch.bfloat16)
    layer = SharedWeightLinear(linear, one_row="torch", few_rows=few_rows)
    assert layer(torch.randn(rows, 16).to(torch.bfloat16)).shape == (rows, 40)
    assert len(seen) == calls


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17])
@pytest.mark.parametrize("cols", [1, 31, 32, 33, 100, 1024])
def test_the_bf16_operator_matches_float64(rows, cols) -> None:
    """engine/csrc/bf16_linear.cpp on fresh random inputs: columns that end
    between vectors, more activation rows than one pass takes (8), a zero weight
    row, and magnitudes from 2^-40 to 2^40; within float32's rounding of the
    float64 sum, and bfloat16's of the result."""
    if not csrc.load():
        pytest.skip("the C++ operators could not be built here")
    g = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(37, cols, generator=g) * torch.logspace(-12, 12, 37)[:, None]
    w[5] = 0
    w, x = w.to(torch.bfloat16), torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    y = torch.ops.deepinfer.bf16_gemv(x, w)
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 37)
    assert ((y.double() - exact).abs() <= scale * ((cols + 2) * 2.0**-24 + 2.0**-8)).all()
    assert not y[:, 5].any()
