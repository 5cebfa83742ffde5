"""Write this step's keys and values into the paged KV cache.

One program per token copies that token's [num_kv_heads, head_dim] tile of K
and of V to the cache slot `slot_mapping` gives it. The cache is addressed as a
flat [num_blocks * block_size, num_kv_heads, head_dim] array, so the block
table never enters here: the model runner's batch preparation already turned
(block, offset) into a slot. A program whose slot is -1 (a padding row of a
CUDA graph's batch) returns before loading anything. The copy is exact: values are moved, not
converted, when the cache has the activations' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1)
    if slot < 0:
        return  # padding, or a token whose K/V the cache already holds

    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)

    # The cache is contiguous; int64 because a large cache has more than 2**31 elements.
    cache_offset = slot.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM)
    cache_offset += heads * HEAD_DIM + dims
    tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy k[t] and v[t] ([num_tokens, num_kv_heads, head_dim]) to cache slot slot_mapping[t].

    The caches are [num_blocks, block_size, num_kv_heads, head_dim] and contiguous;
    k and v may be strided views (the K and V parts of a fused QKV output)
    as long as head_dim is contiguous. Tokens whose slot is -1 are skipped.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, (v.shape, k.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1
    assert slot_mapping.shape == (num_tokens,)
    if num_tokens == 0:
        return
    store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
