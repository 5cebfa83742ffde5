"""Attention backends: the same paged attention, computed two ways.

``torch`` is the reference and runs everywhere. ``triton`` runs the kernels in
engine/kernels and is the default on CUDA. Both read the same metadata, built
once per step by the model runner, and the same paged KV cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.kv_cache import PagedKV


@dataclass
class AttentionMetadata:
    """One step's batch, as attention sees it. The batch is flattened: the
    tokens of every scheduled sequence sit end to end, decodes first."""

    slot_mapping: torch.Tensor  # [tokens] cache slot for each new token's K and V
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, padded with -1
    context_lens: torch.Tensor  # [seqs] int32: tokens in the cache after this step
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32: where each sequence's queries start
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    context_lens_cpu: list[int] = field(default_factory=list)
    query_lens_cpu: list[int] = field(default_factory=list)
    prepared: dict[str, Any] = field(default_factory=dict)  # a backend's own per-step data


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Per-step work shared by every layer (runs once, before the forward)."""

    def store_kvcache(
        self, k: torch.Tensor, v: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: PagedKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention for this step's queries; k and v are this step's new keys
        and values, already written to the cache."""


def get_backend(name: str, device: str) -> AttentionBackend:
    if name == "torch":
        from engine.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonBackend

        return TritonBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    backend: AttentionBackend


_context: ForwardContext | None = None


@contextmanager
def forward_context(meta: AttentionMetadata, backend: AttentionBackend):
    """Make this step's metadata visible to every Attention layer of the model,
    without threading it through each layer's forward signature."""
    global _context
    _context = ForwardContext(meta, backend)
    try:
        yield _context
    finally:
        _context = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention ran outside forward_context(); use the ModelRunner")
    return _context
