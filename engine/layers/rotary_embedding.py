"""Rotary position embedding (RoPE), neox style, with llama3 or YaRN frequency
scaling, and DeepSeek's interleaved layout."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.attention.context import get_forward_context


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """One frequency per pair of dimensions, computed as transformers does."""
    if scaling is not None and scaling["rope_type"] == "yarn":
        return yarn_inverse_frequencies(head_dim, theta, scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    # llama3: slow down the low frequencies, keep the high ones, blend between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: sqrt(1/t) = 0.1 ln(s) + 1 for a context s times longer."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: keep the dimensions that turn many times within the original context
    (beta_fast rotations or more), divide the frequencies of those that turn less
    than beta_slow times by the factor, and ramp linearly between the two."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns this often
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    powers = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged), 0: interpolate (divided by factor)
    return 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep


def attention_factor(scaling: dict | None) -> float:
    """How much YaRN scales cos and sin, and so every q.k product (1 otherwise)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, mscale_all_dim = (
        scaling.get(k) for k in ("factor", "mscale", "mscale_all_dim")
    )
    if mscale and mscale_all_dim:  # DeepSeek moves part of it into the softmax scale
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout rotates the pairs (x0, x1), (x2, x3), ...; neox style pairs
    x[d] with x[d + head_dim/2]. Gathering the even dimensions in front of the odd
    ones turns the first into the second, so one rotation serves both, and its
    output is exactly transformers' apply_rotary_pos_emb_interleave."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None,
        interleaved: bool = False,
    ):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        scale = attention_factor(scaling)
        # [max_position, head_dim]: cos in the first half, sin in the second.
        self.register_buffer(
            "cos_sin_cache",
            torch.cat([freqs.cos() * scale, freqs.sin() * scale], -1),
            persistent=False,
        )
        self.interleaved = interleaved

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate each (x1, x2) pair of every head by its position's angle.

        q is [tokens, heads, head_dim]; positions says where each token sits in
        its own sequence, so tokens of many sequences can share one batch. The
        step's backend chooses the kernel.
        """
        if self.interleaved:
            q, k = deinterleave(q), deinterleave(k)
        backend = get_forward_context().backend
        return backend.rotary_embedding(positions, q, k, self.cos_sin_cache)
