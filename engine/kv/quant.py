"""A quantized KV cache: one byte per cached number, and a float32 scale per group.

``kv_cache_dtype="fp8_e4m3"`` keeps each number as an FP8 E4M3 code (1 sign bit,
4 exponent bits, 3 mantissa bits, largest value 448); ``"int8"`` as an integer in
[-127, 127]. Each group of numbers gets one scale, its largest magnitude over the
format's largest code, so the group's biggest number lands on the largest code and
the rest keep their ratios to it. A number is its code times its group's scale.

The group is one token's vector for one KV head (or, for MLA's latent, 128 of its
numbers, as FlashMLA's FP8 format does). A block is filled a token at a time, over
many steps, so a scale per block would have to be fixed before most of its numbers
exist; a scale per token is set when the token is written and never changes. It
costs 4 bytes per head per token beside head_dim bytes of codes.

Codes are written when a token's keys and values are stored (``quantize``), and
turned back into numbers only inside attention (``dequantize`` in the torch path,
the same arithmetic in the C++ operator and the Triton kernels).
"""

from __future__ import annotations

import torch

from engine.config.kv_format import QuantFormat

# The smallest largest-magnitude a group is scaled by: an all-zero group gets a
# tiny, finite, non-zero scale (and codes of zero), never 0 or a division by 0.
MIN_AMAX = 1e-30


def quantize(x: torch.Tensor, fmt: QuantFormat, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (codes [..., n] in fmt.storage, scales [..., n // group] float32).

    Each run of ``group`` numbers along the last dimension is divided by its scale,
    amax / qmax, so that its largest magnitude becomes the largest code; FP8 then
    rounds to the nearest of its 256 values, int8 to the nearest integer."""
    groups = x.float().unflatten(-1, (-1, group))
    scales = groups.abs().amax(dim=-1).clamp(min=MIN_AMAX) / fmt.qmax
    scaled = (groups / scales[..., None]).clamp(-fmt.qmax, fmt.qmax)
    if not fmt.is_float:
        scaled = scaled.round()
    return scaled.to(fmt.storage).flatten(-2), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The numbers ``quantize`` coded: each code times its group's scale."""
    group = codes.shape[-1] // scales.shape[-1]
    groups = codes.float().unflatten(-1, (-1, group)) * scales[..., None]
    return groups.flatten(-2).to(dtype)


def error_bound(x: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """The most each number of x may move in a round trip, elementwise. int8: half a
    step, scale / 2. FP8 E4M3: half a unit in the last of its 3 mantissa bits, so
    |x| / 16, or, below the smallest normal code (2^-6), half the subnormal step
    2^-9, in units of the scale."""
    group = x.shape[-1] // scales.shape[-1]
    s = scales.repeat_interleave(group, dim=-1).double()
    if not fmt.is_float:
        return s / 2
    return torch.maximum(x.double().abs() / 16, s * 2.0**-10)
