"""What the attention kernels share: the dtype their matrix products run in."""

from __future__ import annotations

import torch
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
