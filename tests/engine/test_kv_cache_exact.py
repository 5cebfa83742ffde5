"""The KV cache's stored values pinned to exact numbers (issue 49): the bytes a
block takes in each format, the tensors each format allocates, where a step's
keys, values and latents land, and what a quantized cache gives back. Inputs
are chosen so that every code and scale is exact, and sizes are distinct primes
where they can be, so that a value off by one, or two sizes swapped, shows."""

from __future__ import annotations

import pytest
import torch

from engine.config.kv_format import FORMATS
from engine.kv.kv_cache import (
    LATENT_GROUP,
    FullAttentionSpec,
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
