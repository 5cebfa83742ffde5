"""Linear layers on the CPU, with their weights packed once for oneDNN.

A matmul library multiplies fastest from a weight laid out in the tiles its
kernel reads, not in PyTorch's row-major order. Given a row-major weight, it
reorders it on every call, and for a decode step's few rows that reordering
costs as much as the arithmetic. Packing each weight once, after loading,
removes it. (Inductor does the same when it freezes a graph; doing it here
serves the eager and compiled paths alike.) The packed copy replaces the
original, so memory does not double.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine import csrc
from engine.layers.heap import free_weights


class PackedLinear(nn.Module):
    """nn.Linear's forward, from a weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        # Still a parameter of the same shape, so that counting a model's parameters,
        # or its weights' bytes, gives what it gave before; but opaque (layout _mkldnn).
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():  # Inductor cannot lower it for any batch size
            y = torch.ops.deepinfer.packed_linear(flat, self.weight, self.bias, self.out_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


@torch.library.custom_op("deepinfer::packed_linear", mutates_args=())
def packed_linear(  # the same call, opaque to the compiler
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    return x.new_empty(x.shape[0], out_features)


OneRow = Literal["onednn", "torch", "linear"]


@functools.cache
def cpu_flags() -> str:
    """/proc/cpuinfo, read once: one_row_kernel and few_rows_kernel look for the
    CPU's flags in it ("" where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def one_row_kernel() -> OneRow:
    """How SharedWeightLinear multiplies one row by a row-major bfloat16 weight on
    this CPU, as measured with python -m engine.tools.cpu_linear_bench at Qwen3's
    151,936 x 1,024 head, 2 threads:
    - on the Intel Xeon with AMX where this was first measured (commit 124c11f),
      torch.mv through oneDNN ("onednn"): 11.89 ms, against F.linear's 15.42;
    - on an AMD EPYC Zen 4 (AVX-512, no AMX), idle, torch's own GEMV ("torch":
      torch.mv with oneDNN switched off, which reads the rows in order): 7.79 ms,
      against F.linear's 21.23 and oneDNN's torch.mv at 28.84.
    The AMX flag stands for the first kind; any other CPU takes torch's own GEMV,
    which is also what an AVX2-only CPU runs, oneDNN having no bf16 path there."""
    return "onednn" if " amx_bf16" in cpu_flags() else "torch"


FEW_ROWS = 8  # up to this many rows, SharedWeightLinear may take the C++ operator


def few_rows_kernel() -> bool:
    """Does SharedWeightLinear multiply 2 to FEW_ROWS rows by the engine's C++
    operator (engine/csrc/bf16_linear.cpp) on this CPU? Measured on an AMD EPYC
    Zen 4 (AVX-512 with bfloat16, no AMX), 2 threads, at Qwen3's 151,936 x
    1,024 head, in two rounds: 2 rows took 11.0 and 11.3 ms against F.linear's
    16.4 and 17.2, 4 rows 11.2 and 12.8 against 17.7 and 19.5, 8 rows 15.1 and
    16.7 against 20.9 and 22.2 (python -m engine.tools.cpu_linear_bench times
    both). Only such a CPU takes it: with AMX, oneDNN's tiles are unmeasured
    against it, and without AVX-512's bfloat16 dot product the operator's float32
    path is too."""
    flags = cpu_flags()
    return " avx512_bf16" in flags and " amx_bf16" not in flags and csrc.load()


class SharedWeightLinear(nn.Module):
    """nn.Linear for a weight that must stay as it is, because another layer
    shares it (a tied LM head reads the embedding's table). A single row goes
    through torch.mv, W x, with the kernel one_row_kernel() chose for this CPU:
    both read a row-major weight faster in that order than F.linear does. A few
    rows go through the engine's C++ operator where few_rows_kernel() says so,
    which reads the weight once for all of them. More rows go through F.linear:
    W xᵀ would come out transposed, and making it contiguous costs more than it
    saves."""

    def __init__(
        self, linear: nn.Linear, one_row: OneRow | None = None, few_rows: bool | None = None
    ) -> None:
        """``one_row``: how one row is multiplied (default: one_row_kernel());
        ``few_rows``: whether the C++ operator takes a few (default: few_rows_kernel())."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same parameter: still shared
        self.bias = linear.bias
        self.one_row = one_row_kernel() if one_row is None else one_row
        self.few_rows = few_rows_kernel() if few_rows is None else few_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = 0 if torch.compiler.is_compiling() else flat.shape[0]  # traced: any size
        if rows == 1 and self.one_row != "linear":
            y = gemv(self.weight, flat[0], self.one_row == "onednn").unsqueeze(0)
        elif 1 < rows <= FEW_ROWS and self.few_rows and flat.dtype == torch.bfloat16:
            y = bf16_gemv(flat, self.weight)
        else:
            return F.linear(flat, self.weight, self.bias).reshape(*x.shape[:-1], -1)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ for a few bfloat16 rows, by engine/csrc/bf16_linear.cpp."""
    return torch.ops.deepinfer.bf16_gemv(x, weight)


def gemv(weight: torch.Tensor, x: torch.Tensor, onednn: bool) -> torch.Tensor:
    """torch.mv(weight, x), through oneDNN or (``onednn`` False) torch's own kernel.
    The switch is torch's global one, set for this call alone; the engine's model
    runs in one thread."""
    if onednn:
        return torch.mv(weight, x)
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        return torch.mv(weight, x)
    finally:
        torch.backends.mkldnn.enabled = enabled


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Can oneDNN pack this layer's weights here? bfloat16 needs AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT, as oneDNN itself reports (DNNL_MAX_CPU_ISA lowers it):
    on an AVX2-only CPU packing would raise, so bf16 weights stay row-major."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack_linears(model: nn.Module) -> int:
    """Replace the model's nn.Linear layers by packed ones, except any whose weight
    is shared with another parameter (a tied LM head): packing would copy it. In
    bfloat16 such a layer becomes a SharedWeightLinear, faster for one row; in
    float32 it stays as it is. Returns how many were packed."""
    shared = _shared_weights(model)
    places = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    packed = 0
    for parent, name, child in places:  # each old weight is freed as soon as its copy
        if id(child.weight) not in shared:  # is made, and its memory given back
            setattr(parent, name, PackedLinear(child))
            free_weights(child.weight)
            packed += 1
        elif child.weight.dtype == torch.bfloat16:
            setattr(parent, name, SharedWeightLinear(child))
    return packed


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}
