"""RMSNorm, alone and fused with the residual add that precedes it in every layer.

One program normalises one row (token): the whole hidden vector fits in one
tile (next power of two of hidden), so the mean of squares is a single
reduction with no second pass over memory. The fused version reads x and the
residual once and writes both the sum (the next residual) and its norm, where
the unfused pair would read the sum back. Rounding follows Hugging Face's
LlamaRMSNorm step for step, so the result is the same as the model's own code:
the sum is rounded to the input dtype, the norm is computed in float32 and
rounded to the input dtype, and only then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    num_tokens,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    eps,
    HIDDEN_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN_SIZE  # the grid has one program per row, so rows are in range

    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
        x = x.to(tl.float32)

    variance = tl.sum(x * x, axis=0) / HIDDEN_SIZE
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = normed.to(tl.float32) * weight
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden_size = x.shape[-1]
    assert weight.shape == (hidden_size,) and weight.is_contiguous()
    x2d = x.reshape(-1, hidden_size)  # a view when x's rows are evenly strided
    assert x2d.stride(1) == 1
    out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    residual2d = residual_out = None
    if residual is not None:
        assert residual.shape == x.shape
        residual2d = residual.reshape(-1, hidden_size)
        assert residual2d.stride(1) == 1
        residual_out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    num_tokens = x2d.shape[0]
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden_size)
        rms_norm_kernel[(num_tokens,)](
            x2d,
            residual2d if residual is not None else x2d,  # unused without ADD_RESIDUAL
            weight,
            out,
            residual_out if residual is not None else out,
            num_tokens,
            x2d.stride(0),
            residual2d.stride(0) if residual is not None else 0,
            out.stride(0),
            residual_out.stride(0) if residual is not None else 0,
            eps,
            HIDDEN_SIZE=hidden_size,
            BLOCK=block,
            ADD_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 512)),
        )
    out = out.view(x.shape)
    return out, None if residual_out is None else residual_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) over the last dimension; a new tensor of x's shape and dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both new tensors; x and residual are not changed."""
    out, residual_out = _launch(x, residual, weight, eps)
    return out, residual_out
