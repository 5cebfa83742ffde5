"""A MoE layer's routed experts from DeepSeek-V4's FP4 weights (fp4.py): each
slot's matrices stay packed, two values a byte, with one scale per row and 32
columns, and are dequantized one tile at a time as its rows go through them."""

from __future__ import annotations

import torch
from torch import nn

from engine.config.fp8_format import FP4_GROUP
from engine.layers.moe import Experts
from engine.layers.quantization.fp4 import fp4_linear
from engine.utils import cdiv

STACKED = ("gate_up_proj", "down_proj")


class Fp4Experts(Experts):
    """Experts whose stacked gate_up_proj and down_proj hold packed e2m1 bytes
    [slots, rows, cols / 2], with gate_up_proj_scale_inv and down_proj_scale_inv
    [slots, rows, ceil(cols / 32)] beside them, in ``scale_dtype``."""

    scale_dtype: torch.dtype = torch.float32

    @classmethod
    def replacing(cls, experts: Experts, scale_dtype: torch.dtype) -> Fp4Experts:
        slots, rows, hidden = experts.gate_up_proj.shape
        new = cls(experts.num_experts, hidden, rows // 2)
        new.act = experts.act  # V4's clipped SwiGLU
        new.scale_dtype = scale_dtype
        new.place(experts.slot_experts)
        return new

    def place(self, slot_experts: list[int]) -> None:
        """Hold these logical experts' slots, packed with their scales (to be loaded).
        The logical shapes are kept in ``shapes`` (a packed row is half as wide)."""
        if not hasattr(self, "shapes"):
            self.shapes = {name: tuple(getattr(self, name).shape[1:]) for name in STACKED}
        self.slot_experts = list(slot_experts)
        device = self.gate_up_proj.device
        for name in STACKED:
            rows, cols = self.shapes[name]
            if cols % 2:
                raise ValueError(f"FP4 experts need an even number of columns; {name} has {cols}")
            packed = torch.empty(
                len(slot_experts), rows, cols // 2, dtype=torch.uint8, device=device
            )
            scales = torch.empty(
                len(slot_experts),
                rows,
                cdiv(cols, FP4_GROUP),
                dtype=self.scale_dtype,
                device=device,
            )
            setattr(self, name, nn.Parameter(packed, requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(scales, requires_grad=False))

    def project(self, x: torch.Tensor, stacked: str, slot: int) -> torch.Tensor:
        packed, scales = self.get_parameter(stacked), self.get_parameter(f"{stacked}_scale_inv")
        return fp4_linear(x, packed[slot], scales[slot])
