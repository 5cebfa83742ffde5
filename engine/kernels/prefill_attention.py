"""Causal varlen attention for prefill, reading every key and value from the paged cache.

The new tokens' K/V are stored before attention runs, so the cache holds the
whole context: a cached prefix (a prefix-cache hit, or the earlier chunks of a
chunked prefill) followed by this step's tokens. Reading all keys from the
cache makes plain prefill, chunked prefill and prefix hits one case: sequence
i's n_i queries are the last n_i of its context_lens[i] positions, and a query
at position p attends to keys 0..p.

One program per (sequence, query head, tile of BLOCK_M queries) runs
flash-attention's online softmax over tiles of BLOCK_N keys, stopping at the
tile's last query position. Keys are gathered token by token through the block
table, as in decode, so blocks need not be contiguous and any block size works.
The work is matrix products, so the operands stay in the cache dtype for the
tensor cores (see `dot_dtype`); softmax statistics are float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import cache_codes, dot_dtype, load_k_tile, online_softmax_step

BLOCK_M = 64  # queries per program
BLOCK_N = 64  # keys per tile
LOG2_E = 1.4426950408889634  # softmax runs in base 2: exp(x) == exp2(x * log2(e))


@triton.jit
def prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale,
    batch,
    max_blocks_per_seq,
    stride_q_t,
    stride_q_h,
    stride_out_t,
    stride_out_h,
    NUM_KV_HEADS: tl.constexpr,
    QUERY_GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CODES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // QUERY_GROUP_SIZE

    valid_seq = seq < batch
    q_start = tl.load(cu_seqlens_q_ptr + seq, mask=valid_seq, other=0)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1, mask=valid_seq, other=0) - q_start
    if tile * BLOCK_M >= q_len:
        return  # the grid is sized for the longest query; this sequence is shorter
    context_len = tl.load(context_lens_ptr + seq, mask=valid_seq, other=0)
    prefix_len = context_len - q_len  # keys cached before this step's first query

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    mask_m = offs_m < q_len
    positions = prefix_len + offs_m  # query positions in the context
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp2(...) * v
    # Keys past the tile's last query are masked for every row: stop before them.
    kv_end = tl.minimum(context_len, prefix_len + (tile + 1) * BLOCK_M)
    for start in range(0, kv_end, BLOCK_N):
        offs_n, mask_n, kv_offset, k = load_k_tile(
            k_cache_ptr,
            k_scale_ptr,
            block_tables_ptr,
            seq,
            max_blocks_per_seq,
            start,
            kv_end,
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
        # Causal: a query sees keys up to its own position. Key 0 is visible to
        # every row, so each row's max is finite after the first tile.
        causal = offs_n[None, :] <= positions[:, None]
        scores = tl.where(causal & mask_n[None, :], scores, float("-inf"))
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

    out = acc / l_i[:, None]
    tl.store(
        out_ptr
        + (q_start + offs_m)[:, None] * stride_out_t
        + head * stride_out_h
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q ([num_tokens, num_heads, head_dim], sequences flattened) over the cache.

    Sequence i's queries are rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q, at
    the last positions of its context_lens[i] cached tokens. Returns `out`
    (q's shape and dtype), allocated if not given. `max_seqlen_q`, the longest
    query, sizes the grid; pass it when known, since computing it here waits
    for the GPU. A quantized cache has k_scale and v_scale, as for decode.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = cu_seqlens_q.shape[0] - 1
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_tables.shape[0] == batch and block_tables.is_contiguous()
    assert context_lens.shape == (batch,)
    k_cache, codes = cache_codes(k_cache)
    v_cache, _ = cache_codes(v_cache)
    assert (k_scale is None) == (v_scale is None) == (codes == 0)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or batch == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())

    prefill_attention_kernel[(batch, num_heads, triton.cdiv(max_seqlen_q, BLOCK_M))](
        q,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,  # unread without codes
        v_cache if v_scale is None else v_scale,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * LOG2_E,
        batch,
        block_tables.shape[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        QUERY_GROUP_SIZE=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(head_dim),
        CODES=codes,
        DOT_DTYPE=dot_dtype(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out
