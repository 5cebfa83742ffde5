"""The Protocol every attention backend meets, and the switch that picks one."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv.kv_cache import LatentKV, PagedKV

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

    def store_latent(
        self,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        cache: LatentKV,
        slot_mapping: torch.Tensor,
    ) -> None:
        """MLA's store: this step's [latent, rotary key] rows into their slots."""
        ...

    def gather_latents(
        self, cache: LatentKV, block_table: torch.Tensor, context: int
    ) -> torch.Tensor:
        """MLA's prefill read: the first ``context`` cached rows [context, rank + rope]
        of the sequence whose block table (one row of the step's) is given."""
        ...

    def mla_decode(
        self, q: torch.Tensor, cache: LatentKV, rank: int, attn_metadata: M, scale: float
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

    def sparse_mla_decode(
        self,
        q: torch.Tensor,
        cache: LatentKV,
        rank: int,
        chosen: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """MLA's absorbed decode over chosen rows alone (DeepSeek-V3.2's DSA): q
        [decodes, heads, rank + rope]; chosen [decodes, k] the positions each decode
        attends to, valid ones first, then -1; block_tables [decodes, max_blocks].
        Reads only the chosen rows; returns [decodes, heads, rank]."""
        ...


def get_backend(
    name: str, device: str, block_size: int, batch_invariant: bool = False
) -> AttentionBackend[Any]:
    """``batch_invariant``: kernels whose results for a row do not depend on the
    rest of the batch (see engine/layers/batch_invariant.py)."""
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
