"""The KV cache's stored values pinned to exact numbers (issue 49): the bytes a
block takes in each format, the tensors each format allocates, where a step's
keys, values and latents land, and what a quantized cache gives back. Inputs
are chosen so that every code and scale is exact, and sizes are distinct primes
where they can be, so that a value off by one, or two sizes swapped, shows."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from engine.config.cache_groups import KVCacheGroups, SpanGroup
from engine.config.kv_format import FORMATS
from engine.kv.kv_cache import (
    LATENT_GROUP,
    FullAttentionSpec,
    KVBlocks,
    KVCacheConfig,
    KVCachePool,
    LatentKV,
    MLACacheSpec,
    PagedKV,
    as_bytes,
    dequantize_rows,
    gather_latents,
    quant_format_of,
    round_trip,
    store_kvcache,
    store_latent,
)

CPU = torch.device("cpu")
INT8, FP8 = FORMATS["int8"], FORMATS["fp8_e4m3"]


def test_full_attention_block_bytes_plain_and_quantized() -> None:
    """3 heads of 5 numbers, blocks of 7: 2 x 7 x 3 x 5 x 4 bytes in float32;
    quantized, 2 x 7 x 3 x (5 one-byte codes + one 4-byte scale)."""
    spec = FullAttentionSpec(num_kv_heads=3, head_dim=5, dtype=torch.float32)
    assert spec.block_bytes(7) == 840
    assert FullAttentionSpec(3, 5, torch.bfloat16).block_bytes(7) == 420
    assert spec.quantized(INT8).block_bytes(7) == 378
    assert spec.quantized(FP8).block_bytes(7) == 378


def test_quantized_keeps_the_shape_and_sets_the_format() -> None:
    spec = FullAttentionSpec(num_kv_heads=3, head_dim=5, dtype=torch.bfloat16)
    assert spec.quantized(FP8) == FullAttentionSpec(3, 5, torch.bfloat16, FP8)
    assert spec.quant is None  # a new spec; this one is unchanged


def test_full_attention_allocates_separate_keys_and_values() -> None:
    spec = FullAttentionSpec(3, 5, torch.bfloat16)
    cache = spec.allocate(2, 7, CPU)
    assert cache.k.shape == cache.v.shape == (2, 7, 3, 5)
    assert cache.k.dtype == cache.v.dtype == torch.bfloat16
    assert cache.k_scale is None and cache.v_scale is None
    cache.k.fill_(1.0), cache.v.fill_(2.0)
    assert cache.k.sum() == 210 and cache.v.sum() == 420  # no memory shared
    assert cache.k.untyped_storage().nbytes() == 2 * spec.block_bytes(7)  # keys and values only
    assert cache.tensors() == [cache.k, cache.v]
    assert [t.data_ptr() for t in cache.tensors()] == [cache.k.data_ptr(), cache.v.data_ptr()]


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=["int8", "fp8"])
def test_quantized_full_attention_allocates_codes_and_a_scale_per_token_and_head(fmt) -> None:
    spec = FullAttentionSpec(3, 5, torch.bfloat16, fmt)
    cache = spec.allocate(2, 7, CPU)
    assert cache.k.shape == cache.v.shape == (2, 7, 3, 5)
    assert cache.k.dtype == cache.v.dtype == fmt.storage
    assert cache.k_scale is not None and cache.v_scale is not None
    assert cache.k_scale.shape == cache.v_scale.shape == (2, 7, 3)
    assert cache.k_scale.dtype == cache.v_scale.dtype == torch.float32
    tensors = cache.tensors()
    assert len(tensors) == 4
    assert [t.data_ptr() for t in tensors] == [
        t.data_ptr() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale)
    ]
    for i, t in enumerate(tensors):
        as_bytes(t).fill_(i + 1)
    assert [int(as_bytes(t).sum()) for t in tensors] == [210, 420, 3 * 42, 4 * 42]
    storage = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert sum(storage.values()) == 2 * spec.block_bytes(7)  # nothing allocated beyond


def test_a_cache_with_one_scale_missing_shows_only_its_keys_and_values() -> None:
    k, v, s = torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.ones(1, 2, 1)
    assert PagedKV(k, v, k_scale=s).tensors() == [k, v]
    assert PagedKV(k, v, v_scale=s).tensors() == [k, v]


def test_as_bytes_and_quant_format_of() -> None:
    codes = torch.tensor([-1, 2], dtype=torch.int8)
    assert as_bytes(codes).dtype == torch.uint8 and as_bytes(codes).tolist() == [255, 2]
    fp8 = torch.tensor([1.0], dtype=torch.float8_e4m3fn)
    assert as_bytes(fp8).tolist() == [0x38]  # 1.0 in E4M3: exponent 7, mantissa 0
    wide = torch.tensor([1, 2], dtype=torch.int16)
    assert as_bytes(wide) is wide
    assert quant_format_of(torch.int8) is INT8
    assert quant_format_of(torch.float8_e4m3fn) is FP8


# Keys of 2 heads of 4 numbers: each head is its own group, so head 0's scale is
# 254 / 127 = 2 and head 1's 127 / 127 = 1 (int8), or 448 / 448 = 1 (fp8).
HEADS = torch.tensor([[[254.0, 3.0, -5.0, 1.0], [127.0, 63.5, 3.3, -0.4]]], dtype=torch.float64)
INT8_BACK = [[[254.0, 4.0, -4.0, 0.0], [127.0, 64.0, 3.0, 0.0]]]  # codes rounded half to even


def test_as_stored_gives_back_what_a_quantized_cache_holds() -> None:
    plain = PagedKV(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    assert plain.as_stored(HEADS) is HEADS
    cache = FullAttentionSpec(2, 4, torch.float32, INT8).allocate(1, 1, CPU)
    back = cache.as_stored(HEADS)
    assert back.dtype == torch.float64 and back.tolist() == INT8_BACK
    fp8 = FullAttentionSpec(2, 4, torch.float32, FP8).allocate(1, 1, CPU)
    x = torch.tensor([[[448.0, 3.3, 0.3, -20.0]]])  # scale 1: E4M3's nearest codes
    assert fp8.as_stored(x).tolist() == [[[448.0, 3.25, 0.3125, -20.0]]]


def test_round_trip_returns_the_inputs_dtype() -> None:
    x = torch.tensor([[254.0, 3.0, 127.0, 63.5]], dtype=torch.bfloat16)
    back = round_trip(x, INT8, group=2)  # groups [254, 3] (scale 2) and [127, 63.5] (1)
    assert back.dtype == torch.bfloat16 and back.tolist() == [[254.0, 4.0, 127.0, 64.0]]


def test_store_kvcache_quantized_writes_codes_and_scales_at_each_slot() -> None:
    cache = FullAttentionSpec(2, 4, torch.float32, INT8).allocate(3, 2, CPU)
    for t in cache.tensors():
        as_bytes(t).zero_()
    k = HEADS.float().repeat(2, 1, 1)
    k[1] *= -0.5  # scales 1 and 0.5
    v = torch.tensor([[[0.0, 0.0, 0.0, 12.7], [1.0, 2.0, 3.0, 4.0]]]).repeat(2, 1, 1)
    v[1, 0, 3] = 25.4
    store_kvcache(k, v, cache, torch.tensor([5, 2]))
    assert cache.k_scale is not None and cache.v_scale is not None
    assert cache.k[2, 1].tolist() == [[127, 2, -2, 0], [127, 64, 3, 0]]
    assert cache.k[1, 0].tolist() == [[-127, -2, 2, 0], [-127, -64, -3, 0]]
    assert cache.k_scale[2, 1].tolist() == [2.0, 1.0]
    assert cache.k_scale[1, 0].tolist() == [1.0, 0.5]
    assert cache.v[2, 1].tolist() == [[0, 0, 0, 127], [32, 64, 95, 127]]
    assert cache.v_scale[2, 1].tolist() == pytest.approx([0.1, 4 / 127])
    assert cache.v_scale[1, 0].tolist() == pytest.approx([0.2, 4 / 127])
    written = {(1, 0), (2, 1)}
    for b in range(3):
        for s in range(2):
            if (b, s) not in written:
                assert not cache.k[b, s].any() and not cache.v[b, s].any()
                assert not cache.k_scale[b, s].any() and not cache.v_scale[b, s].any()
    assert (
        cache.as_stored(k).tolist()
        == dequantize_rows(
            cache.k[[2, 1], [1, 0]], cache.k_scale[[2, 1], [1, 0]], torch.float32
        ).tolist()
    )


def test_store_kvcache_fp8_writes_e4m3_codes() -> None:
    cache = FullAttentionSpec(1, 4, torch.float32, FP8).allocate(1, 2, CPU)
    for t in cache.tensors():
        as_bytes(t).zero_()
    x = torch.tensor([[[448.0, 3.3, 0.3, -20.0]]])
    store_kvcache(x, 2 * x, cache, torch.tensor([1]))
    assert cache.k[0, 1].float().tolist() == [[448.0, 3.25, 0.3125, -20.0]]
    assert cache.v[0, 1].float().tolist() == [[448.0, 3.25, 0.3125, -20.0]]
    assert cache.k_scale is not None and cache.v_scale is not None
    assert cache.k_scale[0].tolist() == [[0.0], [1.0]] and cache.v_scale[0].tolist() == [
        [0.0],
        [2.0],
    ]
    assert not as_bytes(cache.k[0, 0]).any()


def test_dequantize_rows_multiplies_each_heads_codes_by_its_scale() -> None:
    codes = torch.tensor([[[1, -2, 3], [4, 5, -6]]], dtype=torch.int8)
    scales = torch.tensor([[0.5, 3.0]])
    out = dequantize_rows(codes, scales, torch.float64)
    assert out.dtype == torch.float64
    assert out.tolist() == [[[0.5, -1.0, 1.5], [12.0, 15.0, -18.0]]]


def test_mla_block_bytes_plain_and_quantized() -> None:
    """Plain: 5 x (96 + 7) x 2 bytes. Quantized, a latent of 96 (one group, as it
    is under 128): 5 x (96 codes + 4 + 7 x 2); of 384: three groups of 128."""
    assert MLACacheSpec(96, 7, torch.bfloat16).block_bytes(5) == 1030
    assert MLACacheSpec(96, 7, torch.bfloat16, INT8).block_bytes(5) == 570
    assert MLACacheSpec(384, 7, torch.bfloat16, FP8).block_bytes(5) == 2050
    assert MLACacheSpec(384, 7, torch.float32, FP8).block_bytes(5) == 2120


def test_mla_latent_group_and_the_ranks_it_refuses() -> None:
    assert LATENT_GROUP == 128
    assert MLACacheSpec(96, 7, torch.bfloat16).latent_group == 96
    assert MLACacheSpec(128, 7, torch.bfloat16).latent_group == 128
    assert MLACacheSpec(384, 7, torch.bfloat16).latent_group == 128
    spec = MLACacheSpec(384, 7, torch.bfloat16)
    assert spec.quantized(INT8) == MLACacheSpec(384, 7, torch.bfloat16, INT8)
    assert MLACacheSpec(96, 7, torch.bfloat16).quantized(FP8).quant is FP8
    with pytest.raises(ValueError) as err:
        MLACacheSpec(200, 7, torch.bfloat16).quantized(FP8)
    assert str(err.value) == (
        "a quantized MLA cache needs kv_lora_rank (200) to be a multiple of 128, "
        "the numbers that share a scale"
    )


def test_mla_allocates_rows_or_codes_scales_and_rope() -> None:
    plain = MLACacheSpec(96, 7, torch.bfloat16).allocate(2, 5, CPU)
    assert plain.rows.shape == (2, 5, 103) and plain.rows.dtype == torch.bfloat16
    assert plain.scales is None and plain.rope is None
    assert plain.tensors() == [plain.rows]
    cache = MLACacheSpec(384, 7, torch.bfloat16, FP8).allocate(2, 5, CPU)
    assert cache.rows.shape == (2, 5, 384) and cache.rows.dtype == torch.float8_e4m3fn
    assert cache.scales is not None and cache.rope is not None
    assert cache.scales.shape == (2, 5, 3) and cache.scales.dtype == torch.float32
    assert cache.rope.shape == (2, 5, 7) and cache.rope.dtype == torch.bfloat16
    assert [t.data_ptr() for t in cache.tensors()] == [
        t.data_ptr() for t in (cache.rows, cache.scales, cache.rope)
    ]
    rows = torch.zeros(1, 1, 3)
    assert LatentKV(rows, scales=torch.ones(1, 1, 1)).tensors() == [rows]
    assert LatentKV(rows, rope=torch.ones(1, 1, 1)).tensors() == [rows]


def quantized_latents(rope: torch.dtype = torch.float64) -> LatentKV:
    """An int8 MLA cache, zeroed: 3 blocks of 3 slots, a latent of 4 numbers in
    two groups of 2, and a rotary key of 3 (every size but the groups' count
    differs from the others, so one read along the wrong dimension shows)."""
    return LatentKV(
        torch.zeros(3, 3, 4, dtype=torch.int8),
        torch.zeros(3, 3, 2),
        torch.zeros(3, 3, 3, dtype=rope),
    )


LATENTS = torch.tensor([[254.0, 3.0, 127.0, 63.5], [-12.7, 1.0, 0.0, 0.0]], dtype=torch.float64)
ROPE = torch.tensor([[0.5, -1.5, 8.0], [2.5, 3.25, -4.0]], dtype=torch.float64)


def test_store_latent_and_read_it_back_quantized() -> None:
    cache = quantized_latents()
    assert cache.scales is not None and cache.rope is not None
    store_latent(LATENTS, ROPE, cache, torch.tensor([4, 0]))
    assert cache.rows[1, 1].tolist() == [127, 2, 127, 64]
    assert cache.rows[0, 0].tolist() == [-127, 10, 0, 0]
    assert cache.scales[1, 1].tolist() == [2.0, 1.0]
    assert cache.scales[0, 0].tolist() == pytest.approx([0.1, 1e-30 / 127])
    assert cache.rope[1, 1].tolist() == [0.5, -1.5, 8.0]
    assert cache.rope[0, 0].tolist() == [2.5, 3.25, -4.0]
    assert int(cache.rows.count_nonzero()) == 6 and int(cache.rope.count_nonzero()) == 6
    assert int(cache.scales.count_nonzero()) == 4
    numbers = cache.numbers(torch.tensor([1, 0]))
    assert numbers.dtype == torch.float64 and numbers.shape == (2, 3, 7)
    assert numbers[0, 1].tolist() == [254.0, 4.0, 127.0, 64.0, 0.5, -1.5, 8.0]
    assert numbers[1, 0].tolist() == pytest.approx([-12.7, 1.0, 0.0, 0.0, 2.5, 3.25, -4.0])
    assert numbers[0, 1, :4].tolist() == cache.as_stored(LATENTS)[0].tolist()
    block_table = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    got = gather_latents(cache, block_table, context=5)
    assert got.shape == (5, 7)
    assert got[0].tolist() == pytest.approx([-12.7, 1.0, 0.0, 0.0, 2.5, 3.25, -4.0])
    assert got[4].tolist() == [254.0, 4.0, 127.0, 64.0, 0.5, -1.5, 8.0]
    assert not got[1:4].any()
    assert gather_latents(cache, block_table, context=4).shape == (4, 7)


def test_a_quantized_latent_reads_back_in_the_rotary_keys_dtype() -> None:
    cache = quantized_latents(rope=torch.bfloat16)
    store_latent(LATENTS[:1], ROPE[:1].bfloat16(), cache, torch.tensor([2]))
    numbers = cache.numbers(torch.tensor([0]))
    assert numbers.dtype == torch.bfloat16
    assert numbers[0, 2].tolist() == [254.0, 4.0, 127.0, 64.0, 0.5, -1.5, 8.0]


def test_store_latent_plain_writes_latent_then_rope() -> None:
    cache = LatentKV(torch.zeros(3, 3, 7, dtype=torch.float64))
    store_latent(LATENTS, ROPE, cache, torch.tensor([5, 1]))
    assert cache.rows[1, 2].tolist() == [254.0, 3.0, 127.0, 63.5, 0.5, -1.5, 8.0]
    assert cache.rows[0, 1].tolist() == [-12.7, 1.0, 0.0, 0.0, 2.5, 3.25, -4.0]
    assert int(cache.rows.count_nonzero()) == 12
    assert cache.as_stored(LATENTS) is LATENTS
    row = cache.rows[1, 2].tolist()
    assert cache.numbers(torch.tensor([1])).tolist() == [[[0.0] * 7, [0.0] * 7, row]]
    got = gather_latents(cache, torch.tensor([1, 0, -1]), context=4)
    assert got.tolist() == [[0.0] * 7, [0.0] * 7, row, [0.0] * 7]


def test_a_latent_cache_missing_its_scales_or_rope_holds_plain_rows() -> None:
    """Only a cache with both its scales and its rotary keys is quantized."""
    for extra in ({"scales": torch.ones(3, 3, 2)}, {"rope": torch.ones(3, 3, 3)}):
        cache = LatentKV(torch.zeros(3, 3, 7, dtype=torch.float64), **extra)
        store_latent(LATENTS, ROPE, cache, torch.tensor([5, 1]))
        assert cache.rows[1, 2].tolist() == [254.0, 3.0, 127.0, 63.5, 0.5, -1.5, 8.0]
        assert cache.numbers(torch.tensor([1]))[0, 2].tolist() == cache.rows[1, 2].tolist()


def test_as_stored_latent_uses_the_caches_group_width() -> None:
    cache = quantized_latents()
    back = cache.as_stored(LATENTS)  # groups of 2: scales 2, 1; then 0.1, 1e-30/127
    assert back.dtype == torch.float64
    assert back[0].tolist() == [254.0, 4.0, 127.0, 64.0]
    assert back[1].tolist() == pytest.approx([-12.7, 1.0, 0.0, 0.0])


def test_every_tensor_is_allocated_on_the_device_asked_for() -> None:
    """The meta device: shapes without memory, and not the default device."""
    meta = torch.device("meta")
    specs = [
        FullAttentionSpec(3, 5, torch.bfloat16),
        FullAttentionSpec(3, 5, torch.bfloat16, INT8),
        MLACacheSpec(96, 7, torch.bfloat16),
        MLACacheSpec(384, 7, torch.bfloat16, FP8),
    ]
    for spec in specs:
        assert all(t.device == meta for t in spec.allocate(2, 5, meta).tensors())


def test_scales_are_float32_whatever_the_default_dtype() -> None:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        paged = FullAttentionSpec(3, 5, torch.bfloat16, INT8).allocate(1, 2, CPU)
        latent = MLACacheSpec(384, 7, torch.bfloat16, FP8).allocate(1, 2, CPU)
    finally:
        torch.set_default_dtype(default)
    assert paged.k_scale is not None and paged.v_scale is not None and latent.scales is not None
    assert paged.k_scale.dtype == paged.v_scale.dtype == latent.scales.dtype == torch.float32


def test_a_paged_cache_missing_a_scale_holds_plain_numbers() -> None:
    """Only a cache with both scales is quantized: with one, keys and values are
    stored as they are."""
    k, v = torch.tensor([[[1.5, -2.0]]]), torch.tensor([[[3.0, 0.25]]])
    for extra in ({"k_scale": torch.ones(1, 2, 1)}, {"v_scale": torch.ones(1, 2, 1)}):
        cache = PagedKV(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), **extra)
        store_kvcache(k, v, cache, torch.tensor([1]))
        assert cache.k[0, 1].tolist() == [[1.5, -2.0]] and cache.v[0, 1].tolist() == [[3.0, 0.25]]


def test_block_bytes_are_whole_numbers() -> None:
    sizes = [
        FullAttentionSpec(3, 5, torch.float32).block_bytes(7),
        FullAttentionSpec(3, 5, torch.float32, INT8).block_bytes(7),
        MLACacheSpec(96, 7, torch.bfloat16).block_bytes(5),
        MLACacheSpec(384, 7, torch.bfloat16, FP8).block_bytes(5),
    ]
    assert [type(n) for n in sizes] == [int] * 4


# The pool (issue 49): its sizing, where it binds each layer's cache, which blocks
# it zeroes, and the blocks it copies out and back. The pool reads these fields of
# an EngineConfig; a stand-in holds them, so each sizing rule is set by hand.
def pool_config(**fields) -> SimpleNamespace:
    hf = SimpleNamespace(max_position_embeddings=fields.pop("max_pos", 1000))
    block_size = fields.pop("block_size", 3)
    spans = fields.pop("spans", ())
    config = SimpleNamespace(
        block_size=block_size,
        dtype=torch.float32,
        kv_cache_dtype="auto",
        num_kv_blocks=7,
        max_model_len=None,
        max_num_seqs=4,
        max_num_batched_tokens=8192,
        kv_cache_memory_fraction=None,
        kv_window=None,
        hf_config=hf,
    )
    for name, value in fields.items():
        assert hasattr(config, name), name
        setattr(config, name, value)
    config.kv_cache_groups = KVCacheGroups(block_size, spans=tuple(map(SpanGroup, spans)))
    return config


class Layer:
    """An attention layer as the pool sees it, noting the dtype it was asked for."""

    def __init__(self, spec) -> None:
        self.spec, self.kv_cache, self.asked = spec, None, []

    def kv_cache_spec(self, dtype: torch.dtype):
        self.asked.append(dtype)
        return self.spec


# 2 heads of 5 numbers (2 x 3 x 2 x 5 x 4 = 240 bytes a block of 3 in float32),
# and a latent of 11 numbers with a rotary key of 2 (3 x 13 x 4 = 156 bytes).
FULL, LATENT = FullAttentionSpec(2, 5, torch.float32), MLACacheSpec(11, 2, torch.float32)


def make_pool(device: torch.device = CPU, specs=(FULL, LATENT), **fields) -> KVCachePool:
    layers = [Layer(spec) for spec in specs]
    return KVCachePool(pool_config(**fields), layers, device)


def numbered(pool: KVCachePool) -> None:
    """Every byte of every tensor set to its index mod 251 plus 1 (never 0), so
    that each block's bytes differ from every other's and from zeros."""
    for layer in pool.layers:
        for t in layer.kv_cache.tensors():
            raw = as_bytes(t).view(-1) if t.element_size() == 1 else t.view(-1)
            raw.copy_(torch.arange(raw.numel()) % 251 + 1)


def test_the_pool_binds_each_layer_its_cache_at_the_pools_size() -> None:
    pool = make_pool()
    assert pool.block_size == 3 and pool.num_blocks == 7
    assert pool.max_model_len == 21  # 7 blocks of 3, below the checkpoint's 1000
    assert pool.kv_cache_config() == KVCacheConfig(7, 3, 21)
    assert pool.specs == [FULL, LATENT] and pool.block_bytes() == 240 + 156
    assert [layer.asked for layer in pool.layers] == [[torch.float32], [torch.float32]]
    first, second = (layer.kv_cache for layer in pool.layers)
    assert first.k.shape == (7, 3, 2, 5) and second.rows.shape == (7, 3, 13)
    assert pool.num_touched_blocks == 0  # the CPU's pool is zeroed as blocks are first used


def test_a_quantized_pool_quantizes_every_layers_spec() -> None:
    pool = make_pool(specs=(FULL,), kv_cache_dtype="int8")
    assert pool.specs == [FullAttentionSpec(2, 5, torch.float32, INT8)]
    assert pool.block_bytes() == 2 * 3 * 2 * (5 + 4)  # a code each, a scale a head
    cache = pool.layers[0].kv_cache
    assert cache.k.dtype == torch.int8 and cache.k_scale.shape == (7, 3, 2)


def test_a_pool_off_the_cpu_is_zeroed_whole_at_once() -> None:
    """A GPU's memory is reserved as it is allocated; the meta device stands in."""
    pool = make_pool(torch.device("meta"))
    assert pool.num_touched_blocks == 7
    tensors = [t for layer in pool.layers for t in layer.kv_cache.tensors()]
    assert len(tensors) == 3 and all(t.device.type == "meta" for t in tensors)


