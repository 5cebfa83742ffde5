"""Linear layers and routed experts from int8 or int4 weights (int_weight.py),
made at load from a model's full-precision layers, which are freed one by one;
and a tied embedding table with its output head, kept as one int8 table."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.moe import Experts
from engine.layers.quantization.int_weight import (
    int4_group,
    int4_pack,
    int4_quantize,
    int8_quantize,
    int_linear,
    int_linear_op,
)


def frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class IntLinear(nn.Module):
    """nn.Linear's forward from int8 or int4 weights (``method``) and their scales."""

    method: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        multiply = int_linear_op if torch.compiler.is_compiling() else int_linear
        y = multiply(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.method)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(IntLinear):
    """int8 weights, one scale per output row."""

    method = "int8"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = by_rows(lambda w: int8_quantize(w, w.dtype), linear.weight.detach())
        self.weight, self.weight_scale = frozen(q), frozen(scales)
        self.bias = linear.bias

    @classmethod
    def reading(cls, table: Int8Embedding) -> Int8Linear:
        """A tied output head: the embedding's codes and scales, shared, not copied."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.out_features, head.in_features = table.weight.shape
        head.weight, head.weight_scale, head.bias = table.weight, table.weight_scale, None
        return head


class Int4Linear(IntLinear):
    """int4 weights, one scale per group of a row."""

    method = "int4"

    def __init__(self, linear: nn.Linear, group: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dtype = linear.weight.dtype
        codes, scales = by_rows(
            lambda w: int4_pack(*int4_quantize(w, group, dtype), dtype), linear.weight.detach()
        )
        self.weight, self.weight_scale = frozen(codes), frozen(scales)
        self.bias = linear.bias


class Int8Embedding(nn.Module):
    """nn.Embedding's lookup from int8 rows, one scale a row (a token's vector):
    the same codes and scales serve a tied output head (Int8Linear.reading)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        q, scales = by_rows(lambda w: int8_quantize(w, w.dtype), embedding.weight.detach())
        self.weight, self.weight_scale = frozen(q), frozen(scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scales = self.weight_scale[ids].float()
        return (self.weight[ids].float() * scales[..., None]).to(self.weight_scale.dtype)


ROWS = 256  # rows quantized at a time: float32 temporaries of a few rows, not a layer


def by_rows(quantize, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` over slices of ROWS rows (each row's numbers depend on that row
    alone), each slice's (codes, scales) written into the whole result as it
    comes, so that the result is never copied."""
    codes = scales = torch.empty(0)
    for r in range(0, w.shape[0], ROWS):
        part, part_scales = quantize(w[r : r + ROWS])
        if r == 0:
            codes = part.new_empty(w.shape[0], *part.shape[1:])
            scales = part_scales.new_empty(w.shape[0], *part_scales.shape[1:])
        codes[r : r + part.shape[0]] = part
        scales[r : r + part.shape[0]] = part_scales
    return codes, scales


def int4_fits(rows: int, cols: int) -> bool:
    """int4 needs a group dividing each row."""
    return int4_group(cols) is not None


class IntExperts(Experts):
    """Routed experts with every slot's matrices in int8 or int4: one quantized
    linear layer per slot and matrix, run as the dense layers are."""

    @classmethod
    def replacing(cls, experts: Experts, method: str) -> IntExperts:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_experts, new.slot_experts = experts.num_experts, experts.slot_experts
        new.act, new.token_counts, new.index = experts.act, experts.token_counts, experts.index
        for name in ("gate_up_proj", "down_proj"):
            stacked = getattr(experts, name)
            layers = nn.ModuleList(quantized(dense(w), method) for w in stacked.detach())
            setattr(new, f"{name}_q", layers)
        new.slots = len(experts.slot_experts)
        return new

    def project(self, x: torch.Tensor, stacked: str, slot: int) -> torch.Tensor:
        return self.get_submodule(f"{stacked}_q")[slot](x)

    def place(self, slot_experts: list[int]) -> None:
        raise ValueError("quantization int8/int4 does not combine with expert parallelism yet")


def dense(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear holding ``weight`` (no copy), to quantize as any other."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def quantized(linear: nn.Linear, method: str) -> nn.Module:
    if method == "int8":
        return Int8Linear(linear)
    return Int4Linear(linear, int4_group(linear.in_features))
