"""Tiny random DeepSeek-V4 checkpoints in DeepSeek's published quantized layout,
and their oracle.

The layout, as DeepSeek's V4 inference code reads its release (model.py's Linear
and MoE, kernel.py's fp8_gemm and fp4_gemm; transformers 5.24's FP8 loader reads
the same): tensors under DeepSeek's own names (no ``model.`` prefix, ``embed``,
``hc_head_fn``), each quantized weight's scales beside it as ``<module>.scale``,
float8_e8m0fnu (a power of two, ``scale_fmt: ue8m0``).

- FP8 e4m3, one scale per 128 x 128 block: the attention's wq_a, wq_b, wkv, wo_a
  and wo_b, the indexer's wq_b, the shared expert, the MTP module's projections.
- FP4 e2m1, two values a byte (int8 [rows, cols / 2], column 2j in the low four
  bits), one scale per row and 32 columns: the routed experts
  (``expert_dtype: fp4``, top level in V4's config.json).
- As they were: the compressors' wkv and wgate and the indexer's weights_proj
  (bfloat16 in the release), the router, the embedding, the head, norms and the
  hyper-connections.

The model is widened so that matrices end in partial blocks: hidden 160 (a block
of 128 and one of 32) and an expert width of 144, whose down projection's rows
end in a partial group of 16 columns (DeepSeek's experts never do; transformers
sizes the scales for it, one per started group). One FP8 block and one FP4 group
are all zeros. The oracle is the same weights dequantized by DeepSeek's rule (a
value times its scale, in float32) into a plain checkpoint under transformers'
names, run by transformers.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.engine.fp8_checkpoints import dequantized as fp8_dequantized
from tests.engine.fp8_checkpoints import quantize as fp8_quantize

GROUP = 32  # columns per FP4 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
WIDE = {"hidden_size": 160, "moe_intermediate_size": 144}
FP8_WEIGHTS = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.indexer\.wq_b\.weight$"
    r"|\.shared_experts\.w[123]\.weight$|\.[eh]_proj\.weight$"
)
FP4_WEIGHTS = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
QUANTIZATION = {  # DeepSeek-V4-Flash's config.json
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}


def group_scales(w: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(cols / 32)]: the power of two at or above each group's largest
    magnitude over 6 (e2m1's largest), 1 for an all-zero group."""
    rows, cols = w.shape
    padded = torch.zeros(rows, math.ceil(cols / GROUP) * GROUP, dtype=torch.float64)
    padded[:, :cols] = w.double().abs()
    amax = padded.view(rows, -1, GROUP).amax(-1)
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax / 6, 1.0)))
    return torch.exp2(exponent)


def fp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, cols / 2] packed codes, float32 scales) of a weight: each value
    over its group's scale, rounded to the nearest e2m1 value."""
    rows, cols = w.shape
    scales = group_scales(w)
    x = w.double() / scales.repeat_interleave(GROUP, 1)[:, :cols]
    magnitudes = torch.tensor(E2M1[:8], dtype=torch.float64)
    code = (x.abs()[..., None] - magnitudes).abs().argmin(-1)
    code = code | torch.where(x < 0, 8, 0)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), scales.float()


def fp4_dequantized(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rule in float64, rounded once to float32: each code's e2m1 value
    times its group's scale (exact for a power of two)."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(1)
    values = torch.tensor(E2M1, dtype=torch.float64)[codes]
    cols = codes.shape[1]
    return (values * scales.double().repeat_interleave(GROUP, 1)[:, :cols]).float()


def native_name(name: str) -> str:
    """transformers' save name -> DeepSeek's release name."""
    name = name.removeprefix("model.").replace("embed_tokens.", "embed.")
    return name.replace("hc_head.hc_", "hc_head_")


def quantize_v4_checkpoint(path: Path, reference: Path, experts: str = "fp4") -> None:
    """Quantize the transformers-saved V4 checkpoint in ``path`` in place, in
    DeepSeek's layout, the routed experts in ``experts`` ("fp4", or "fp8" as the
    dense layers, V4's expert_dtype left out); its dequantized copy (transformers'
    names, float32) goes to ``reference``."""
    tensors = load_file(path / "model.safetensors")
    stored, plain = {}, {}
    zeroed = {"fp8": False, "fp4": experts != "fp4"}
    for name, w in tensors.items():
        key = native_name(name)
        if FP4_WEIGHTS.search(name) and experts == "fp4":
            if not zeroed["fp4"]:
                w = w.clone()
                w[0, :GROUP] = 0  # a zero group: its scale is 1, its codes +0
                zeroed["fp4"] = True
            q, s = fp4_quantize(w)
            stored[key], stored[key.removesuffix(".weight") + ".scale"] = (
                q,
                s.to(torch.float8_e8m0fnu),
            )
            plain[name] = fp4_dequantized(q, s)
        elif FP8_WEIGHTS.search(name) or FP4_WEIGHTS.search(name):
            if not zeroed["fp8"] and min(w.shape) >= 128:
                w = w.clone()
                w[:128, :128] = 0  # a zero block
                zeroed["fp8"] = True
            q, s = fp8_quantize(w, ue8m0=True)
            stored[key], stored[key.removesuffix(".weight") + ".scale"] = (
                q,
                s.to(torch.float8_e8m0fnu),
            )
            plain[name] = fp8_dequantized(q, s)
        else:
            stored[key] = plain[name] = w
    assert all(zeroed.values()), zeroed
    reference.mkdir(parents=True, exist_ok=True)
    for file in path.iterdir():
        if file.is_file() and file.suffix == ".json":
            shutil.copy(file, reference)
    save_file(plain, reference / "model.safetensors", metadata={"format": "pt"})
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION
    if experts == "fp4":
        config["expert_dtype"] = "fp4"
    (path / "config.json").write_text(json.dumps(config))
