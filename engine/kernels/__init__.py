"""Triton kernels for the GPU path: paged KV-cache writes, paged attention (and MLA's
absorbed decode), RMSNorm, RoPE, and DeepSeek's block-scaled FP8 GEMM.

Each kernel lives in its own small module, next to the Python wrapper that
checks shapes, picks tile sizes and launches it; `engine.kernels.reference`
holds the float64 torch versions they are tested against. On the CPU they run
only in Triton's interpreter, with TRITON_INTERPRET=1 set before this package
is imported (see `availability`). Without Triton installed the package still
imports, so that `check_available` can say why the kernels are missing.
"""

from engine.kernels.availability import (
    available,
    check_available,
    compiled_kernel_modules,
    interpreter_active,
)

try:
    import triton  # noqa: F401
except ImportError:
    pass
else:
    # Importing the functions here, not lazily, also keeps `store_kvcache` the
    # function: importing a submodule binds its name in this package, and the
    # module store_kvcache would otherwise shadow the function of the same name.
    from engine.kernels.decode_attention import paged_decode_attention
    from engine.kernels.fp8_gemm import fp8_gemm, quantize_per_token
    from engine.kernels.mla_decode import paged_mla_decode
    from engine.kernels.prefill_attention import paged_prefill_attention
    from engine.kernels.rmsnorm import fused_add_rms_norm, rms_norm
    from engine.kernels.rotary import rotary_embedding
    from engine.kernels.sparse_mla_decode import sparse_mla_decode
    from engine.kernels.store_kvcache import store_kvcache

__all__ = [
    "available",
    "check_available",
    "compiled_kernel_modules",
    "fp8_gemm",
    "fused_add_rms_norm",
    "interpreter_active",
    "paged_decode_attention",
    "paged_mla_decode",
    "paged_prefill_attention",
    "quantize_per_token",
    "rms_norm",
    "rotary_embedding",
    "sparse_mla_decode",
    "store_kvcache",
]