def test_blocks_read_on_the_host_are_written_onto_the_pools_device() -> None:
    data = make_pool().read_blocks([1, 2])
    meta = make_pool(torch.device("meta"))
    meta.write_blocks([3, 0], data)  # index and rows moved to the meta device, or it refuses
    assert meta.layers[1].kv_cache.rows.device.type == "meta"


def test_a_pool_of_one_single_tensor_cache_reads_and_writes() -> None:
    pool = make_pool(specs=(LATENT,))
    pool.touch(7)
    numbered(pool)
    data = pool.read_blocks([6, 0])
    assert [len(copies) for copies in data.layers] == [1]
    pool.write_blocks([1, 5], data)
    rows = pool.layers[0].kv_cache.rows
    assert torch.equal(rows[5], rows[0]) and torch.equal(rows[1], rows[6])


def test_a_pool_of_no_layers_holds_blocks_of_nothing() -> None:
    pool = make_pool(specs=())
    assert pool.block_bytes() == 0 and pool.num_blocks == 7
    data = pool.read_blocks([0, 6])
    assert data.layers == [] and data.num_blocks == 0 and pool.num_touched_blocks == 7
    pool.write_blocks([2], data)


def test_touch_zeroes_only_the_blocks_not_yet_touched() -> None:
    pool = make_pool()
    numbered(pool)
    pool.touch(2)
    assert pool.num_touched_blocks == 2
    numbered(pool)
    pool.touch(5)  # blocks 2, 3 and 4: 0 and 1 were zeroed already
    assert pool.num_touched_blocks == 5
    assert zeroed_blocks(pool) == [0, 0, 1, 1, 1, 0, 0]
    pool.touch(4)  # fewer than touched: nothing
    assert pool.num_touched_blocks == 5
    pool.touch(100)  # past the pool: up to its end
    assert pool.num_touched_blocks == 7
    assert zeroed_blocks(pool) == [0, 0, 1, 1, 1, 1, 1]


