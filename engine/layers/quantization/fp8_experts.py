"""A MoE layer's routed experts from FP8 weights and their block scales: each
slot's matrices dequantized one tile at a time as its rows go through it, as
Fp8Linear does for a dense layer (fp8.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.config.fp8_format import BLOCK
from engine.layers.moe import Experts
from engine.layers.quantization.fp8 import FP8, fp8_linear
from engine.utils import cdiv

STACKED = ("gate_up_proj", "down_proj")


class Fp8Experts(Experts):
    """Experts whose stacked gate_up_proj and down_proj hold FP8 values, with
    gate_up_proj_scale_inv and down_proj_scale_inv beside them (one row of block
    scales per weight row)."""

    @classmethod
    def replacing(cls, experts: Experts) -> Fp8Experts:
        slots, rows, hidden = experts.gate_up_proj.shape
        new = cls(experts.num_experts, hidden, rows // 2)
        new.act = experts.act  # DeepSeek-V4's is clipped
        new.place(experts.slot_experts)
        return new

    def place(self, slot_experts: list[int]) -> None:
        """Hold these logical experts' slots, in FP8 with their scales (to be loaded)."""
        self.slot_experts = list(slot_experts)
        for name in STACKED:
            old = getattr(self, name)
            shape = (len(slot_experts), *old.shape[1:])
            weight = torch.empty(shape, dtype=FP8, device=old.device)
            scales = torch.empty(*shape[:2], cdiv(shape[2], BLOCK), device=old.device)
            setattr(self, name, nn.Parameter(weight, requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(scales, requires_grad=False))

    def project(self, x: torch.Tensor, stacked: str, slot: int) -> torch.Tensor:
        weight, scales = self.get_parameter(stacked), self.get_parameter(f"{stacked}_scale_inv")
        return fp8_linear(x, weight[slot], scales[slot], None)
