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
