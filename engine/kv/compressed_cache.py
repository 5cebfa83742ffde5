"""The paged cache of a DeepSeek-V4 attention layer, one spec per layer in the pool.

Every layer keeps, per token slot (the same (block, slot) address as every other
layer, through the request's one block table):

- ``kv``: the token's K = V row (head_dim numbers, normed and rotated): what the
  sliding window reads;

and a layer with a compressor (CSA, HCA) also:

- ``state``: the compressor's projections of the token, its kv and its gate
  (twice head_dim each under CSA's overlapping windows): what the compressor
  reads to close a window, maybe in a later step than the token's own;
- ``rows``: the compressed row of window w, at the slot of the window's last
  token (position w*m + m-1); the other slots of this tensor stay unused;

and a CSA layer, for its lightning indexer, the same two at index_head_dim:
``index_state`` and ``index_keys``.

This is a first version, and a plain one: everything is kept at the token rate,
so a block holds all that its tokens' rows and states need and nothing else.
That makes chunked prefill, preemption (recompute) and prefix-cache hits exact
with no extra bookkeeping (a block's contents depend only on the tokens up to
it), but it does not yet save the memory V4's compression is for: the raw rows
are not freed outside the window, and the compressed rows are not paged at 1/m
of the token rate in blocks of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.quant import QuantFormat


@dataclass
class CompressedKV:
    """One V4 layer's cache tensors, each [num_blocks, block_size, width]; the
    compressor's and indexer's are None in a layer that has none."""

    kv: torch.Tensor
    state: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    index_state: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        parts = (self.kv, self.state, self.rows, self.index_state, self.index_keys)
        return [t for t in parts if t is not None]


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """Widths per token slot: ``state_dim`` 0 for a sliding-window layer,
    ``index_state_dim`` 0 for any layer but CSA."""

    head_dim: int
    state_dim: int
    index_head_dim: int
    index_state_dim: int
    dtype: torch.dtype

    def widths(self) -> list[int]:
        compressed = [self.state_dim, self.head_dim] if self.state_dim else [0, 0]
        indexed = [self.index_state_dim, self.index_head_dim] if self.index_state_dim else [0, 0]
        return [self.head_dim, *compressed, *indexed]

    def block_bytes(self, block_size: int) -> int:
        return block_size * sum(self.widths()) * self.dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> CompressedKV:
        def part(width: int) -> torch.Tensor | None:
            if not width:
                return None
            shape = (num_blocks, block_size, width)
            return torch.empty(shape, dtype=self.dtype, device=device)  # the pool zeroes it

        return CompressedKV(*(part(w) for w in self.widths()))

    def quantized(self, fmt: QuantFormat) -> CompressedAttentionSpec:
        raise ValueError(
            f"kv_cache_dtype={fmt.name!r} is not supported on DeepSeek-V4 yet: its "
            "compressor reads its states back in the model's dtype"
        )


def slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots of one sequence's ``positions``, through its block table."""
    blocks = block_table.long()[positions // block_size]
    return blocks * block_size + positions % block_size


def write(cache: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """values [n, width] into slots ``where`` [n] of a [blocks, block_size, width] tensor."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, where, values.to(cache.dtype))


def read(cache: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """The rows [n, width] at slots ``where`` [n]."""
    return cache.view(-1, cache.shape[-1])[where]
