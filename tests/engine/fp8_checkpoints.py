"""Tiny random checkpoints in DeepSeek's published FP8 layout, and their oracle.

A model is built with transformers (tests/engine/conftest.py), widened so that
its matrices end in partial 128 x 128 blocks (160 rows or columns: one block of
128 and one of 32), then every linear layer's weight is quantized as DeepSeek
stores it: FP8 e4m3 values and a float32 ``weight_scale_inv`` per block, the
block's largest magnitude over 448 (or the power of two at or above it, ue8m0),
with config.json's quantization_config. One block of one weight is all zeros.

The oracle is the same weights dequantized by DeepSeek's rule, value times its
block's scale in float32 (inference/kernel.py's weight_dequant, which masks the
partial blocks), saved as a plain float32 checkpoint and run by transformers.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.engine.conftest import build_checkpoint, build_tokenizer, hf_model_class

BLOCK = 128
FP8_MAX = 448.0  # e4m3's largest finite value
WIDE = {  # config fields that give partial blocks (160 = 128 + 32, 288 = 2 x 128 + 32)
    "hidden_size": 160,
    "intermediate_size": 288,
    "kv_lora_rank": 144,  # kv_a_proj_with_mqa: 144 + 16 rope = 160 rows
    "moe_intermediate_size": 144,
}


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek stores in FP8: every linear layer's weight, not the
    embeddings, the output head, the norms, the router or V3.2's indexer head
    weights (weights_proj, bfloat16 in V3.2's release)."""
    linear = name.endswith(("proj.weight", "_mqa.weight", ".wq_b.weight", ".wk.weight"))
    return tensor.dim() == 2 and linear and not name.endswith("weights_proj.weight")


def block_scales(w: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    rows, cols = w.shape
    grid = torch.zeros(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            amax = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].abs().max()
            s = amax.item() / FP8_MAX if amax > 0 else 1.0
            grid[i, j] = 2.0 ** math.ceil(math.log2(s)) if ue8m0 else s
    return grid


def expanded(scales: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    rows, cols = shape
    return scales.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def quantize(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, float32 block scales) of a weight, as DeepSeek casts one."""
    scales = block_scales(w.float(), ue8m0)
    q = (w.double() / expanded(scales, w.shape).double()).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scales


def dequantized(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """DeepSeek's weight_dequant: each value times its block's scale, in float32 (the
    float64 product of a 4-bit mantissa and a 24-bit one is exact, so rounding it
    once gives float32's product)."""
    return (q.double() * expanded(scales, q.shape).double()).float()


def build_fp8_checkpoint(
    arch: str, path: Path, reference: Path, ue8m0: bool = False, seed: int = 0
) -> torch.nn.Module:
    """Write the FP8 checkpoint to ``path`` and the dequantized one to ``reference``;
    returns transformers' model of the reference, in float32."""
    build_checkpoint(arch, path, seed=seed, config_overrides=WIDE)
    quantize_checkpoint(path, reference, ue8m0)
    return hf_model_class(arch).from_pretrained(reference, dtype=torch.float32).eval()


def quantize_checkpoint(path: Path, reference: Path, ue8m0: bool = False) -> None:
    """Quantize the checkpoint in ``path`` in place; its dequantized copy goes to
    ``reference``."""
    tensors = load_file(path / "model.safetensors")
    fp8, plain = {}, {}
    zeroed = False
    for name, w in tensors.items():
        if not is_quantized(name, w):
            fp8[name] = plain[name] = w
            continue
        if not zeroed and w.shape[0] >= BLOCK and w.shape[1] >= BLOCK:
            w = w.clone()
            w[:BLOCK, :BLOCK] = 0  # a zero block: its scale is 1, its values 0
            zeroed = True
        q, s = quantize(w, ue8m0)
        fp8[name], fp8[name + "_scale_inv"] = q, s
        plain[name] = dequantized(q, s)
    assert zeroed, "no weight is wide enough for a full block"
    save_file(fp8, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    reference.mkdir(parents=True, exist_ok=True)
    (reference / "config.json").write_text(json.dumps(config))
    save_file(plain, reference / "model.safetensors", metadata={"format": "pt"})
    build_tokenizer(reference)
    if (path / "generation_config.json").is_file():
        shutil.copy(path / "generation_config.json", reference)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    } | ({"scale_fmt": "ue8m0"} if ue8m0 else {})
    (path / "config.json").write_text(json.dumps(config))
