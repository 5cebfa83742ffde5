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

import math
import os
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Protocol, cast

import torch

from engine.config import EngineConfig
from engine.config.kv_format import FORMATS, QuantFormat, quant_format
from engine.kv.quant import dequantize, quantize
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

    def quantized(self, fmt: QuantFormat) -> KVCacheSpec:
        """This format with its numbers kept as ``fmt``'s one-byte codes and their
        scales (engine/kv/quant.py); ValueError if this layer's cache cannot be."""
        ...


class CachedLayer(Protocol):
    """An attention layer as the pool sees it: it says what it caches, and holds it."""

    kv_cache: KVCache | None  # None until the pool binds it

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec: ...


@dataclass
class PagedKV:
    """One layer's keys and values, each [num_blocks, block_size, kv_heads, head_dim].
    Quantized, k and v hold one-byte codes, and k_scale and v_scale, each
    [num_blocks, block_size, kv_heads] float32, a scale per token and head."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # None: k and v hold the numbers themselves
    v_scale: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        scales = (
            [] if self.k_scale is None or self.v_scale is None else [self.k_scale, self.v_scale]
        )
        return [self.k, self.v, *scales]

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values [tokens, kv_heads, head_dim] as this cache gives them back:
        what attention over new tokens must read too, so that a token is seen the
        same whether its step wrote it or an earlier one did."""
        if self.k_scale is None:
            return x
        return round_trip(x, quant_format_of(self.k.dtype), group=x.shape[-1])


