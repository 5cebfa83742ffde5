"""Attention backends: the same paged attention, computed two ways.

``torch`` is the reference and runs everywhere. ``triton`` runs the kernels in
engine/kernels and is the default on CUDA. Both start from the same metadata,
built once per step by the model runner, and read the same paged KV cache.

A backend is the engine's one kernel switch: it also chooses the kernels for
RMSNorm and RoPE, which the layers call through the step's forward context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

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


M = TypeVar("M")  # a backend's own per-step metadata


class AttentionBackend(Protocol[M]):
    name: str

    def build_metadata(self, meta: AttentionMetadata) -> M:
        """The per-step work every layer shares, done once, before the forward."""
        ...

    def store_kvcache(
        self, k: torch.Tensor, v: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: PagedKV,
        attn_metadata: M,
        scale: float,
    ) -> torch.Tensor:
        """Attention for this step's queries; k and v are this step's new keys
        and values, already written to the cache."""
        ...

    def mla_decode(
        self, q: torch.Tensor, cache: torch.Tensor, rank: int, attn_metadata: M, scale: float
    ) -> torch.Tensor:
        """MLA's absorbed decode: q [decodes, heads, rank + rope] over the paged latents,
        one KV head for every query head; returns [decodes, heads, rank]. See
        layers/mla.py."""
        ...

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x), or (rmsnorm(x + residual), x + residual); see layers/layernorm.py."""
        ...

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by their positions; see layers/rotary_embedding.py."""
        ...


def get_backend(
    name: str, device: str, block_size: int, batch_invariant: bool = False
) -> AttentionBackend[Any]:
    """``batch_invariant``: kernels whose results for a row do not depend on the
    rest of the batch (see engine/batch_invariant.py)."""
    if name == "torch" and batch_invariant:
        from engine.attention.torch_split_kv import TorchSplitKVBackend

        return TorchSplitKVBackend(block_size)
    if name == "torch":
        from engine.attention.torch_backend import TorchBackend

        return TorchBackend(block_size)
    if name == "cpu":
        from engine import csrc
        from engine.attention.cpu_backend import CpuBackend

        if not csrc.load():
            raise RuntimeError(
                'the C++ CPU operators are unavailable; use attention_backend="torch"'
            )
        return CpuBackend(block_size)
    if name == "triton":
        from engine.attention.triton_backend import TritonBackend

        return TritonBackend(device, batch_invariant)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch', 'cpu' or 'triton'")


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