def zeroed_blocks(pool: KVCachePool) -> list[int]:
    """1 for each block all zeros in every tensor of every layer, 0 for each block
    with no zero byte in any (numbered), and an AssertionError for any other."""
    tensors = [as_bytes(t) for layer in pool.layers for t in layer.kv_cache.tensors()]
    zero = [{int(t[b].count_nonzero() == 0) for t in tensors} for b in range(pool.num_blocks)]
    full = [
        {int(t[b].count_nonzero() == t[b].numel()) for t in tensors} for b in range(pool.num_blocks)
    ]
    assert all(len(z) == 1 and z != f for z, f in zip(zero, full)), (zero, full)
    return [z.pop() for z in zero]


def test_forget_touched_has_each_block_zeroed_again() -> None:
    pool = make_pool()
    pool.touch(7)
    numbered(pool)
    pool.forget_touched()
    assert pool.num_touched_blocks == 0
    pool.touch(1)
    cache = pool.layers[0].kv_cache
    assert cache.k[0].count_nonzero() == 0 and cache.k[1].count_nonzero() == 30


def test_read_blocks_copies_each_tensors_blocks_in_the_order_given() -> None:
    pool = make_pool(specs=(FULL, FullAttentionSpec(2, 5, torch.float32, FP8)))
    pool.touch(7)
    numbered(pool)
    data = pool.read_blocks([5, 2, 6])
    assert data.num_blocks == 3 and data.nbytes() == 3 * pool.block_bytes() == 3 * (240 + 108)
    for layer, copies in zip(pool.layers, data.layers, strict=True):
        tensors = layer.kv_cache.tensors()
        assert len(copies) == len(tensors)
        for t, rows in zip(tensors, copies):
            assert rows.dtype == t.dtype and rows.device == CPU
            assert torch.equal(as_bytes(rows), as_bytes(t)[[5, 2, 6]])
            assert rows.data_ptr() != t.data_ptr()  # a copy


