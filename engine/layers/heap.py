"""Giving freed memory back to the system while a model's weights are replaced.

Loading replaces weights layer by layer: oneDNN's packed copies (linear.py),
quantized copies (quantization/int_loading.py). Each freed weight raises glibc's
threshold for serving allocations from mmap, so the copies that follow come from
the heap, and the heap keeps what is freed there: measured on a Qwen3 shape of 8
layers (benchmarks/weight_rss.py), packing raised the bf16 load's peak RSS from
about 1.1x the checkpoint above the import to 2.1x, and quantizing to int8 left
2.7x, until each replacement was followed by malloc_trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch


def trim_heap() -> None:
    """glibc's malloc_trim(0): free heap memory back to the system; elsewhere nothing."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def free_weights(*params: torch.Tensor) -> None:
    """Give replaced weights' memory back: each keeps its shape (a zero, expanded),
    since the load's own references to it may outlive the layer; then trim_heap."""
    for param in params:
        param.data = torch.zeros((), dtype=param.dtype).expand(param.shape)
    trim_heap()


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()
