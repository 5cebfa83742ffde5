"""Rotary position embedding, neox style (rotate_half), for q and k in one launch.

One program per token: it reads that token's cos and sin once, from the row of
`cos_sin_cache` at its position, and rotates every query head and every key
head with them. Neox style pairs element d with element d + head_dim/2, so a
head is read as two halves, x1 and x2, and written as
[x1*cos - x2*sin, x2*cos + x1*sin]. The arithmetic is float32 whatever the
activations' dtype, rounded once at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    token,
    stride_x_t,
    stride_x_h,
    stride_out_t,
    stride_out_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF_DIM)
    x = x_ptr + token * stride_x_t + heads * stride_x_h + dims
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + token * stride_out_t + heads * stride_out_h + dims
    dtype = out_ptr.dtype.element_ty
    tl.store(out, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out + HALF_DIM, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def rotary_embedding_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_cache_ptr,
    q_out_ptr,
    k_out_ptr,
    num_tokens,
    max_position,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_q_out_t,
    stride_q_out_h,
    stride_k_out_t,
    stride_k_out_h,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    HALF_DIM: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token, mask=token < num_tokens, other=-1)
    if (position < 0) | (position >= max_position):
        return  # a bad position would read outside the cache; leave this token unwritten

    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_cache_ptr + position.to(tl.int64) * HEAD_DIM + dims
    mask = dims < HALF_DIM
    cos = tl.load(row, mask=mask, other=0.0).to(tl.float32)  # [1, BLOCK_HALF]
    sin = tl.load(row + HALF_DIM, mask=mask, other=0.0).to(tl.float32)

    _rotate_heads(
        q_ptr, q_out_ptr, token, stride_q_t, stride_q_h, stride_q_out_t, stride_q_out_h,
        cos, sin, NUM_HEADS, HALF_DIM, BLOCK_H, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, token, stride_k_t, stride_k_h, stride_k_out_t, stride_k_out_h,
        cos, sin, NUM_KV_HEADS, HALF_DIM, BLOCK_KV_H, BLOCK_HALF,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ([num_tokens, num_heads, head_dim]) and k ([num_tokens, num_kv_heads, head_dim]).

    Token t is rotated by the angles of position positions[t], whose row of
    cos_sin_cache ([max_position, head_dim], float32) is cat(cos, sin). Returns
    new contiguous tensors; q and k, which may be strided views of a fused QKV
    output, are not changed. A token whose position is outside the cache is
    left unwritten rather than read out of bounds.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert positions.shape == (num_tokens,)
    assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.is_contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    rotary_embedding_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q_out,
        k_out,
        num_tokens,
        cos_sin_cache.shape[0],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )
    return q_out, k_out
