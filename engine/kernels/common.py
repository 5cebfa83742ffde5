"""What the attention kernels share: the dtype their matrix products run in,
and the inner loop over key tiles that decode and prefill both run."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.availability import interpreter_active

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operand dtype of `tl.dot` for activations and cache of `dtype`.

    On the GPU it is the cache dtype itself, so that float16 and bfloat16
    products run on tensor cores at full rate; the kernels accumulate in
    float32 whatever the operands. The interpreter multiplies with numpy,
    which has no bfloat16 (it holds one as uint16), so there bfloat16 operands
    are widened to float32, which represents them exactly.
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; expected float32, float16 or bfloat16")
    if dtype == torch.bfloat16 and interpreter_active():
        return tl.float32
    return _TL_DTYPES[dtype]


# How a cache holds its numbers, for the kernels' CODES parameter: the numbers
# themselves, or one-byte codes (engine/kv/quant.py) with a float32 scale per
# (token, KV head), int8 or FP8 E4M3. FP8 codes are read as their bytes and
# decoded by arithmetic, since Triton's interpreter mishandles FP8 casts.
NUMBERS, INT8_CODES, FP8_CODES = 0, 1, 2


def cache_codes(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cache as the kernels read it, and its CODES value."""
    if cache.dtype == torch.int8:
        return cache, INT8_CODES
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8), FP8_CODES
    return cache, NUMBERS


@triton.jit
def fp8_e4m3_value(bits):
    """FP8 E4M3 bytes as float32: (1 + m/8) * 2^(e - 7), or m/8 * 2^-6 when e is 0."""
    b = bits.to(tl.int32)
    exp = (b >> 3) & 15
    man = (b & 7).to(tl.float32)
    normal = (8.0 + man) * tl.exp2((exp - 10).to(tl.float32))
    magnitude = tl.where(exp == 0, man * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where((b & 128) != 0, -magnitude, magnitude)


@triton.jit
def code_values(raw, CODES: tl.constexpr):
    """Codes as loaded from a quantized cache, as float32, before their scales."""
    if CODES == 2:
        return fp8_e4m3_value(raw)
    return raw.to(tl.float32)


@triton.jit
def load_k_tile(
    k_cache_ptr,
    k_scale_ptr,
    block_tables_ptr,
    seq,
    max_blocks_per_seq,
    start,
    end,
    kv_head,
    offs_d,
    mask_d,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CODES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """K for BLOCK_N consecutive tokens from `start`, transposed to [BLOCK_D, BLOCK_N]
    for q @ k, gathered slot by slot through the block table. Also returns the
    tokens' positions, which of them are before `end`, and their cache offsets."""
    offs_n = start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    block = tl.load(
        block_tables_ptr + seq * max_blocks_per_seq + offs_n // BLOCK_SIZE,
        mask=mask_n,
        other=0,
    )
    block = tl.where(mask_n, block, 0)  # never form a pointer from a -1 entry
    slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    kv_offset = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
    k = tl.load(
        k_cache_ptr + kv_offset[None, :] + offs_d[:, None],
        mask=mask_n[None, :] & mask_d[:, None],
        other=0,
    )
    if CODES != 0:  # codes: times each token's scale, at (slot, kv_head)
        k_scales = tl.load(k_scale_ptr + kv_offset // HEAD_DIM, mask=mask_n, other=0.0)
        k = code_values(k, CODES) * k_scales[None, :]
    return offs_n, mask_n, kv_offset, k.to(DOT_DTYPE)


@triton.jit
def online_softmax_step(
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
    HEAD_DIM: tl.constexpr,
    CODES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Fold one tile of (masked, base-2) scores and its values into the running max
    m_i, the running denominator l_i and the running weighted sum acc."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)  # rescale what was summed so far to the new max
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_cache_ptr + kv_offset[:, None] + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0,
    )
    if CODES != 0:
        v_scales = tl.load(v_scale_ptr + kv_offset // HEAD_DIM, mask=mask_n, other=0.0)
        v = code_values(v, CODES) * v_scales[:, None]
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
    return m_new, l_i, acc
