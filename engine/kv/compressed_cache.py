"""The paged cache of a DeepSeek-V4 attention layer, one spec per layer in the pool.

Every layer keeps, per token slot (the same (block, slot) address as every other
layer, through the request's one block table):

- ``kv``: the token's K = V row (head_dim numbers, normed and rotated): what the
  sliding window reads;

and a layer with a compressor (CSA, HCA) also:

- ``state``: the compressor's projections of the token, its kv and its gate
  (twice head_dim each under CSA's overlapping units): what the compressor
  reads to close a compression unit, maybe in a later step than the token's own;
- ``rows``: compressed rows, as many per block as a group of blocks closes at
  this layer's rate (ROW_LANES * block_size at the smallest rate, fewer above);

and a CSA layer, for its lightning indexer, the same two at index_head_dim:
``index_state`` and ``index_keys``.

Blocks go in groups of ``row_group`` = ROW_LANES (deepseek_v4_config.py) times the
smallest compression rate: the first block of each group holds the compressed rows (and indexer
keys) of every unit whose last token lies in the group (row_slots), and is
kept for the request's life. The other blocks hold only raw rows and states,
which nothing reads once they are older than V4Config.window_tokens(): the
scheduler's window gives them back as the request runs
(BlockManager.free_outside_window), so the blocks a request holds grow at
1/row_group of the token rate. A group head is written until its group is full,
so the prefix cache hits only whole groups (BlockManager.match_prefix).
Everything else in a block depends only on the tokens up to it, which makes
chunked prefill with boundaries inside units, preemption (recompute) and
prefix hits exact.

Simplifications of this version: every block has room for every part (a group
head's raw rows and states, and the rows part of the other blocks, go unused
once the window passes), and rows of all rates share the groups of the smallest
one: an HCA layer's few rows take little room in a group head, but do not get
blocks of their own at 1/128 of the token rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.quant import QuantFormat
from engine.utils import cdiv


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
    ``index_state_dim`` 0 for any layer but CSA; ``rate`` the layer's compression
    rate (0: none) and ``group`` the cache's blocks per row group."""

    head_dim: int
    state_dim: int
    index_head_dim: int
    index_state_dim: int
    dtype: torch.dtype
    rate: int = 0
    group: int = 1

    def parts(self, block_size: int) -> list[tuple[int, int]]:
        """(entries per block, width) of kv, state, rows, index_state, index_keys;
        (0, 0) for a part the layer has not. A group closes at most
        ceil(group * block_size / rate) rows: that many per block."""
        none = (0, 0)
        rows = cdiv(self.group * block_size, self.rate) if self.rate else 0
        compressed = [(block_size, self.state_dim), (rows, self.head_dim)]
        indexed = [(block_size, self.index_state_dim), (rows, self.index_head_dim)]
        return [
            (block_size, self.head_dim),
            *(compressed if self.state_dim else [none, none]),
            *(indexed if self.index_state_dim else [none, none]),
        ]

    def block_bytes(self, block_size: int) -> int:
        numbers = sum(n * width for n, width in self.parts(block_size))
        return numbers * self.dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> CompressedKV:
        def part(entries: int, width: int) -> torch.Tensor | None:
            if not width:
                return None
            shape = (num_blocks, entries, width)
            return torch.empty(shape, dtype=self.dtype, device=device)  # the pool zeroes it

        return CompressedKV(*(part(*p) for p in self.parts(block_size)))

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
    block_table: torch.Tensor,
    rows: torch.Tensor,
    rate: int,
    group: int,
    block_size: int,
    cache: torch.Tensor,
) -> torch.Tensor:
    """Where compressed rows ``rows`` [n] of one sequence at ``rate`` sit in a
    [blocks, rows per block, width] ``cache``: row w closes at token w*rate + rate-1,
    in group g of ``group`` blocks, and sits in the group's first block at w modulo
    the rows a block holds. A group closes at most that many rows, consecutive
    ones, so no two meet."""
    per_block = cache.shape[1]
    last = rows * rate + rate - 1
    heads = block_table.long()[last // (group * block_size) * group]
    return heads * per_block + rows % per_block


def write(cache: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """values [n, width] into slots ``where`` [n] of a [blocks, block_size, width] tensor."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, where, values.to(cache.dtype))


def read(cache: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """The rows [n, width] at slots ``where`` [n]."""
    return cache.view(-1, cache.shape[-1])[where]
