"""Float64 torch versions of the kernels: the yardstick the tests and the bench compare with.

They are slow and obvious on purpose: one sequence at a time, the paged cache
gathered into dense K and V, a full score matrix with an explicit causal mask.
Inputs of any dtype are widened to float64 and results are float64.
"""

from __future__ import annotations

import torch


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first context_len keys and values, [context_len, num_kv_heads, head_dim]."""
    blocks = block_table[block_table >= 0].long()  # every block it names; -1 pads the table
    k = k_cache[blocks].flatten(0, 1)[:context_len]
    v = v_cache[blocks].flatten(0, 1)[:context_len]
    return k.double(), v.double()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of varlen q over the paged cache (the prefill kernel's contract)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    cu = cu_seqlens_q.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        qi = q[cu[i] : cu[i + 1]].double()  # [n, num_heads, head_dim]
        k, v = gather_kv(k_cache, v_cache, block_tables[i], context_len)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # GQA: share kv heads
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(context_len - len(qi), context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[cu[i] : cu[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode is prefill with one query per sequence, at its last position."""
    cu_seqlens_q = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)


def paged_mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode: every head scores [c, k_rope] rows and sums their c parts."""
    out = torch.empty((*q.shape[:2], rank), dtype=torch.float64, device=q.device)
    for i, context_len in enumerate(context_lens.tolist()):
        blocks = block_tables[i][block_tables[i] >= 0].long()  # -1 pads the table
        latents = cache[blocks].flatten(0, 1)[:context_len].double()  # [context, rank + rope]
        weights = (q[i].double() @ latents.T * scale).softmax(-1)  # [heads, context]
        out[i] = weights @ latents[:, :rank]
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotary_embedding(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor
) -> torch.Tensor:
    """Neox-style rotation of x ([num_tokens, num_heads, head_dim]) by cos_sin_cache[positions]."""
    cos, sin = cos_sin_cache[positions].double()[:, None, :].chunk(2, dim=-1)
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's per-token FP8 rule, in torch's float32 and its E4M3 cast (round to
    nearest, ties to even): per group of 128 columns of a row (the last partial),
    s = max(amax, 1e-4) / 448 and codes = E4M3(x * (1 / s)). Returns the codes
    [tokens, cols] as float8_e4m3fn and s [tokens, groups] as float32."""
    groups = x.float().split(128, dim=1)
    scales = torch.stack([g.abs().amax(dim=1) for g in groups], dim=1).clamp(min=1e-4) / 448.0
    codes = [(g * (1.0 / scales[:, i, None])).to(torch.float8_e4m3fn) for i, g in enumerate(groups)]
    return torch.cat(codes, dim=1), scales


def fp8_gemm(
    x: torch.Tensor, q: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """out[m, n] = sum over K blocks k of (sum_{j in k} a[m, j] * q[n, j]) * (sa[m, k] *
    row_scales[n, k]), plus bias[n]; a and sa from quantize_per_token(x). In float64,
    in which each block's sum of code products is exact (products of 4-bit
    significands between 2^-18 and 2^18, 128 of them, fit 53 bits) and so is the
    product of two float32 scales."""
    codes, scales = quantize_per_token(x)
    a, w = codes.double(), q.double()
    out = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64, device=x.device)
    for k in range(scales.shape[1]):
        part = a[:, k * 128 : (k + 1) * 128] @ w[:, k * 128 : (k + 1) * 128].T
        out += part * (scales[:, k, None].double() * row_scales[None, :, k].double())
    return out if bias is None else out + bias.double()