@dataclass(frozen=True)
class FullAttentionSpec:
    """A key and a value of ``head_dim`` numbers per KV head, for every token; with
    ``quant``, one byte each, plus a float32 scale per token, head, key and value."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    quant: QuantFormat | None = None

    def block_bytes(self, block_size: int) -> int:
        per_head = self.head_dim * self.dtype.itemsize
        if self.quant is not None:
            per_head = self.head_dim * self.quant.storage.itemsize + SCALE_BYTES
        return 2 * block_size * self.num_kv_heads * per_head

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> PagedKV:
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        if self.quant is None:
            kv = torch.empty(shape, dtype=self.dtype, device=device)  # the pool zeroes it
            return PagedKV(kv[0], kv[1])
        codes = torch.empty(shape, dtype=self.quant.storage, device=device)
        scales = torch.empty(shape[:-1], dtype=torch.float32, device=device)
        return PagedKV(codes[0], codes[1], scales[0], scales[1])

    def quantized(self, fmt: QuantFormat) -> FullAttentionSpec:
        return replace(self, quant=fmt)


SCALE_BYTES = 4  # one float32 scale


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor
) -> None:
    """Write this step's keys and values into their slots, one indexed copy each;
    into a quantized cache, as codes with a scale per token and head, each head's
    vector its own group. (Slot -1, the padding of a CUDA graph's batch, never
    reaches this function.)"""
    if cache.k_scale is None or cache.v_scale is None:
        cache.k.view(-1, *cache.k.shape[2:]).index_copy_(0, slot_mapping, k)
        cache.v.view(-1, *cache.v.shape[2:]).index_copy_(0, slot_mapping, v)
        return
    fmt = quant_format_of(cache.k.dtype)
    for x, codes, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        x_codes, x_scales = quantize(x, fmt, group=x.shape[-1])
        as_bytes(codes).view(-1, *codes.shape[2:]).index_copy_(0, slot_mapping, as_bytes(x_codes))
        scales.view(-1, scales.shape[-1]).index_copy_(0, slot_mapping, x_scales[..., 0])


def round_trip(x: torch.Tensor, fmt: QuantFormat, group: int) -> torch.Tensor:
    """x coded in ``fmt`` and read back, in x's dtype."""
    return dequantize(*quantize(x, fmt, group), x.dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor as uint8, the same memory: torch copies and indexes bytes,
    but not FP8 values, on every device."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def quant_format_of(storage: torch.dtype) -> QuantFormat:
    """The format whose codes a cache tensor of ``storage`` dtype holds."""
    return next(f for f in FORMATS.values() if f.storage == storage)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached codes [..., kv_heads, head_dim] with their scales [..., kv_heads] as
    numbers of ``dtype``: what attention reads from a quantized cache."""
    return dequantize(codes, scales[..., None], dtype)


@dataclass(frozen=True)
class MLACacheSpec:
    """Multi-head latent attention (engine/layers/mla.py): one row per token, the
    latent (kv_lora_rank numbers) then the rotary key (rope_dim), for all heads.

    With ``quant``, FlashMLA's FP8 layout for DeepSeek-V3.2: the latent as one-byte
    codes with a float32 scale per LATENT_GROUP of them, and the rotary key kept in
    the model's dtype, since the positions it encodes need its precision."""

    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype
    quant: QuantFormat | None = None

    def block_bytes(self, block_size: int) -> int:
        if self.quant is None:
            return block_size * (self.kv_lora_rank + self.rope_dim) * self.dtype.itemsize
        codes = self.kv_lora_rank * self.quant.storage.itemsize
        scales = self.kv_lora_rank // self.latent_group * SCALE_BYTES
        return block_size * (codes + scales + self.rope_dim * self.dtype.itemsize)

    @property
    def latent_group(self) -> int:
        """Latent numbers per scale: LATENT_GROUP, or the whole latent if smaller."""
        return min(LATENT_GROUP, self.kv_lora_rank)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> LatentKV:
        """[num_blocks, block_size, kv_lora_rank + rope_dim]; quantized, the codes
        [.., kv_lora_rank], their scales [.., groups] and the rotary keys [.., rope_dim]."""
        rows = (num_blocks, block_size)
        if self.quant is None:
            shape = (*rows, self.kv_lora_rank + self.rope_dim)
            return LatentKV(torch.empty(shape, dtype=self.dtype, device=device))  # zeroed later
        groups = self.kv_lora_rank // self.latent_group
        return LatentKV(
            torch.empty((*rows, self.kv_lora_rank), dtype=self.quant.storage, device=device),
            torch.empty((*rows, groups), dtype=torch.float32, device=device),
            torch.empty((*rows, self.rope_dim), dtype=self.dtype, device=device),
        )

    def quantized(self, fmt: QuantFormat) -> MLACacheSpec:
        if self.kv_lora_rank % self.latent_group:
            raise ValueError(
                f"a quantized MLA cache needs kv_lora_rank ({self.kv_lora_rank}) to be a "
                f"multiple of {LATENT_GROUP}, the numbers that share a scale"
            )
        return replace(self, quant=fmt)


LATENT_GROUP = 128  # MLA latent numbers per scale, as in FlashMLA's FP8 format


@dataclass
class LatentKV:
    """One MLA layer's cache: a [latent, rotary key] row per token slot,
    [num_blocks, block_size, kv_lora_rank + rope_dim]. Quantized, ``rows`` holds
    only the latent's codes, beside its ``scales`` and the rotary keys ``rope``."""

    rows: torch.Tensor
    scales: torch.Tensor | None = None
    rope: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        extra = [] if self.scales is None or self.rope is None else [self.scales, self.rope]
        return [self.rows, *extra]

    def as_stored(self, latent: torch.Tensor) -> torch.Tensor:
        """Latents [tokens, rank] as this cache gives them back (see PagedKV.as_stored)."""
        if self.scales is None:
            return latent
        group = latent.shape[-1] // self.scales.shape[-1]
        return round_trip(latent, quant_format_of(self.rows.dtype), group)

    def numbers(self, blocks: torch.Tensor) -> torch.Tensor:
        """These blocks' rows as numbers of the model's dtype,
        [len(blocks), block_size, rank + rope]."""
        if self.scales is None or self.rope is None:
            return self.rows[blocks]
        codes = as_bytes(self.rows)[blocks].view(self.rows.dtype)
        latent = dequantize(codes, self.scales[blocks], self.rope.dtype)
        return torch.cat([latent, self.rope[blocks]], dim=-1)


def store_latent(
    latent: torch.Tensor, k_rope: torch.Tensor, cache: LatentKV, slot_mapping: torch.Tensor
) -> None:
    """Write this step's [latent, rotary key] rows into their slots, one indexed copy;
    quantized, the latent's codes and scales, and the rotary key as it is."""
    if cache.scales is None or cache.rope is None:
        rows = torch.cat([latent, k_rope], dim=-1)
        cache.rows.view(-1, rows.shape[-1]).index_copy_(0, slot_mapping, rows)
        return
    fmt = quant_format_of(cache.rows.dtype)
    codes, scales = quantize(latent, fmt, group=latent.shape[-1] // cache.scales.shape[-1])
    as_bytes(cache.rows).view(-1, codes.shape[-1]).index_copy_(0, slot_mapping, as_bytes(codes))
    cache.scales.view(-1, scales.shape[-1]).index_copy_(0, slot_mapping, scales)
    cache.rope.view(-1, k_rope.shape[-1]).index_copy_(0, slot_mapping, k_rope)


def gather_latents(cache: LatentKV, block_table: torch.Tensor, context: int) -> torch.Tensor:
    """The first ``context`` rows [context, rank + rope] of one sequence, read
    through its block table (one row of the step's, padded with -1 past its blocks)."""
    blocks = block_table[: cdiv(context, cache.rows.shape[1])].long()
    return cache.numbers(blocks).flatten(0, 1)[:context]


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


def _select(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``t``, copied to the host, in ``t``'s dtype."""
    return as_bytes(t).index_select(0, index).cpu().view(t.dtype)


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
        fmt = quant_format(config.kv_cache_dtype)
        specs = [layer.kv_cache_spec(config.dtype) for layer in layers]
        self.specs = specs if fmt is None else [spec.quantized(fmt) for spec in specs]
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
                as_bytes(t)[lo:hi].zero_()
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
        return KVBlocks([[_select(t, index) for t in c.tensors()] for c in self._caches()])

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
                as_bytes(t).index_copy_(0, index, as_bytes(rows.to(t.device)))

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
        capacity = self._lone_capacity()
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
                f"({self.num_blocks} blocks of {self.block_size}, room for {capacity} "
                "tokens of one sequence); "
                "raise num_kv_blocks or lower max_model_len"
            )
        return cfg.max_model_len

    def _lone_capacity(self) -> int:
        """Tokens one sequence alone can reach. Every token keeps its block, but
        under a window (EngineConfig.kv_window) a request holds only its sinks',
        its window's and one step's blocks at a time, and under DeepSeek-V4 also
        a block of each span group for every span of tokens: the cache then
        holds sequences far longer than its blocks of tokens."""
        cfg, bs = self.config, self.block_size
        if cfg.kv_window is None:
            return self.num_blocks * bs
        sinks, window = cfg.kv_window
        step = min(cfg.max_num_batched_tokens, cfg.hf_config.max_position_embeddings)
        held = cdiv(sinks, bs) + cdiv(window, bs) + cdiv(step, bs) + 2  # +2: unaligned ends
        if held > self.num_blocks:
            return self.num_blocks * bs  # the window never bites before the cache is full
        spans = cfg.kv_cache_groups.spans
        if not spans:
            return cfg.hf_config.max_position_embeddings
        per_token = sum(Fraction(1, group.span) for group in spans)  # span blocks a token adds
        return math.floor((self.num_blocks - held) / per_token)
