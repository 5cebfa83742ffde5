"""The paged KV cache's memory: what each attention layer keeps per token, how
many blocks fit, and the tensors themselves.

Each attention layer describes its cache with a small spec: how many bytes a
block takes, and how to allocate one layer's worth of blocks. Today's layers
keep a key and a value per KV head (`FullAttentionSpec`). A layer that caches
one latent vector per token (MLA, `MLACacheSpec`), or quantized values with their
scales, brings its own spec, and the pool sizes and allocates it the same way;
the model runner never looks inside. Whatever a layer keeps, a token has the same
(block, slot) address in every layer, so one block table serves them all.

Every layer's cache shows the pool its tensors, each with the block as its first
dimension (`KVCache.tensors`). That is all the pool needs to zero blocks before
their first use, and to copy blocks out of every layer and back in
(`KVCachePool.read_blocks`, `write_blocks`), as a store that keeps blocks beyond
the pool, or hands them to another engine, would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from engine.config import EngineConfig
from engine.utils import cdiv


class KVCache(Protocol):
    """One layer's cache, whatever its format, as the pool sees it."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of this cache, each [num_blocks, ...]: block b of the
        cache is row b of each (the pool zeroes and copies blocks this way)."""
        ...


class KVCacheSpec(Protocol):
    """One layer's cache format, as the pool needs to know it."""

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block of ``block_size`` token slots takes in this layer."""
        ...

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> KVCache:
        """This layer's cache: whatever its attention backend writes and reads, as
        tensors whose first dimension is the block (contents undefined until the
        pool zeroes them)."""
        ...


class CachedLayer(Protocol):
    """An attention layer as the pool sees it: it says what it caches, and holds it."""

    kv_cache: KVCache | None  # None until the pool binds it

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec: ...


@dataclass
class PagedKV:
    """One layer's keys and values, each [num_blocks, block_size, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


@dataclass(frozen=True)
class FullAttentionSpec:
    """A key and a value of ``head_dim`` numbers per KV head, for every token."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def block_bytes(self, block_size: int) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> PagedKV:
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        kv = torch.empty(shape, dtype=self.dtype, device=device)  # the pool zeroes it
        return PagedKV(kv[0], kv[1])


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor
) -> None:
    """Write this step's keys and values into their slots, one indexed copy each.
    (Slot -1, the padding of a CUDA graph's batch, never reaches this function.)"""
    cache.k.view(-1, *cache.k.shape[2:]).index_copy_(0, slot_mapping, k)
    cache.v.view(-1, *cache.v.shape[2:]).index_copy_(0, slot_mapping, v)


@dataclass(frozen=True)
class MLACacheSpec:
    """Multi-head latent attention (engine/layers/mla.py): one row per token, the
    latent (kv_lora_rank numbers) then the rotary key (rope_dim), for all heads."""

    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype

    def block_bytes(self, block_size: int) -> int:
        return block_size * (self.kv_lora_rank + self.rope_dim) * self.dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> LatentKV:
        """[num_blocks, block_size, kv_lora_rank + rope_dim]."""
        shape = (num_blocks, block_size, self.kv_lora_rank + self.rope_dim)
        return LatentKV(torch.empty(shape, dtype=self.dtype, device=device))  # the pool zeroes it


@dataclass
class LatentKV:
    """One MLA layer's cache: a [latent, rotary key] row per token slot,
    [num_blocks, block_size, kv_lora_rank + rope_dim]."""

    rows: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.rows]


def store_latent(
    latent: torch.Tensor, k_rope: torch.Tensor, cache: LatentKV, slot_mapping: torch.Tensor
) -> None:
    """Write this step's [latent, rotary key] rows into their slots, one indexed copy."""
    rows = torch.cat([latent, k_rope], dim=-1)
    cache.rows.view(-1, rows.shape[-1]).index_copy_(0, slot_mapping, rows)


def gather_latents(cache: LatentKV, block_table: torch.Tensor, context: int) -> torch.Tensor:
    """The first ``context`` rows [context, rank + rope] of one sequence, read
    through its block table (one row of the step's, padded with -1 past its blocks)."""
    blocks = block_table[: cdiv(context, cache.rows.shape[1])].long()
    return cache.rows[blocks].flatten(0, 1)[:context]


@dataclass
class KVBlocks:
    """Some blocks' contents in every layer, copied to the host: ``layers[i][j]``
    is layer i's j-th cache tensor at those blocks, [num_blocks, ...], in the
    order their ids were given. The ids themselves are not kept: what a block
    holds does not depend on where it sits, so it may be written back anywhere."""

    layers: list[list[torch.Tensor]]

    @property
    def num_blocks(self) -> int:
        return next((len(t) for ts in self.layers for t in ts), 0)

    def nbytes(self) -> int:
        return sum(t.nbytes for ts in self.layers for t in ts)


@dataclass(frozen=True)
class KVCacheConfig:
    """What the engine needs to know of a pool: the blocks the block manager hands out."""

    num_blocks: int
    block_size: int
    max_model_len: int


