"""Paged attention for decode: one query token per sequence, split over the KV length.

A decode step reads every cached key and value once and does little arithmetic
with them, so its speed is memory bandwidth, and bandwidth needs many programs
in flight. One program per (sequence, head) leaves the GPU idle when the batch
is small and the contexts long, so the KV length is split as in
flash-decoding:

* stage 1, one program per (sequence, kv head, split), runs online softmax over
  the split's KV_SPLIT_SIZE tokens for all the query heads that share the kv
  head (GQA), so each key and value is read from memory once, and writes the
  split's normalised output and log-sum-exp to a float32 scratch;
* stage 2, one program per (sequence, head), merges the splits in order.

The split size is a fixed number of tokens, not a number of splits chosen from
the batch: a sequence is cut at the same places, and its splits are merged in
the same order, whatever else is in the batch, so its output is bitwise the
same alone or batched. Keys are gathered token by token through the block
table, so blocks need not be contiguous and any block size works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import cache_codes, dot_dtype, load_k_tile, online_softmax_step

KV_SPLIT_SIZE = 256  # tokens per split; a multiple of BLOCK_N
BLOCK_N = 64  # keys per tile within a split
LOG2_E = 1.4426950408889634  # softmax runs in base 2: exp(x) == exp2(x * log2(e))


@triton.jit
def decode_attention_stage1_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    NUM_KV_HEADS: tl.constexpr,
    QUERY_GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_SPLIT_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CODES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq, mask=seq < batch, other=0)
    split_start = split * KV_SPLIT_SIZE
    if split_start >= context_len:
        return  # this sequence is shorter; stage 2 never reads this split
    split_end = tl.minimum(split_start + KV_SPLIT_SIZE, context_len)

    # The query heads of this kv head, padded to BLOCK_H >= 16 rows for tl.dot.
    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * QUERY_GROUP_SIZE + offs_h
    mask_h = offs_h < QUERY_GROUP_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)  # running sum of exp2(...) * v
    for start in range(split_start, split_end, BLOCK_N):
        offs_n, mask_n, kv_offset, k = load_k_tile(
            k_cache_ptr,
            k_scale_ptr,
            block_tables_ptr,
            seq,
            max_blocks_per_seq,
            start,
            split_end,
            kv_head,
            offs_d,
            mask_d,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_N,
            CODES,
            DOT_DTYPE,
        )
        scores = tl.dot(q, k, input_precision="ieee") * qk_scale
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(
            scores,
            m_i,
            l_i,
            acc,
            v_cache_ptr,
            v_scale_ptr,
            kv_offset,
            offs_d,
            mask_n,
            mask_d,
            HEAD_DIM,
            CODES,
            DOT_DTYPE,
        )

    # The split's own attention output, and the log2 of its softmax denominator.
    mid = seq * stride_mid_b + heads * stride_mid_h + split * stride_mid_s
    tl.store(
        mid_o_ptr + mid[:, None] * HEAD_DIM + offs_d[None, :],
        acc / l_i[:, None],
        mask=mask_h[:, None] & mask_d[None, :],
    )
    tl.store(mid_lse_ptr + mid, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def decode_attention_stage2_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    context_lens_ptr,
    batch,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    stride_out_b,
    stride_out_h,
    HEAD_DIM: tl.constexpr,
    KV_SPLIT_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq, mask=seq < batch, other=0)
    num_splits = tl.cdiv(context_len, KV_SPLIT_SIZE)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m_i = tl.full([], float("-inf"), tl.float32)  # running max of the splits' log-sum-exps
    l_i = tl.zeros([], tl.float32)  # running sum of exp2(lse - m_i)
    acc = tl.zeros([BLOCK_D], tl.float32)
    # Always in split order, so the result does not depend on the batch.
    for split in range(0, num_splits):
        mid = seq * stride_mid_b + head * stride_mid_h + split * stride_mid_s
        o = tl.load(mid_o_ptr + mid * HEAD_DIM + offs_d, mask=mask_d, other=0.0)
        lse = tl.load(mid_lse_ptr + mid, mask=split < num_splits, other=float("-inf"))
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + o * weight
        l_i = l_i * alpha + weight
        m_i = m_new

    # l_i >= 1 when there is any split (its largest term is exp2(0)); an empty
    # context (a padded batch entry) has l_i == 0 and gets zeros, not 0/0.
    out = acc / tl.maximum(l_i, 1.0)
    tl.store(
        out_ptr + seq * stride_out_b + head * stride_out_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q ([batch, num_heads, head_dim], one token per sequence) over the paged cache.

    Sequence i attends to its first context_lens[i] cached tokens (its own
    token included, already stored), found through block_tables[i]. Returns
    `out` ([batch, num_heads, head_dim], q's dtype), allocated if not given.
    A quantized cache holds int8 or FP8 codes, with k_scale and v_scale
    [num_blocks, block_size, num_kv_heads] float32 beside them.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_tables.shape[0] == batch and block_tables.is_contiguous()
    assert KV_SPLIT_SIZE % BLOCK_N == 0
    k_cache, codes = cache_codes(k_cache)
    v_cache, _ = cache_codes(v_cache)
    assert (k_scale is None) == (v_scale is None) == (codes == 0)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.stride(2) == 1
    if batch == 0:
        return out

    # The widest grid any sequence can need, from the block table's width rather
    # than context_lens.max(), which would wait for the GPU.
    max_splits = max(1, triton.cdiv(block_tables.shape[1] * block_size, KV_SPLIT_SIZE))
    mid_o = torch.empty(
        (batch, num_heads, max_splits, head_dim), dtype=torch.float32, device=q.device
    )
    mid_lse = torch.empty((batch, num_heads, max_splits), dtype=torch.float32, device=q.device)
    # Both scratch tensors share the strides of their first three dimensions,
    # in units of one (seq, head, split) entry.
    stride_mid = (num_heads * max_splits, max_splits, 1)

    group_size = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    decode_attention_stage1_kernel[(batch, num_kv_heads, max_splits)](
        q,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,  # unread without codes
        v_cache if v_scale is None else v_scale,
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
        NUM_KV_HEADS=num_kv_heads,
        QUERY_GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        KV_SPLIT_SIZE=KV_SPLIT_SIZE,
        BLOCK_H=max(16, triton.next_power_of_2(group_size)),
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        CODES=codes,
        DOT_DTYPE=dot_dtype(q.dtype),
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
        HEAD_DIM=head_dim,
        KV_SPLIT_SIZE=KV_SPLIT_SIZE,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out
