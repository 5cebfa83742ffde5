"""The cache of a DeepSeek-V3.2 sparse-attention (DSA) layer: MLA's latent rows,
and beside them the lightning indexer's keys.

The indexer (engine/layers/indexer.py) scores every cached token for each query
against one key per token, ``index_head_dim`` numbers shared by its heads. Those
keys are paged exactly as the latents are: a token's key sits at the same
(block, slot) as its latent row, so the request's one block table reaches both.
The layer's spec is therefore one spec of two parts, and its cache shows the pool
both tensors (`IndexedLatentKV.tensors`): zeroing blocks, and copying them out
and back in, cover the keys with no change to the pool.

Then the indexer keeps each query's ``index_topk`` best positions, and MLA reads
only those rows (`gather_selected`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config.kv_format import QuantFormat
from engine.kv.kv_cache import LatentKV, MLACacheSpec
from engine.utils import cdiv


@dataclass
class IndexedLatentKV(LatentKV):
    """A DSA layer's cache: MLA's rows [num_blocks, block_size, rank + rope], and
    the indexer's keys [num_blocks, block_size, index_head_dim]. It is a LatentKV,
    so every backend's MLA store, gather and decode read it unchanged."""

    index_keys: torch.Tensor = field(kw_only=True)  # after LatentKV's defaulted fields

    def tensors(self) -> list[torch.Tensor]:
        return [self.rows, self.index_keys]


@dataclass(frozen=True)
class IndexedLatentSpec:
    """MLA's latent spec, plus an indexer key of ``index_head_dim`` numbers per token."""

    latent: MLACacheSpec
    index_head_dim: int

    def index_bytes(self, block_size: int) -> int:
        """The indexer keys' part of a block."""
        return block_size * self.index_head_dim * self.latent.dtype.itemsize

    def block_bytes(self, block_size: int) -> int:
        return self.latent.block_bytes(block_size) + self.index_bytes(block_size)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> IndexedLatentKV:
        rows = self.latent.allocate(num_blocks, block_size, device).rows
        shape = (num_blocks, block_size, self.index_head_dim)
        keys = torch.empty(shape, dtype=self.latent.dtype, device=device)  # the pool zeroes it
        return IndexedLatentKV(rows, index_keys=keys)

    def quantized(self, fmt: QuantFormat) -> IndexedLatentSpec:
        raise ValueError(
            f"kv_cache_dtype={fmt.name!r} is not supported on DeepSeek-V3.2's sparse "
            "attention yet: its selected-row reads take an unquantized latent"
        )


def store_index_keys(
    keys: torch.Tensor, cache: IndexedLatentKV, slot_mapping: torch.Tensor
) -> None:
    """Write this step's indexer keys [tokens, index_head_dim] into their slots."""
    flat = cache.index_keys.view(-1, cache.index_keys.shape[-1])
    flat.index_copy_(0, slot_mapping, keys.to(flat.dtype))


def gather_index_keys(
    cache: IndexedLatentKV, block_table: torch.Tensor, context: int
) -> torch.Tensor:
    """The first ``context`` indexer keys [context, index_head_dim] of one sequence,
    read through its block table (one row of the step's, padded with -1)."""
    blocks = block_table[: cdiv(context, cache.index_keys.shape[1])].long()
    return cache.index_keys[blocks].flatten(0, 1)[:context]


def gather_selected(
    cache: LatentKV, block_tables: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The latent rows [seqs, k, rank + rope] at ``positions`` [seqs, k] of each
    sequence, through its row of ``block_tables``. A position of -1 (no token
    chosen) reads the sequence's first row, for the caller to mask."""
    block_size = cache.rows.shape[1]
    pos = positions.clamp(min=0).long()
    blocks = block_tables.long().gather(1, pos // block_size)
    slots = blocks * block_size + pos % block_size
    return cache.rows.view(-1, cache.rows.shape[-1])[slots]
