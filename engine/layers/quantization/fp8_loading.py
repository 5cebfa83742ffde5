"""Reading DeepSeek's block-scaled FP8 checkpoints without a full-precision copy.

Which layers are FP8 is read from the checkpoint itself: every tensor stored as
float8_e4m3fn must have a ``<name>_scale_inv`` beside it, and such a weight's
layer becomes an Fp8Linear (or its MoE layer's experts Fp8Experts) before
anything is loaded. The weights then stream in as they are stored, a byte each;
each scale is checked against its weight's shape and handed on one row per
weight row (fp8.expand_block_scales). A layer the model reads by its weight
(MLA's kv_b_proj) is dequantized as it arrives, one tensor at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.config.fp8_format import BLOCK, Fp8Format
from engine.layers.moe import Experts
from engine.layers.quantization.fp8 import FP8, Fp8Linear, dequantize, expand_block_scales
from engine.layers.quantization.fp8_experts import Fp8Experts
from engine.utils import cdiv

SCALE = "_scale_inv"  # DeepSeek's suffix: weight = stored values times this
FP8_NAMES = ("F8_E4M3",)  # safetensors' dtype name for float8_e4m3fn
UE8M0 = getattr(torch, "float8_e8m0fnu", None)


@dataclass(frozen=True)
class Fp8Layers:
    """What a model loaded from an FP8 checkpoint holds in FP8."""

    format: Fp8Format
    names: frozenset[str]  # module names of its Fp8Linear and Fp8Experts layers


def tensor_dtypes(path: Path) -> dict[str, str]:
    """Every tensor's safetensors dtype name in a checkpoint folder, from the files'
    headers (8 bytes of header length, then JSON), reading no tensor."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    dtypes: dict[str, str] = {}
    for file in files:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        dtypes |= {n: v["dtype"] for n, v in header.items() if n != "__metadata__"}
    return dtypes


def fp8_weight_names(path: Path) -> list[str]:
    """The checkpoint's FP8 tensors; any FP8 format but e4m3 is refused by name."""
    names = []
    for name, dtype in tensor_dtypes(path).items():
        if dtype.startswith("F8") and dtype not in FP8_NAMES and not name.endswith(SCALE):
            raise ValueError(f"checkpoint tensor {name!r} is {dtype}; FP8 weights must be E4M3")
        if dtype in FP8_NAMES:
            names.append(name)
    return names


def quantize_modules(model: nn.Module, fp8_names: Iterable[str], target: Callable, plain) -> set:
    """Turn each layer an FP8 checkpoint tensor fills into its FP8 form, before
    loading; ``target`` maps a checkpoint name to the model's parameter, ``plain``
    names the layers the model reads by weight (they are dequantized instead).
    Returns the FP8 layers' module names."""
    quantized: set[str] = set()
    for name in fp8_names:
        module_name = target(name).rsplit(".", 1)[0]
        if module_name in quantized or module_name.rsplit(".", 1)[-1] in plain:
            continue
        parent_name, _, leaf = module_name.rpartition(".")
        parent, module = model.get_submodule(parent_name), model.get_submodule(module_name)
        if isinstance(module, Experts):
            setattr(parent, leaf, Fp8Experts.replacing(module))
        elif type(module) is nn.Linear:
            setattr(parent, leaf, Fp8Linear.replacing(module))
        else:
            raise ValueError(f"checkpoint tensor {name!r} is FP8, but {module_name} cannot be")
        quantized.add(module_name)
    return quantized


def fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]], fmt: Fp8Format, keeps: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each FP8 weight followed by its checked scale (one
    row per weight row) where ``keeps(name)``, else dequantized to float32. A weight
    without its scale, a scale without its weight, or one of the wrong shape, is
    a ValueError that names the tensor."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        base = name.removesuffix(SCALE)
        if tensor.dtype != FP8 and not name.endswith(SCALE):
            if name.endswith("weight") and keeps(name):
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} in an FP8 layer")
            yield name, tensor
            continue
        if base not in pending:
            pending[base] = tensor
            continue
        weight, scale = (pending.pop(base), tensor) if name != base else (tensor, pending.pop(base))
        scale = checked_scale(base, weight, scale, fmt)
        if keeps(base):
            yield base, weight
            yield base + SCALE, scale
        else:
            yield base, dequantize(weight, scale, torch.float32)
    for base, tensor in pending.items():
        if tensor.dtype == FP8:
            raise ValueError(f"checkpoint tensor {base!r} is FP8 but has no {base + SCALE!r}")
        raise ValueError(f"checkpoint tensor {base + SCALE!r} has no FP8 weight {base!r}")


def checked_scale(name: str, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format):
    """A weight's block scales as float32, one row per weight row, once their
    dtype, shape and (for ue8m0) values are what the format says."""
    if weight.dtype != FP8:
        raise ValueError(f"checkpoint tensor {name!r} has a scale but is {weight.dtype}, not FP8")
    if weight.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} is FP8 with {weight.dim()} dims, not 2")
    rows, cols = weight.shape
    grid = (cdiv(rows, BLOCK), cdiv(cols, BLOCK))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"checkpoint tensor {name + SCALE!r} has shape {tuple(scale.shape)}; a "
            f"{rows} x {cols} weight in {BLOCK} x {BLOCK} blocks needs {grid}"
        )
    if scale.dtype not in (torch.float32, UE8M0):
        raise ValueError(f"checkpoint tensor {name + SCALE!r} is {scale.dtype}, not float32")
    scale = scale.float()
    if fmt.scale_fmt == "ue8m0" and not bool((torch.frexp(scale).mantissa == 0.5).all()):
        raise ValueError(f"scale_fmt is ue8m0 but {name + SCALE!r} holds a non-power of two")
    return expand_block_scales(scale, rows)