def test_read_blocks_zeroes_blocks_never_used_first() -> None:
    pool = make_pool()
    numbered(pool)  # what the memory held before
    data = pool.read_blocks([4, 1])
    assert pool.num_touched_blocks == 5  # up to the last block read
    assert all(rows.count_nonzero() == 0 for copies in data.layers for rows in copies)
    assert pool.layers[0].kv_cache.k[5].count_nonzero() == 30  # beyond: left alone


def test_no_blocks_read_or_written_touches_nothing() -> None:
    pool = make_pool()
    data = pool.read_blocks([])
    assert pool.num_touched_blocks == 0
    assert data.num_blocks == 0 and data.nbytes() == 0
    assert [[tuple(rows.shape) for rows in copies] for copies in data.layers] == [
        [(0, 3, 2, 5), (0, 3, 2, 5)],
        [(0, 3, 13)],
    ]
    pool.write_blocks([], data)
    assert pool.num_touched_blocks == 0


def test_blocks_of_no_tensors_number_none() -> None:
    assert KVBlocks([]).num_blocks == 0 and KVBlocks([[], []]).num_blocks == 0
    assert KVBlocks([[], [torch.zeros(2, 3)]]).num_blocks == 2
    assert KVBlocks([[torch.zeros(2, 3, dtype=torch.int8)], [torch.zeros(2)]]).nbytes() == 14


