"""DeepSeek's FP8 GEMM: activations quantized per token and 128 columns, weights
per 128 x 128 block, and the product promoted to float32 once every 128 terms.

This is the scheme of DeepGEMM (github.com/deepseek-ai/DeepGEMM at commit
54e22612409371d6364144b69086735beb54e98b: README.md, and per_token_cast_to_fp8
in deep_gemm/utils/math.py), which DeepSeek-V3 and later run with the
checkpoint's own ``activation_scheme: dynamic``:

* Activations. Each token's row is cut into groups of 128 columns (the last one
  partial). A group's scale is s = max(amax, 1e-4) / 448, amax its largest
  magnitude in float32 and 448 E4M3's largest value; its codes are the E4M3
  values nearest to x * (1 / s), ties to even. The floor 1e-4 keeps the scale of
  an all-zero group above zero: its codes are all zero, never 0 / 0.
* Weights are a checkpoint's: E4M3 codes Q and a float32 scale per 128 x 128
  block, kept here as one row of block scales per weight row (the layout of
  engine/layers/quantization/fp8.py).
* The product. For each output tile, K is walked in blocks of 128: the block's
  code products (each exact) are summed into a float32 partial sum, that partial
  sum is multiplied by (activation scale of the token and block) x (weight scale
  of the row and block), and added to a float32 accumulator. The bias is added
  to the accumulator in float32, then the result is rounded once to the
  activations' dtype. Hopper's FP8 tensor cores sum with about 14 bits
  (DeepSeek-V3 technical report, section 3.3.2); over thousands of terms that
  loses digits, and promoting every 128 bounds what any one partial sum loses.

Triton's interpreter mishandles FP8 casts (it rounds some values to half their
size), so codes are made and read by integer arithmetic here, as the quantized
KV cache's are (common.fp8_e4m3_value). On a GPU with FP8 tensor cores (compute
capability 8.9 and up) the blocks' products run on them; elsewhere codes are
widened to bfloat16 (the interpreter: float32), which holds every E4M3 value
exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.availability import interpreter_active
from engine.kernels.common import fp8_e4m3_value

GROUP = 128  # columns per activation scale, and the K block of the weight scales
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def fp8_e4m3_code(v):
    """The E4M3 byte nearest to float32 v (|v| <= 448 after rounding), ties to even.

    From 2^-6 up, E4M3 keeps 3 of float32's 23 mantissa bits: the 20 dropped are
    rounded off the bit pattern (a carry moves into the exponent, as it should), and
    the exponent's bias goes from 127 to 7: the code is (E - 120) * 8 + m. Below
    2^-6 codes are multiples of 2^-9 (code 8 is 2^-6 again): |v| * 2^9 plus 2^23
    rounds to an integer in float32's own addition, read back from its low bits.
    """
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    shifted = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    subnormal = shifted.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.minimum(tl.where(mag < 0x3C800000, subnormal, normal), 126)  # 0x3C800000 = 2^-6
    return (code | tl.where(bits < 0, 128, 0)).to(tl.uint8)


@triton.jit
def quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    num_tokens,
    cols,
    stride_x,
    stride_codes,
    stride_scales,
    BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Codes and scale of BLOCK_T tokens' group program_id(1) of GROUP columns."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    mask = (tokens < num_tokens)[:, None] & (offs < cols)[None, :]
    rows = tokens.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    scale = tl.math.div_rn(amax, 448.0)
    codes = fp8_e4m3_code(x * tl.math.div_rn(1.0, scale)[:, None])
    tl.store(codes_ptr + rows * stride_codes + offs[None, :], codes, mask=mask)
    scale_ptrs = scales_ptr + tokens * stride_scales + tl.program_id(1)
    tl.store(scale_ptrs, scale, mask=tokens < num_tokens)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, cols] as E4M3 codes [tokens, cols] (float8_e4m3fn) and float32
    scales [tokens, ceil(cols / 128)]: per group of 128 columns, s = max(amax,
    1e-4) / 448 and codes nearest to x * (1 / s), all in float32 (module doc)."""
    if x.dim() != 2 or x.dtype not in _OUT_DTYPES:
        raise ValueError(f"x must be 2-D float32, float16 or bfloat16, got {x.dtype} {x.shape}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    tokens, cols = x.shape
    codes = torch.empty(tokens, cols, dtype=torch.uint8, device=x.device)
    scales = torch.empty(tokens, triton.cdiv(cols, GROUP), dtype=torch.float32, device=x.device)
    if tokens and cols:
        block_t = min(16, triton.next_power_of_2(tokens))
        grid = (triton.cdiv(tokens, block_t), scales.shape[1])
        quantize_kernel[grid](
            x, codes, scales, tokens, cols, x.stride(0), codes.stride(0), scales.stride(0),
            BLOCK_T=block_t, GROUP=GROUP,
        )  # fmt: skip
    return codes.view(torch.float8_e4m3fn), scales


@triton.jit
def block_dot(a, w, FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """sum_k a[m, k] * w[n, k] in float32 for one K block of E4M3 codes (as bytes):
    on FP8 tensor cores, or on the exact values widened to DOT_DTYPE."""
    if FP8_DOT:
        a_op = a.to(tl.float8e4nv, bitcast=True)
        w_op = w.to(tl.float8e4nv, bitcast=True)
    else:
        a_op = fp8_e4m3_value(a).to(DOT_DTYPE)
        w_op = fp8_e4m3_value(w).to(DOT_DTYPE)
    return tl.dot(a_op, tl.trans(w_op), input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def scaled_block(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, kb, offs_m, offs_n, mask_m, mask_n, K,
    stride_a, stride_as, stride_w, stride_ws,
    BLOCK_K: tl.constexpr, FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """K block kb's float32 partial sums times (activation scale x weight scale);
    columns past K load as code 0, rows and tokens past the tile's edge as 0 too."""
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    a = tl.load(
        a_ptr + offs_m[:, None] * stride_a + offs_k[None, :],
        mask=mask_m[:, None] & mask_k[None, :],
        other=0,
    )
    w = tl.load(
        w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
        mask=mask_n[:, None] & mask_k[None, :],
        other=0,
    )
    a_s = tl.load(a_scale_ptr + offs_m * stride_as + kb, mask=mask_m, other=0.0)
    w_s = tl.load(w_scale_ptr + offs_n * stride_ws + kb, mask=mask_n, other=0.0)
    return block_dot(a, w, FP8_DOT, DOT_DTYPE) * (a_s[:, None] * w_s[None, :])


@triton.jit
def fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K,
    stride_a, stride_as, stride_w, stride_ws, stride_out,
    HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum over K blocks of scaled_block, plus bias[n], in float32,
    rounded once to out's dtype; one program per BLOCK_M x BLOCK_N tile."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    offs_m, offs_n = offs_m.to(tl.int64), offs_n.to(tl.int64)  # a weight may pass 2^31 bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        acc += scaled_block(
            a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, kb, offs_m, offs_n, mask_m, mask_n, K,
            stride_a, stride_as, stride_w, stride_ws, BLOCK_K, FP8_DOT, DOT_DTYPE,
        )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_dot_supported(device: torch.device) -> bool:
    """Whether the blocks' products run on FP8 tensor cores: not in the interpreter
    (its FP8 casts are wrong), and on CUDA from compute capability 8.9 (Ada,
    Hopper). A CPU tensor outside the interpreter reaches here only when a test
    compiles the kernel for a GPU target without one; it gets the FP8 path."""
    if interpreter_active():
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_gemm(
    x: torch.Tensor,
    q: torch.Tensor,
    row_scales: torch.Tensor,
    bias: torch.Tensor | None,
    fp8_dot: bool | None = None,
) -> torch.Tensor:
    """x [tokens, cols] times the FP8 weight q [rows, cols] (float8_e4m3fn) with its
    block scales row_scales [rows, ceil(cols / 128)], transposed, plus bias [rows]:
    x is quantized by quantize_per_token, then each output is the float32 sum over
    K blocks of (block's code products) x a_scale x w_scale, plus bias, rounded to
    x's dtype (module doc). fp8_dot=None: FP8 tensor cores where the device has them."""
    rows, cols = q.shape
    if q.dtype != torch.float8_e4m3fn or q.stride(1) != 1:
        raise ValueError(f"q must be float8_e4m3fn with contiguous rows, got {q.dtype}")
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's {cols} columns")
    if row_scales.shape != (rows, triton.cdiv(cols, GROUP)) or row_scales.dtype != torch.float32:
        raise ValueError(f"row_scales must be float32 {(rows, triton.cdiv(cols, GROUP))}")
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"bias must have shape ({rows},), got {tuple(bias.shape)}")
    codes, scales = quantize_per_token(x)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    if out.numel():
        fp8_dot = fp8_dot_supported(x.device) if fp8_dot is None else fp8_dot
        block_m = min(64, max(16, triton.next_power_of_2(x.shape[0])))
        block_n = 64 if x.shape[0] <= 16 else 128  # more programs for a decode step
        grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(rows, block_n))
        fp8_gemm_kernel[grid](
            codes.view(torch.uint8), scales, q.view(torch.uint8), row_scales.contiguous(),
            bias.contiguous() if bias is not None else out, out, x.shape[0], rows, cols,
            codes.stride(0), scales.stride(0), q.stride(0), row_scales.shape[1], out.stride(0),
            HAS_BIAS=bias is not None, FP8_DOT=fp8_dot,
            DOT_DTYPE=tl.float32 if interpreter_active() else tl.bfloat16,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP,
        )  # fmt: skip
    return out
