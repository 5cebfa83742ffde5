"""Sparse MLA decode (DeepSeek-V3.2's DSA): absorbed MLA attention over the rows a
lightning indexer chose, reading those rows alone.

Each decode comes with its chosen positions, valid ones first and -1 after
(engine/layers/indexer.py). The kernel walks that list instead of the context:
a tile of BLOCK_N entries gives BLOCK_N positions, each turned into a cache slot
through the sequence's block table, and only those [c, k_rope] rows are loaded.
Scores, online softmax and values are mla_decode.py's: every head scores the
row's c and k_rope parts, and sums its c parts.

The list is cut into splits of KV_SPLIT_SIZE entries, as a context is in
decode_attention.py (flash-decoding), and decode_attention's stage 2 merges
the splits of each head in order; it takes the number of valid entries where
the dense kernels give a context length.
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
def sparse_mla_decode_stage1_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    chosen_ptr,
    counts_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
    batch,
    max_blocks_per_seq,
    stride_chosen,
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

    count = tl.load(counts_ptr + seq, mask=seq < batch, other=0)
    split_start = split * KV_SPLIT_SIZE
    if split_start >= count:
        return  # fewer chosen rows; stage 2 never reads this split
    split_end = tl.minimum(split_start + KV_SPLIT_SIZE, count)

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

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for start in range(split_start, split_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_end
        # The chosen positions, then their blocks: two indirections, no pointer
        # formed from a -1 (masked entries read position 0 and block 0).
        pos = tl.load(chosen_ptr + seq * stride_chosen + offs_n, mask=mask_n, other=0)
        pos = tl.where(mask_n, pos, 0)
        block = tl.load(
            block_tables_ptr + seq * max_blocks_per_seq + pos // BLOCK_SIZE,
            mask=mask_n,
            other=0,
        )
        block = tl.where(mask_n, block, 0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        row = cache_ptr + slot * (RANK + ROPE_DIM)
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
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision="ieee")
        m_i = m_new

    mid = seq * stride_mid_b + heads * stride_mid_h + split * stride_mid_s
    tl.store(
        mid_o_ptr + mid[:, None] * RANK + offs_c[None, :],
        acc / l_i[:, None],
        mask=mask_h[:, None] & mask_c[None, :],
    )
    tl.store(mid_lse_ptr + mid, m_i + tl.log2(l_i), mask=mask_h)


def sparse_mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    chosen: torch.Tensor,
    rank: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of q ([batch, num_heads, rank + rope_dim]) over the
    rows at ``chosen`` ([batch, k] positions in each sequence, valid ones first,
    then -1) of the paged latents ([num_blocks, block_size, rank + rope_dim]),
    reached through block_tables[i]. Returns `out` ([batch, num_heads, rank])."""
    batch, num_heads, width = q.shape
    _, block_size, cache_width = cache.shape
    assert cache_width == width and 0 < rank < width, (q.shape, cache.shape, rank)
    assert cache.is_contiguous() and q.stride(2) == 1
    assert block_tables.shape[0] == batch and block_tables.is_contiguous()
    assert chosen.shape[0] == batch and chosen.stride(1) == 1
    if out is None:
        out = torch.empty((batch, num_heads, rank), dtype=q.dtype, device=q.device)
    assert out.shape == (batch, num_heads, rank) and out.stride(2) == 1
    if batch == 0:
        return out
    counts = (chosen >= 0).sum(dim=1, dtype=torch.int32)

    max_splits = max(1, triton.cdiv(chosen.shape[1], KV_SPLIT_SIZE))
    mid_o = torch.empty((batch, num_heads, max_splits, rank), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_heads, max_splits), dtype=torch.float32, device=q.device)
    stride_mid = (num_heads * max_splits, max_splits, 1)

    block_h = 16  # query heads per program: the rows of each tl.dot
    sparse_mla_decode_stage1_kernel[(batch, triton.cdiv(num_heads, block_h), max_splits)](
        q,
        cache,
        block_tables,
        chosen,
        counts,
        mid_o,
        mid_lse,
        scale * LOG2_E,
        batch,
        block_tables.shape[1],
        chosen.stride(0),
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
        counts,
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
