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

Blocks go in groups of ``row_group`` (the smallest compression rate, G): the
first block of each group holds the compressed rows of every window whose last
token lies in the group (row_slots), and is kept for the request's life. The
other blocks hold only raw rows and states, which nothing reads once they are
older than V4Config.window_tokens(): the scheduler's window gives them back as
the request runs (BlockManager.free_outside_window), so the blocks a request
holds grow at 1/G of the token rate. A group head is written until its group is
full, so the prefix cache hits only whole groups (BlockManager.match_prefix);
everything else in a block depends only on the tokens up to it, which makes
chunked prefill with boundaries inside windows, preemption (recompute) and
prefix hits exact.

Simplifications of this version: every block has room for every part (a group
head's raw rows and states, and the rows part of the other blocks, go unused),
and rows of all rates share the group of the smallest one, so an HCA layer's
few rows do not get blocks of their own at 1/128 of the token rate.
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


def row_slots(
    block_table: torch.Tensor, rows: torch.Tensor, rate: int, group: int, block_size: int
) -> torch.Tensor:
    """The cache slots of compressed rows ``rows`` [n] of one sequence at ``rate``:
    row w closes at token w*rate + rate-1, in group g of ``group`` blocks; it sits
    in slot w % block_size of the group's first block (a group of G blocks closes
    at most block_size rows at any rate >= G, consecutive ones, so no two meet)."""
    last = rows * rate + rate - 1
    heads = block_table.long()[last // (group * block_size) * group]
    return heads * block_size + rows % block_size


def write(cache: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """values [n, width] into slots ``where`` [n] of a [blocks, block_size, width] tensor."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, where, values.to(cache.dtype))


def read(cache: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """The rows [n, width] at slots ``where`` [n]."""
    return cache.view(-1, cache.shape[-1])[where]
