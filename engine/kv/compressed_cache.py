"""The paged cache of DeepSeek-V4's attention layers: token blocks and row blocks.

A request's V4 state falls in two KV-cache groups (config/cache_groups.py), whose
tables draw blocks from one pool (KVCacheCoordinator, kv/coordinator.py):

- the token group's blocks (``block_table``), one per ``block_size`` tokens, as
  every model has. In every layer a token slot holds the token's K = V row
  (``kv``, what the sliding window reads), and in a layer with a compressor (CSA,
  HCA) also that compressor's projections of the token (``state``, its kv and
  gate: what closes a compression unit, maybe in a later step than the token's
  own), and in a CSA layer the indexer's compressor's (``index_state``). Nothing
  reads them once they are older than V4Config.window_tokens(), so the
  scheduler's window gives those blocks back as the request runs
  (BlockManager.free_outside_window): a request holds a window's worth of them;
- the row blocks, a span group (group ROW_GROUP, ``block_tables[ROW_GROUP]``),
  one per ``row_span`` tokens (V4Config.row_span): in every compressed layer, the
  rows of the units whose last token lies in that span (``rows``,
  ``row_span / rate`` of them), and in a CSA layer the indexer's key of each
  (``index_keys``). They are read for the request's whole life, so the blocks it
  holds grow at the compressed rate.

A block is one page of the pool, the same size whichever table holds it: the
pool sees one cache (CompressedCacheSpec) whose blocks are pages of numbers, and
each layer's parts are views into them, a token block's from the page's start
and a row block's from the page's start too. row_span is chosen to fill a row
block about as well as a token block is filled.

A row block is written until its span is full, so the prefix cache hits whole
spans only (KVCacheCoordinator.match_prefix). Everything in a block depends
only on the tokens up to it, which makes chunked prefill with boundaries inside
units, preemption (recompute) and prefix hits exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config.kv_format import QuantFormat

# The row blocks' KV-cache group: the token group's is 0, and V4 has this one span
# group more (EngineConfig.kv_cache_groups).
ROW_GROUP = 1


@dataclass
class CompressedKV:
    """One V4 layer's views of the pool, each [num_blocks, entries, width]: the token
    parts (entries = block_size) are read at token blocks, the row parts (entries =
    rows per row block) at row blocks. The compressor's and indexer's are None in a
    layer that has none."""

    kv: torch.Tensor
    state: torch.Tensor | None = None
    index_state: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """One layer's widths: numbers per token slot (``head_dim`` for kv, then
    ``state_dim`` and ``index_state_dim``, 0 where the layer has none) and per
    compressed row (``row_dim``, ``index_key_dim``) at ``rate`` tokens a row (0: none)."""

    head_dim: int
    state_dim: int
    index_state_dim: int
    row_dim: int
    index_key_dim: int
    rate: int

    def token_numbers(self) -> int:
        return self.head_dim + self.state_dim + self.index_state_dim

    def row_numbers(self, row_span: int) -> int:
        """Numbers one row block of ``row_span`` tokens takes in this layer."""
        return row_span // self.rate * (self.row_dim + self.index_key_dim) if self.rate else 0


@dataclass
class CompressedCache:
    """The pool's one cache for every V4 layer: ``pages`` [num_blocks, numbers], and
    each layer's views of it."""

    pages: torch.Tensor
    layers: list[CompressedKV]

    def tensors(self) -> list[torch.Tensor]:
        return [self.pages]


@dataclass(frozen=True)
class CompressedCacheSpec:
    """Every V4 layer's cache as one spec for the pool (engine/kv/kv_cache.py): a
    block is a page with room for a token block's parts in every layer, or a row
    block's, whichever is larger."""

    layers: tuple[CompressedAttentionSpec, ...]
    row_span: int  # tokens per row block (V4Config.row_span at this block size)
    dtype: torch.dtype

    def page_numbers(self, block_size: int) -> int:
        tokens = block_size * sum(spec.token_numbers() for spec in self.layers)
        return max(tokens, sum(spec.row_numbers(self.row_span) for spec in self.layers))

    def block_bytes(self, block_size: int) -> int:
        return self.page_numbers(block_size) * self.dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> CompressedCache:
        shape = (num_blocks, self.page_numbers(block_size))
        pages = torch.empty(shape, dtype=self.dtype, device=device)  # the pool zeroes it
        return CompressedCache(pages, carve(pages, self.layers, block_size, self.row_span))

    def quantized(self, fmt: QuantFormat) -> CompressedCacheSpec:
        raise ValueError(
            f"kv_cache_dtype={fmt.name!r} is not supported on DeepSeek-V4 yet: its "
            "compressor reads its states back in the model's dtype"
        )


