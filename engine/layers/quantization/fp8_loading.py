"""Reading DeepSeek's block-scaled FP8 checkpoints without a full-precision copy.

Which layers are FP8 is read from the checkpoint itself: every tensor stored as
float8_e4m3fn must have a scale beside it, ``<name>_scale_inv`` (V3's name) or,
for ``<module>.weight``, ``<module>.scale`` (V4's release), and such a weight's
layer becomes an Fp8Linear (or its MoE layer's experts Fp8Experts) before
anything is loaded. Under ``expert_dtype: fp4`` (DeepSeek-V4) the routed
experts' int8 tensors are FP4 bytes, two values each, and their MoE layer's
experts become Fp4Experts (fp4.py), their scales one per row and 32 columns. The weights then stream in as they are stored, a byte each;
each scale is checked against its weight's shape and handed on one row per
weight row (fp8.expand_block_scales). A layer the model reads by its weight
(MLA's kv_b_proj) is dequantized as it arrives, one tensor at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.config.fp8_format import BLOCK, FP4_GROUP, Fp8Format
from engine.layers.moe import Experts
from engine.layers.quantization.fp4_experts import Fp4Experts
from engine.layers.quantization.fp8 import FP8, Fp8Linear, dequantize, expand_block_scales
from engine.layers.quantization.fp8_experts import Fp8Experts
from engine.utils import cdiv

SCALE = "_scale_inv"  # DeepSeek's suffix: weight = stored values times this
V4_SCALE = ".scale"  # DeepSeek-V4's release: <module>.scale beside <module>.weight
FP8_NAMES = ("F8_E4M3",)  # safetensors' dtype name for float8_e4m3fn
FP4_NAMES = ("I8", "F4")  # V4's packed experts: int8 bytes, or torch's float4_e2m1fn_x2
KINDS = {"fp8": "FP8", "fp4": "FP4"}
UE8M0 = getattr(torch, "float8_e8m0fnu", None)


@dataclass(frozen=True)
class Fp8Layers:
    """What a model loaded from an FP8 checkpoint holds in FP8."""

    format: Fp8Format
    names: frozenset[str]  # module names of its Fp8Linear, Fp8Experts and Fp4Experts layers
    quantized: Mapping[str, str]  # each quantized checkpoint weight: "fp8" or "fp4"


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


def quantized_weights(path: Path, fmt: Fp8Format) -> dict[str, str]:
    """The checkpoint's quantized weights, each "fp8" or (V4's packed experts) "fp4",
    from the headers. Any FP8 format but e4m3 is refused by name, and so is an FP4
    tensor where quantization_config's expert_dtype is not fp4."""
    found: dict[str, str] = {}
    for name, dtype in tensor_dtypes(path).items():
        if name.endswith((SCALE, V4_SCALE)):
            continue
        if dtype in FP8_NAMES:
            found[name] = "fp8"
        elif dtype.startswith("F8"):
            raise ValueError(f"checkpoint tensor {name!r} is {dtype}; FP8 weights must be E4M3")
        elif dtype in FP4_NAMES:
            if fmt.expert_dtype != "fp4":
                raise ValueError(
                    f"checkpoint tensor {name!r} is {dtype}, packed FP4, but "
                    f"quantization_config expert_dtype is {fmt.expert_dtype!r}, not 'fp4'"
                )
            found[name] = "fp4"
    return found


def quantize_modules(
    model: nn.Module,
    quantized: Mapping[str, str],
    target: Callable[[str], str | None],
    plain: tuple[str, ...],
    fmt: Fp8Format,
) -> set[str]:
    """Turn each layer a quantized checkpoint tensor fills into its FP8 or FP4 form,
    before loading; ``target`` maps a checkpoint name to the model's parameter (None:
    not loaded), ``plain`` names the layers the model reads by weight (they are
    dequantized instead). Returns the quantized layers' module names."""
    kinds: dict[str, str] = {}
    for name, kind in quantized.items():
        param = target(name)
        if param is None:
            continue
        module_name = param.rsplit(".", 1)[0]
        if module_name.rsplit(".", 1)[-1] in plain:
            continue
        module = model.get_submodule(module_name)
        if isinstance(module, Experts) and kind != fmt.expert_dtype:
            raise ValueError(
                f"checkpoint tensor {name!r} is {KINDS[kind]}, but quantization_config "
                f"expert_dtype is {fmt.expert_dtype!r}"
            )
        if module_name in kinds:
            if kinds[module_name] != kind:
                raise ValueError(
                    f"checkpoint tensor {name!r} is {KINDS[kind]}, but the other weights "
                    f"of {module_name} are {KINDS[kinds[module_name]]}"
                )
            continue
        parent_name, _, leaf = module_name.rpartition(".")
        new = _quantized_form(name, kind, module, module_name, fmt)
        setattr(model.get_submodule(parent_name), leaf, new)
        kinds[module_name] = kind
    return set(kinds)


def _quantized_form(
    name: str, kind: str, module: nn.Module, module_name: str, fmt: Fp8Format
) -> nn.Module:
    if isinstance(module, Experts):
        if kind == "fp4":
            scale_dtype = UE8M0 if fmt.scale_fmt == "ue8m0" else torch.float32
            return Fp4Experts.replacing(module, scale_dtype)
        return Fp8Experts.replacing(module)
    if type(module) is nn.Linear and kind == "fp8":
        return Fp8Linear.replacing(module)
    only = " (FP4 is for routed experts only)" if kind == "fp4" else ""
    raise ValueError(
        f"checkpoint tensor {name!r} is {KINDS[kind]}, but {module_name} cannot be{only}"
    )