def test_write_blocks_puts_each_block_where_its_id_says() -> None:
    source = make_pool()
    source.touch(7)
    numbered(source)
    data = source.read_blocks([1, 6])
    target = make_pool()
    target.write_blocks([5, 0], data)
    assert target.num_touched_blocks == 6  # blocks 0 to 5 count as used now
    for ours, theirs in zip(target.layers, source.layers):
        for t, s in zip(ours.kv_cache.tensors(), theirs.kv_cache.tensors()):
            assert torch.equal(t[5], s[1]) and torch.equal(t[0], s[6])
            assert t[1:5].count_nonzero() == 0  # zeroed as touched, not written


def test_block_ids_are_checked_at_both_ends_of_the_pool() -> None:
    pool = make_pool()
    assert pool.read_blocks([0, 6]).num_blocks == 2  # the first and the last block
    with pytest.raises(ValueError, match=r"^block ids \[7, -1\] are outside this pool's 7 blocks$"):
        pool.read_blocks([7, 3, -1])
    data = pool.read_blocks([1, 2])
    with pytest.raises(
        ValueError, match=r"^block ids \[4, 4\] repeat: each block can be written once$"
    ):
        pool.write_blocks([4, 4], data)


def test_data_that_does_not_fit_is_refused_in_so_many_words() -> None:
    pool = make_pool()
    data = pool.read_blocks([0, 1])
    cases = [
        (KVBlocks(data.layers[:1]), "data has 1 layers; this pool has 2"),
        (
            KVBlocks([data.layers[0], data.layers[0]]),
            "layer 1: data has 2 tensors; this pool has 1",
        ),
        (
            KVBlocks([data.layers[0], [data.layers[1][0][:1]]]),
            "layer 1 tensor 0: data holds 1 blocks but 2 block ids were given",
        ),
        (
            KVBlocks([data.layers[0], [data.layers[1][0].double()]]),
            "layer 1 tensor 0: data is (2, 3, 13) torch.float64; "
            "this pool's blocks are (2, 3, 13) torch.float32",
        ),
        (
            KVBlocks([[data.layers[0][0], data.layers[0][1][:, :2]], data.layers[1]]),
            "layer 0 tensor 1: data is (2, 2, 2, 5) torch.float32; "
            "this pool's blocks are (2, 3, 2, 5) torch.float32",
        ),
    ]
    for bad, words in cases:
        with pytest.raises(ValueError) as refused:
            pool.write_blocks([3, 4], bad)
        assert str(refused.value) == words
    assert pool.num_touched_blocks == 2  # nothing refused was written


