"""Packed linear layers (engine/layers/linear.py): the same numbers as nn.Linear,
the original weights let go, and a tied output head left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.layers.linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
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


def test_pack_linears_replaces_weights_and_skips_tied_ones() -> None:
    model = Tiny()
    before = sum(p.numel() for p in model.parameters())
    up = model.up.weight
    assert pack_linears(model) == 2
    assert isinstance(model.up, PackedLinear) and isinstance(model.down, PackedLinear)
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight
    assert sum(p.numel() for p in model.parameters()) == before  # counted as before
    packed = [p for p in model.parameters() if p.layout == torch._mkldnn]
    assert len(packed) == 2 and all(p is not up for p in model.parameters())  # not kept twice
