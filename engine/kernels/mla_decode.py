"""Paged MLA decode attention, in the absorbed form: it reads only the latents.

Each cached token is one row [c, k_rope] of kv_lora_rank + rope_dim numbers,
shared by every head (engine/layers/mla.py). With W_UK folded into the query,
head h's score for a token is q_c[h] . c + q_rope[h] . k_rope, and with W_UV
folded into the output, its value is c itself. So a tile of latents is loaded
once and serves as the keys of every head and as their values: the memory a
decode step reads is one latent per token, whatever the number of heads.

The work is split over the context as in decode_attention.py (flash-decoding):
stage 1, one program per (sequence, block of heads, split of KV_SPLIT_SIZE
tokens), runs online softmax over its split and writes a normalised partial
output and its log-sum-exp; stage 2, decode_attention's own, merges the splits
in order. The scores' two parts run as two products, so the latent's width and
the rope width are each padded to a power of two on their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import dot_dtype
from engine.kernels.decode_attention import (
    BLOCK_N,
    KV_SPLIT_SIZE,
    LOG2_E,
    decode_attention_stage2_kernel,
)


@triton.jit
def mla_decode_stage1_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
    batch,
    max_blocks_per_seq,
    stride_q_b,
    stride_q_h,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_SPLIT_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq, mask=seq < batch, other=0)
    split_start = split * KV_SPLIT_SIZE
    if split_start >= context_len:
        return  # this sequence is shorter; stage 2 never reads this split
    split_end = tl.minimum(split_start + KV_SPLIT_SIZE, context_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < NUM_HEADS
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < RANK
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE_DIM
    q = q_ptr + seq * stride_q_b + heads[:, None] * stride_q_h
    q_c = tl.load(q + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q + RANK + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    q_c, q_r = q_c.to(DOT_DTYPE), q_r.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)  # running sum of exp2(...) * c
    for start in range(split_start, split_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_end
        block = tl.load(
            block_tables_ptr + seq * max_blocks_per_seq + offs_n // BLOCK_SIZE,
            mask=mask_n,
            other=0,
        )
        block = tl.where(mask_n, block, 0)  # never form a pointer from a -1 entry
        slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        row = cache_ptr + slot * (RANK + ROPE_DIM)
        # One load of the latents: the keys' first part, and the values.
        c = tl.load(
            row[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0
        )
        r = tl.load(
            row[:, None] + RANK + offs_r[None, :],
            mask=mask_n[:, None] & mask_r[None, :],
            other=0.0,
        )
        c, r = c.to(DOT_DTYPE), r.to(DOT_DTYPE)
        scores = tl.dot(q_c, tl.trans(c), input_precision="ieee")
        scores += tl.dot(q_r, tl.trans(r), input_precision="ieee")
        scores = tl.where(mask_n[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)  # rescale what was summed so far to the new max
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision="ieee")
        m_i = m_new

    # The split's own attention output, and the log2 of its softmax denominator.
    mid = seq * stride_mid_b + heads * stride_mid_h + split * stride_mid_s
    tl.store(
        mid_o_ptr + mid[:, None] * RANK + offs_c[None, :],
        acc / l_i[:, None],
        mask=mask_h[:, None] & mask_c[None, :],
    )
    tl.store(mid_lse_ptr + mid, m_i + tl.log2(l_i), mask=mask_h)


def paged_mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rank: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of q ([batch, num_heads, rank + rope_dim], one token
    per sequence) over the paged latents ([num_blocks, block_size, rank + rope_dim]).

    Sequence i attends to its first context_lens[i] cached tokens through
    block_tables[i]. Returns `out` ([batch, num_heads, rank], q's dtype): the
    softmax-weighted sum of the latents c, for W_UV to turn into each head's output.
    """
    batch, num_heads, width = q.shape
    _, block_size, cache_width = cache.shape
    assert cache_width == width and 0 < rank < width, (q.shape, cache.shape, rank)
    assert cache.is_contiguous() and q.stride(2) == 1
    assert block_tables.shape[0] == batch and block_tables.is_contiguous()
    if out is None:
        out = torch.empty((batch, num_heads, rank), dtype=q.dtype, device=q.device)
    assert out.shape == (batch, num_heads, rank) and out.stride(2) == 1
    if batch == 0:
        return out

    max_splits = max(1, triton.cdiv(block_tables.shape[1] * block_size, KV_SPLIT_SIZE))
    mid_o = torch.empty((batch, num_heads, max_splits, rank), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_heads, max_splits), dtype=torch.float32, device=q.device)
    stride_mid = (num_heads * max_splits, max_splits, 1)

    block_h = 16  # query heads per program: the rows of each tl.dot
    mla_decode_stage1_kernel[(batch, triton.cdiv(num_heads, block_h), max_splits)](
        q,
        cache,
        block_tables,
        context_lens,
        mid_o,
        mid_lse,
        scale * LOG2_E,
        batch,
        block_tables.shape[1],
        q.stride(0),
        q.stride(1),
        *stride_mid,
        NUM_HEADS=num_heads,
        RANK=rank,
        ROPE_DIM=width - rank,
        BLOCK_SIZE=block_size,
        KV_SPLIT_SIZE=KV_SPLIT_SIZE,
        BLOCK_H=block_h,
        BLOCK_C=max(16, triton.next_power_of_2(rank)),
        BLOCK_R=max(16, triton.next_power_of_2(width - rank)),
        BLOCK_N=BLOCK_N,
        DOT_DTYPE=dot_dtype(cache.dtype),
        num_warps=4,
        num_stages=2,
    )
    decode_attention_stage2_kernel[(batch, num_heads)](
        mid_o,
        mid_lse,
        out,
        context_lens,
        batch,
        *stride_mid,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=rank,
        KV_SPLIT_SIZE=KV_SPLIT_SIZE,
        BLOCK_D=triton.next_power_of_2(rank),
        num_warps=4,
    )
    return out