def fake_sysconf(pages: int, page_size: int):
    """os.sysconf with the available pages and the page size set; any other name
    is the machine's."""
    real, fake = os.sysconf, {"SC_AVPHYS_PAGES": pages, "SC_PAGE_SIZE": page_size}

    def sysconf(name: str) -> int:
        return fake[name] if name in fake else real(name)

    return sysconf


def test_an_unsized_cpu_pool_takes_a_fifth_of_available_memory(monkeypatch) -> None:
    """(1,000 pages of 4,096 bytes) x 0.2 = 819,200 bytes, in blocks of 240 + 156:
    2,068 blocks (2,068.7 fit), under 1,000 sequences of 334 blocks each."""
    monkeypatch.setattr(os, "sysconf", fake_sysconf(1000, 4096))
    pool = make_pool(num_kv_blocks=None, max_num_seqs=1000)
    assert pool.num_blocks == 2068
    half = make_pool(num_kv_blocks=None, max_num_seqs=1000, kv_cache_memory_fraction=0.5)
    assert half.num_blocks == 5171  # 2,048,000 / 396 = 5,171.7


def test_an_unsized_pool_stops_at_what_its_sequences_could_use(monkeypatch) -> None:
    monkeypatch.setattr(os, "sysconf", fake_sysconf(1000, 4096))
    assert make_pool(num_kv_blocks=None).num_blocks == 4 * 334  # 4 x ceil(1,000 / 3)
    capped = make_pool(num_kv_blocks=None, max_model_len=20)
    assert capped.num_blocks == 4 * 7 and capped.max_model_len == 20  # 4 x ceil(20 / 3)
    monkeypatch.setattr(os, "sysconf", fake_sysconf(1, 1000))  # 200 bytes: no block fits
    assert make_pool(num_kv_blocks=None).num_blocks == 1  # one block still


