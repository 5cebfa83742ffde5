"""The step's metadata and kernels, visible to every layer of the model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    attn_metadata: Any  # what backend.build_metadata(meta) built
    backend: AttentionBackend[Any]


_context: ForwardContext | None = None


@contextmanager
def forward_context(
    meta: AttentionMetadata, attn_metadata: Any, backend: AttentionBackend[Any]
) -> Iterator[ForwardContext]:
    """Make this step's metadata and kernels visible to every layer of the
    model, without threading them through each layer's forward signature."""
    global _context
    _context = ForwardContext(meta, attn_metadata, backend)
    try:
        yield _context
    finally:
        _context = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("the model ran outside forward_context(); use the ModelRunner")
    return _context
