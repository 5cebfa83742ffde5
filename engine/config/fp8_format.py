"""What a checkpoint's config.json says about its FP8 weights, and what the
engine accepts of it: DeepSeek's layout, FP8 e4m3 weights with one scale per
128 x 128 block (``weight_scale_inv``: the weight is the stored values times it).

DeepSeek-V3's config.json reads
``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"}``; V3.1 and later add ``"scale_fmt": "ue8m0"``
(every scale a power of two). ``activation_scheme: dynamic`` is what DeepSeek's
GPUs do to activations (FP8 per 1 x 128 group, scales made on the fly); a CPU
multiplies full-precision activations by the dequantized weight instead.

DeepSeek-V4 adds ``expert_dtype: fp4`` (top level in V4's config.json, inside
quantization_config from V4.1 on; transformers folds the first into the second,
and so does fp8_format): its routed experts are FP4 e2m1, two values a byte,
with one scale per row and 32 columns (layers/quantization/fp4.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.deepseek_v4 import V4_ARCHITECTURE

BLOCK = 128  # rows and columns of one scale's block
FP4_GROUP = 32  # columns of one FP4 expert scale's group (one row each)


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's block-scaled FP8 weights, as the engine reads them."""

    block: tuple[int, int] = (BLOCK, BLOCK)
    scale_fmt: str | None = None  # "ue8m0": every scale is a power of two
    expert_dtype: str = "fp8"  # "fp4": DeepSeek-V4's routed experts, FP4 e2m1


# Each quantization_config key the engine reads, and the values it implements.
ACCEPTED = {
    "quant_method": ("fp8",),
    "fmt": ("e4m3",),
    "activation_scheme": ("dynamic",),
    "weight_block_size": ([BLOCK, BLOCK],),
    "scale_fmt": (None, "float", "ue8m0"),  # "float" is transformers' name for None
    "expert_dtype": ("fp8", "fp4"),
}


def fp8_format(raw: dict) -> Fp8Format | None:
    """The FP8 format of a config.json (its dict), None when it has no
    quantization_config; any other method, format, block or scale format is a
    ValueError that names the key and what is supported. FP4 experts are
    DeepSeek-V4's only."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    defaults = {
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": None,
        "expert_dtype": raw.get("expert_dtype") or "fp8",  # V4's top-level field
    }
    for key, accepted in ACCEPTED.items():
        value = quant.get(key, defaults.get(key))
        if value not in accepted:
            shown = ", ".join(repr(a) for a in accepted)
            raise ValueError(
                f"unsupported quantization_config {key} {value!r} in config.json; "
                f"supported: {shown} (DeepSeek's block-scaled FP8)"
            )
    unknown = sorted(set(quant) - set(ACCEPTED) - {"modules_to_not_convert"})
    if unknown:
        raise ValueError(f"unsupported quantization_config key {unknown[0]!r} in config.json")
    expert_dtype = quant.get("expert_dtype", defaults["expert_dtype"])
    architecture = (raw.get("architectures") or [None])[0]
    if expert_dtype == "fp4" and architecture != V4_ARCHITECTURE:
        raise ValueError(
            f"unsupported quantization_config expert_dtype 'fp4' for {architecture}: "
            f"FP4 experts are {V4_ARCHITECTURE}'s only"
        )
    scale_fmt = quant.get("scale_fmt")
    return Fp8Format(
        scale_fmt=None if scale_fmt == "float" else scale_fmt, expert_dtype=expert_dtype
    )