def test_an_unsized_gpu_pool_takes_nine_tenths_of_free_memory(monkeypatch) -> None:
    pool = make_pool(max_num_seqs=1000)
    asked = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 396_000, 10**9  # free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    gpu = torch.device("cuda", 1)
    assert pool._blocks_that_fit(gpu) == 900  # 396,000 x 0.9 / 396
    assert asked == [gpu]
    pool.config.kv_cache_memory_fraction = 0.5
    assert pool._blocks_that_fit(gpu) == 500
    pool.config.max_num_seqs = 1
    assert pool._blocks_that_fit(gpu) == 334


def test_max_model_len_is_the_checkpoints_or_the_caches_whichever_is_less() -> None:
    assert make_pool(max_pos=20).max_model_len == 20  # 7 blocks of 3 hold 21
    assert make_pool(max_pos=22).max_model_len == 21
    assert make_pool(max_pos=22, max_model_len=21).max_model_len == 21  # exactly full
    assert make_pool(max_pos=20, max_model_len=20).max_model_len == 20  # exactly the limit
    with pytest.raises(ValueError) as past:
        make_pool(max_pos=20, max_model_len=21)
    assert str(past.value) == "max_model_len 21 exceeds the model's max_position_embeddings 20"
    with pytest.raises(ValueError) as too_long:
        make_pool(max_pos=30, max_model_len=22)
    assert str(too_long.value) == (
        "max_model_len 22 does not fit in the KV cache (7 blocks of 3, room for 21 tokens "
        "of one sequence); raise num_kv_blocks or lower max_model_len"
    )