def carve(
    pages: torch.Tensor, specs: tuple[CompressedAttentionSpec, ...], block_size: int, row_span: int
) -> list[CompressedKV]:
    """Each layer's views of ``pages``: the token parts of every layer one after
    another from each page's start, and the row parts likewise, over the same numbers."""
    token_at, row_at = 0, 0

    def view(at: int, entries: int, width: int) -> torch.Tensor | None:
        if not entries * width:
            return None
        return pages[:, at : at + entries * width].unflatten(1, (entries, width))

    out = []
    for spec in specs:
        widths = (spec.head_dim, spec.state_dim, spec.index_state_dim)
        token_parts = []
        for width in widths:
            token_parts.append(view(token_at, block_size, width))
            token_at += block_size * width
        rows = row_span // spec.rate if spec.rate else 0
        row_parts = []
        for width in (spec.row_dim, spec.index_key_dim):
            row_parts.append(view(row_at, rows, width))
            row_at += rows * width
        kv = token_parts[0]
        assert kv is not None
        out.append(CompressedKV(kv, token_parts[1], token_parts[2], *row_parts))
    return out


class CompressedLayer(Protocol):
    """A V4 attention layer, as CompressedCacheLayers binds it."""

    kv_cache: CompressedKV | None

    def kv_cache_spec(self, dtype: torch.dtype) -> CompressedAttentionSpec: ...


class CompressedCacheLayers:
    """Every V4 attention layer, as the pool sees them: one cached layer
    (kv_cache.CachedLayer) whose cache binds each layer's views as it is set."""

    def __init__(self, layers: list[CompressedLayer], row_span: int) -> None:
        self.layers, self.row_span = layers, row_span
        self._cache: CompressedCache | None = None

    def kv_cache_spec(self, dtype: torch.dtype) -> CompressedCacheSpec:
        specs = tuple(layer.kv_cache_spec(dtype) for layer in self.layers)
        return CompressedCacheSpec(specs, self.row_span, dtype)

    @property
    def kv_cache(self) -> CompressedCache | None:
        return self._cache

    @kv_cache.setter
    def kv_cache(self, cache: CompressedCache | None) -> None:
        self._cache = cache
        for i, layer in enumerate(self.layers):
            layer.kv_cache = None if cache is None else cache.layers[i]


def slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots of one sequence's ``positions``, through its block table."""
    blocks = block_table.long()[positions // block_size]
    return blocks * block_size + positions % block_size


def row_slots(row_table: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Where compressed rows ``rows`` [n] of one sequence sit in a [blocks, rows per
    block, width] ``cache``: a row block holds row_span / rate consecutive rows at a
    layer's rate (the units whose last token lies in its span), so row w is entry
    w modulo that in the sequence's row block w // that."""
    per_block = cache.shape[1]
    return row_table.long()[rows // per_block] * per_block + rows % per_block


def batch_slots(tables: torch.Tensor, index: torch.Tensor, per_block: int) -> torch.Tensor:
    """Slots of ``index`` [seqs, n] (positions or rows), each row of them through its
    own row of ``tables`` [seqs, blocks]: compressed_cache.slots and row_slots for a
    batch. A padded entry (a block of -1) maps to block 0, for a masked read."""
    blocks = tables.gather(1, index // per_block).clamp(min=0)
    return blocks * per_block + index % per_block


def write(cache: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """values [n, width] into slots ``where`` [n] (block * entries + entry) of a
    [blocks, entries, width] view."""
    entries = cache.shape[1]
    cache[where // entries, where % entries] = values.to(cache.dtype)


def read(cache: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """The rows [n, width] at slots ``where`` [n]."""
    entries = cache.shape[1]
    return cache[where // entries, where % entries]
