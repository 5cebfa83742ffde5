"""Which parameter of the engine's DeepSeek-V4 a checkpoint tensor fills.

The engine names V4's modules as DeepSeek's release does (layers.N.attn.wq_a,
layers.N.ffn.experts.E.w1, embed, head, hc_head_fn), so most tensors map by
name. transformers' save_pretrained writes the same names under ``model.``, with
embed_tokens and hc_head.hc_* instead. Two kinds fill part of a parameter: each
routed expert's w1 (gate), w3 (up) and w2 (down) one slot of the stacked
experts, and the shared expert's w1 and w3 the two halves of its gate_up_proj.

A quantized checkpoint's scales fill the ``_scale_inv`` parameter beside their
weight's, named ``<module>.scale`` in DeepSeek's release, or already
``<module>.weight_scale_inv`` as the FP8 loader hands them on
(layers/quantization/fp8_loading.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

RENAMES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head.fn",
    "hc_head.hc_base": "hc_head.base",
    "hc_head.hc_scale": "hc_head.scale",
    "hc_head_fn": "hc_head.fn",
    "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
}
PROJ = {"w1": "gate", "w3": "up", "w2": "down"}


class Target(NamedTuple):
    param: str  # the engine's parameter name
    expert: int | None = None  # a slot of a stacked experts parameter
    half: str | None = None  # "gate" or "up": that half of a fused gate_up_proj

    def view(self, data: torch.Tensor) -> torch.Tensor:
        """The part of the parameter's data this tensor fills."""
        if self.expert is not None:
            data = data[self.expert]
        if self.half is None:
            return data
        rows = data.shape[0] // 2
        return data.narrow(0, 0 if self.half == "gate" else rows, rows)


def target(name: str) -> Target | None:
    """The engine's parameter (and part) for checkpoint tensor ``name``; None for a
    tensor it does not load (rotary caches)."""
    name = name.removeprefix("model.")
    if "rotary_emb" in name:
        return None
    if name.endswith(".scale"):  # DeepSeek's name for a quantized weight's scales
        name = name.removesuffix(".scale") + ".weight_scale_inv"
    name = RENAMES.get(name, name)
    name = re.sub(r"\.hc_(attn|ffn|head)_(fn|base|scale)$", r".hc_\1.\2", name)
    expert = re.search(r"\.experts\.(\d+)\.(w[123])\.weight(_scale_inv)?$", name)
    if expert:
        proj, scale = PROJ[expert[2]], expert[3] or ""
        stacked = ("down_proj" if proj == "down" else "gate_up_proj") + scale
        half = None if proj == "down" else proj
        return Target(f"{name[: expert.start()]}.experts.{stacked}", int(expert[1]), half)
    shared = re.search(r"\.shared_experts\.(w[123])\.weight(_scale_inv)?$", name)
    if shared:
        proj, prefix, leaf = PROJ[shared[1]], name[: shared.start()], "weight" + (shared[2] or "")
        if proj == "down":
            return Target(f"{prefix}.shared_experts.down_proj.{leaf}")
        return Target(f"{prefix}.shared_experts.gate_up_proj.{leaf}", half=proj)
    return Target(name)