def test_a_window_lets_one_sequence_run_past_its_blocks() -> None:
    """Blocks of 4, 5 sinks and a window of 9, a step of 13 tokens: a sequence
    holds at most 2 + 3 + 4 blocks and 2 for unaligned ends, 11 in all."""
    window = dict(block_size=4, kv_window=(5, 9), max_num_batched_tokens=13, max_pos=1000)
    assert make_pool(num_kv_blocks=11, **window)._lone_capacity() == 1000  # the checkpoint's
    assert make_pool(num_kv_blocks=10, **window)._lone_capacity() == 40  # 10 blocks of 4
    # A step of the checkpoint's 7 positions when that is below the batch's 13: 2 blocks.
    short = dict(window, max_pos=7)
    assert make_pool(num_kv_blocks=9, **short)._lone_capacity() == 7
    assert make_pool(num_kv_blocks=8, **short)._lone_capacity() == 32


def test_span_groups_take_a_block_per_span_on_top_of_the_window() -> None:
    """Spans of 8 and 12 tokens add 1/8 + 1/12 = 5/24 of a block a token: with 30
    blocks, 11 of them held, 19 x 24 / 5 = 91.2 tokens, so 91."""
    window = dict(block_size=4, kv_window=(5, 9), max_num_batched_tokens=13, spans=(8, 12))
    assert make_pool(num_kv_blocks=30, **window)._lone_capacity() == 91
    assert make_pool(num_kv_blocks=11, **window)._lone_capacity() == 0
    assert make_pool(num_kv_blocks=10, **window)._lone_capacity() == 40  # the window never bites
    one = dict(window, spans=(8,))
    assert make_pool(num_kv_blocks=30, **one)._lone_capacity() == 152  # 19 x 8