def scale_owner(name: str, quantized: Mapping[str, str]) -> str | None:
    """The weight a scale belongs to: ``<weight>_scale_inv``'s, or ``<module>.scale``'s
    where ``<module>.weight`` is quantized; None for any other tensor."""
    if name.endswith(SCALE):
        return name.removesuffix(SCALE)
    if name.endswith(V4_SCALE):
        weight = name.removesuffix(V4_SCALE) + ".weight"
        return weight if weight in quantized else None
    return None


def fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    fmt: Fp8Format,
    quantized: Mapping[str, str],
    keeps: Callable[[str], bool],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each quantized weight followed by its checked scale,
    named ``<weight>_scale_inv`` (an FP8 weight's one row per weight row), where
    ``keeps(name)``, else an FP8 weight dequantized to float32. A weight without
    its scale, a scale without its weight, or one of the wrong shape, is a
    ValueError that names the tensor."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in weights:
        owner = scale_owner(name, quantized)
        if owner is None and name not in quantized:
            if name.endswith("weight") and keeps(name):
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} in an FP8 layer")
            yield name, tensor
            continue
        base = owner or name
        if base not in pending:
            pending[base] = (name, tensor)
            continue
        first_name, first = pending.pop(base)
        if (first_name == base) == (name == base):
            raise ValueError(f"checkpoint tensor {base!r} has two scales: {first_name!r}, {name!r}")
        if name == base:
            weight, scale_name, scale = tensor, first_name, first
        else:
            weight, scale_name, scale = first, name, tensor
        yield from _paired(base, weight, scale_name, scale, fmt, quantized.get(base), keeps(base))
    for base, (name, _) in pending.items():
        if name == base:
            kind = KINDS[quantized[base]]
            raise ValueError(
                f"checkpoint tensor {base!r} is {kind} but has no scale ({base + SCALE!r})"
            )
        raise ValueError(f"checkpoint tensor {name!r} has no FP8 weight {base!r}")


def _paired(
    base: str,
    weight: torch.Tensor,
    scale_name: str,
    scale: torch.Tensor,
    fmt: Fp8Format,
    kind: str | None,
    keeps: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    if kind == "fp4":  # kept packed, whatever keeps says (only experts are FP4)
        scale = checked_fp4_scale(base, weight, scale_name, scale, fmt)
        yield base, weight.view(torch.uint8)
        yield base + SCALE, scale
        return
    scale = checked_scale(base, weight, scale, fmt, scale_name)
    if keeps:
        yield base, weight
        yield base + SCALE, scale
    else:
        yield base, dequantize(weight, scale, torch.float32)


def checked_fp4_scale(
    name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor, fmt: Fp8Format
) -> torch.Tensor:
    """A packed FP4 weight's scales, one per row and 32 columns, once their dtype,
    shape and (for ue8m0) values are what the format says: as float8_e8m0fnu under
    ue8m0 (a byte each, exact), else as float32."""
    if weight.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} is FP4 with {weight.dim()} dims, not 2")
    rows, cols = weight.shape[0], 2 * weight.shape[1]
    grid = (rows, cdiv(cols, FP4_GROUP))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"checkpoint tensor {scale_name!r} has shape {tuple(scale.shape)}; a {rows} x "
            f"{cols} FP4 weight ({cols // 2} bytes a row) with a scale per row and "
            f"{FP4_GROUP} columns needs {grid}"
        )
    if scale.dtype not in (torch.float32, UE8M0):
        raise ValueError(
            f"checkpoint tensor {scale_name!r} is {scale.dtype}, not float32 or float8_e8m0fnu"
        )
    values = scale.float()
    if fmt.scale_fmt != "ue8m0":
        return values
    if not bool(((torch.frexp(values).mantissa == 0.5) & (values <= 2.0**127)).all()):
        raise ValueError(f"scale_fmt is ue8m0 but {scale_name!r} holds a non-power of two")
    if bool((values < 2.0**-127).any()):
        raise ValueError(f"scale_fmt is ue8m0 but {scale_name!r} holds a scale below 2^-127")
    return values.to(UE8M0)


def checked_scale(
    name: str, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, scale_name: str = ""
) -> torch.Tensor:
    """A weight's block scales as float32, one row per weight row, once their
    dtype, shape and (for ue8m0) values are what the format says."""
    scale_name = scale_name or name + SCALE
    if weight.dtype != FP8:
        raise ValueError(f"checkpoint tensor {name!r} has a scale but is {weight.dtype}, not FP8")
    if weight.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} is FP8 with {weight.dim()} dims, not 2")
    rows, cols = weight.shape
    grid = (cdiv(rows, BLOCK), cdiv(cols, BLOCK))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"checkpoint tensor {scale_name!r} has shape {tuple(scale.shape)}; a "
            f"{rows} x {cols} weight in {BLOCK} x {BLOCK} blocks needs {grid}"
        )
    if scale.dtype not in (torch.float32, UE8M0):
        raise ValueError(f"checkpoint tensor {scale_name!r} is {scale.dtype}, not float32")
    scale = scale.float()
    if fmt.scale_fmt == "ue8m0" and not bool((torch.frexp(scale).mantissa == 0.5).all()):
        raise ValueError(f"scale_fmt is ue8m0 but {scale_name!r} holds a non-power of two")
    return expand_block_scales(scale, rows)
