"""The paged KV cache's memory: what each attention layer keeps per token, how
many blocks fit, and the tensors themselves.

Each attention layer describes its cache with a small spec: how many bytes a
block takes, and how to allocate one layer's worth of blocks. Today's layers
keep a key and a value per KV head (`FullAttentionSpec`). A layer that caches
one latent vector per token (MLA, `MLACacheSpec`), or quantized values with their
scales, brings its own spec, and the pool sizes and allocates it the same way;
the model runner never looks inside. Whatever a layer keeps, a token has the same
(block, slot) address in every layer, so one block table serves them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.config import EngineConfig
from engine.utils import cdiv


class KVCacheSpec(Protocol):
    """One layer's cache format, as the pool needs to know it."""

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block of ``block_size`` token slots takes in this layer."""
        ...

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> Any:
        """This layer's cache: whatever its attention backend writes and reads, as
        tensors whose first dimension is the block (contents undefined until the
        pool zeroes them)."""
        ...


class CachedLayer(Protocol):
    """An attention layer as the pool sees it: it says what it caches, and holds it."""

    kv_cache: Any

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec: ...


@dataclass
class PagedKV:
    """One layer's keys and values, each [num_blocks, block_size, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor


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

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
        """[num_blocks, block_size, kv_lora_rank + rope_dim]."""
        shape = (num_blocks, block_size, self.kv_lora_rank + self.rope_dim)
        return torch.empty(shape, dtype=self.dtype, device=device)  # the pool zeroes it


def store_latent(
    latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write this step's [latent, rotary key] rows into their slots, one indexed copy."""
    rows = torch.cat([latent, k_rope], dim=-1)
    cache.view(-1, rows.shape[-1]).index_copy_(0, slot_mapping, rows)


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
        for layer in self.layers:
            cache = layer.kv_cache
            for t in (cache.k, cache.v) if isinstance(cache, PagedKV) else (cache,):
                t[lo:hi].zero_()
        self.num_touched_blocks = hi

    def forget_touched(self) -> None:
        """Treat every block as unused again, so that each is zeroed before its
        first use (after a warm-up wrote dummy keys and values)."""
        self.num_touched_blocks = 0

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
