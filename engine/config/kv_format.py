"""The KV cache's element formats: what ``kv_cache_dtype`` may name. The codes
and scales themselves, and how numbers become codes, are the cache's
(engine/kv/quant.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    """A one-byte code for cached numbers."""

    name: str  # what kv_cache_dtype calls it
    storage: torch.dtype  # the codes' dtype in the cache
    qmax: float  # the largest code's magnitude

    @property
    def is_float(self) -> bool:
        return self.storage.is_floating_point


FORMATS = {
    "fp8_e4m3": QuantFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "int8": QuantFormat("int8", torch.int8, 127.0),
}
KV_CACHE_DTYPES = ("auto", *FORMATS)


def quant_format(kv_cache_dtype: str) -> QuantFormat | None:
    """The format ``kv_cache_dtype`` names; None for "auto" (the model's dtype)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in FORMATS:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}"
        )
    return FORMATS[kv_cache_dtype]