class KVCachePool:
    """Every attention layer's cache, sized together: each layer gets the same
    number of blocks, so a block id means the same tokens in every layer."""

    def __init__(
        self, config: EngineConfig, layers: list[CachedLayer], device: torch.device
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.specs = [layer.kv_cache_spec(config.dtype) for layer in layers]
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit(device)
        self.max_model_len = self._max_model_len()
        self.layers = layers
        for layer, spec in zip(layers, self.specs):
            layer.kv_cache = spec.allocate(self.num_blocks, self.block_size, device)
        self.num_touched_blocks = 0  # blocks [0, this) are zeroed, hence resident
        if device.type != "cpu":  # a GPU's memory is reserved as allocated: zero it now
            self.touch(self.num_blocks)

    def touch(self, num_blocks: int) -> None:
        """Zero blocks up to ``num_blocks`` before their first use.

        On the CPU the pool is allocated but not written, so the operating system
        backs a page with memory only once something writes it: the cache's
        resident size grows with the blocks in use, up to the budget. The block
        manager hands out the lowest free ids first, so the blocks ever used are a
        prefix of the pool. Zeros, not garbage: padded reads are masked, but a
        masked 0 times a NaN left in memory would still be NaN."""
        if num_blocks <= self.num_touched_blocks:
            return
        lo, hi = self.num_touched_blocks, min(num_blocks, self.num_blocks)
        for cache in self._caches():
            for t in cache.tensors():
                t[lo:hi].zero_()
        self.num_touched_blocks = hi

    def forget_touched(self) -> None:
        """Treat every block as unused again, so that each is zeroed before its
        first use (after a warm-up wrote dummy keys and values)."""
        self.num_touched_blocks = 0

    def read_blocks(self, block_ids: list[int]) -> KVBlocks:
        """Copy these blocks out of every tensor of every layer, to the host. A
        block never used reads as zeros (it is zeroed first, as on its first use)."""
        index = self._block_index(block_ids)
        self.touch(max(block_ids, default=-1) + 1)
        return KVBlocks(
            [[t.index_select(0, index).cpu() for t in c.tensors()] for c in self._caches()]
        )

    def write_blocks(self, block_ids: list[int], data: KVBlocks) -> None:
        """Copy ``data`` (what some pool's ``read_blocks`` returned, for blocks
        shaped like this pool's) into these blocks of every layer, in order."""
        index = self._block_index(block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids {block_ids} repeat: each block can be written once")
        self._check_blocks(len(block_ids), data)
        self.touch(max(block_ids, default=-1) + 1)  # so that no later first use zeroes them
        for cache, tensors in zip(self._caches(), data.layers):
            for t, rows in zip(cache.tensors(), tensors):
                t.index_copy_(0, index, rows.to(t.device))

    def _caches(self) -> list[KVCache]:
        """Every layer's cache, as ``__init__`` bound it."""
        return [cast(KVCache, layer.kv_cache) for layer in self.layers]

    def _block_index(self, block_ids: list[int]) -> torch.Tensor:
        """The ids as an index on the pool's device, once each is known to be a block."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} are outside this pool's {self.num_blocks} blocks")
        device = self._caches()[0].tensors()[0].device if self.layers else "cpu"
        return torch.tensor(block_ids, dtype=torch.long, device=device)

    def _check_blocks(self, num_ids: int, data: KVBlocks) -> None:
        """ValueError unless ``data`` holds ``num_ids`` blocks in this pool's format."""
        if len(data.layers) != len(self.layers):
            raise ValueError(
                f"data has {len(data.layers)} layers; this pool has {len(self.layers)}"
            )
        for i, (cache, tensors) in enumerate(zip(self._caches(), data.layers)):
            ours = cache.tensors()
            if len(tensors) != len(ours):
                raise ValueError(
                    f"layer {i}: data has {len(tensors)} tensors; this pool has {len(ours)}"
                )
            for j, (t, rows) in enumerate(zip(ours, tensors)):
                if len(rows) != num_ids:
                    raise ValueError(
                        f"layer {i} tensor {j}: data holds {len(rows)} blocks "
                        f"but {num_ids} block ids were given"
                    )
                want = (num_ids, *t.shape[1:])
                if tuple(rows.shape) != want or rows.dtype != t.dtype:
                    raise ValueError(
                        f"layer {i} tensor {j}: data is {tuple(rows.shape)} {rows.dtype}; "
                        f"this pool's blocks are {want} {t.dtype}"
                    )

    def kv_cache_config(self) -> KVCacheConfig:
        return KVCacheConfig(self.num_blocks, self.block_size, self.max_model_len)

    def block_bytes(self) -> int:
        """Bytes one block takes, summed over the layers."""
        return sum(spec.block_bytes(self.block_size) for spec in self.specs)

    def _blocks_that_fit(self, device: torch.device) -> int:
        """Size the cache from a share of free memory, but never beyond what
        max_num_seqs sequences of the longest allowed length could use."""
        cfg = self.config
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = free * (cfg.kv_cache_memory_fraction or 0.9)
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = available * (cfg.kv_cache_memory_fraction or 0.2)
        longest = cfg.max_model_len or cfg.hf_config.max_position_embeddings
        useful = cfg.max_num_seqs * cdiv(longest, self.block_size)
        return max(1, min(int(budget // self.block_bytes()), useful))

    def _max_model_len(self) -> int:
        """The longest sequence we accept: the checkpoint's limit, and no more than
        the whole cache holds (so a lone sequence can always run to the end)."""
        cfg = self.config
        limit = cfg.hf_config.max_position_embeddings
        capacity = self.num_blocks * self.block_size
        if cfg.max_model_len is None:
            return min(limit, capacity)
        if cfg.max_model_len > limit:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        if cfg.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} does not fit in the KV cache "
                f"({self.num_blocks} blocks of {self.block_size} = {capacity} tokens); "
                "raise num_kv_blocks or lower max_model_len"
            )
        return cfg.max_model_len
