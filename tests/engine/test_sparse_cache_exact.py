"""DeepSeek-V3.2's sparse-attention cache pinned to exact values (issue 49): the
bytes a block takes, the tensors the pool sees, where an indexer key is written
and read back, and which latent rows a selection reads, -1 included."""

from __future__ import annotations

import pytest
import torch

from engine.config.kv_format import QuantFormat
from engine.kv.kv_cache import MLACacheSpec
from engine.kv.sparse_cache import (
    IndexedLatentKV,
    IndexedLatentSpec,
    gather_index_keys,
    gather_selected,
    store_index_keys,
)

SPEC = IndexedLatentSpec(MLACacheSpec(kv_lora_rank=8, rope_dim=4, dtype=torch.bfloat16), 6)


def test_a_block_holds_latent_rows_and_indexer_keys() -> None:
    assert SPEC.index_bytes(16) == 16 * 6 * 2 == 192
    assert SPEC.block_bytes(16) == 16 * (8 + 4) * 2 + 192 == 576
    fp32 = IndexedLatentSpec(MLACacheSpec(8, 4, torch.float32), 3)
    assert (fp32.index_bytes(2), fp32.block_bytes(2)) == (24, 2 * 12 * 4 + 24)


def test_the_cache_shows_the_pool_both_tensors() -> None:
    cache = SPEC.allocate(num_blocks=5, block_size=4, device=torch.device("cpu"))
    assert isinstance(cache, IndexedLatentKV)
    assert cache.rows.shape == (5, 4, 12) and cache.rows.dtype == torch.bfloat16
    assert cache.index_keys.shape == (5, 4, 6) and cache.index_keys.dtype == torch.bfloat16
    assert cache.tensors() == [cache.rows, cache.index_keys]
    assert cache.scales is None and cache.rope is None
    total = sum(t.numel() * t.element_size() for t in cache.tensors())
    assert total == 5 * SPEC.block_bytes(4)


def test_a_quantized_sparse_cache_is_refused_by_name() -> None:
    fmt = QuantFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0)
    with pytest.raises(ValueError) as err:
        SPEC.quantized(fmt)
    assert str(err.value) == (
        "kv_cache_dtype='fp8_e4m3' is not supported on DeepSeek-V3.2's sparse attention yet: "
        "its selected-row reads take an unquantized latent"
    )


def test_indexer_keys_go_to_their_slots_and_come_back_through_the_block_table() -> None:
    cache = IndexedLatentSpec(MLACacheSpec(2, 1, torch.float32), 3).allocate(
        4, 2, torch.device("cpu")
    )
    cache.index_keys.zero_()
    keys = torch.arange(15, dtype=torch.float64).view(5, 3)  # cast to the cache's dtype
    # A sequence in blocks 3 then 1: slots 6, 7, 2, 3, then 5 of another sequence.
    store_index_keys(keys, cache, torch.tensor([6, 7, 2, 3, 5]))
    assert cache.index_keys.dtype == torch.float32
    assert cache.index_keys[3].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert cache.index_keys[1].tolist() == [[6, 7, 8], [9, 10, 11]]
    assert cache.index_keys[2, 1].tolist() == [12, 13, 14]
    table = torch.tensor([3, 1, -1, -1], dtype=torch.int32)
    assert gather_index_keys(cache, table, 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert gather_index_keys(cache, table, 4).tolist() == keys[:4].tolist()
    assert gather_index_keys(cache, table, 1).tolist() == [[0, 1, 2]]


def test_a_selection_reads_its_rows_and_minus_one_reads_the_first() -> None:
    rows = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3)  # row r of slot s: 3s..3s+2
    cache = IndexedLatentKV(rows, index_keys=torch.zeros(4, 2, 1))
    tables = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    positions = torch.tensor([[0, 3, -1], [1, 2, 3]])
    got = gather_selected(cache, tables, positions)
    assert got.shape == (2, 3, 3)
    slots = [[4, 1, 4], [3, 6, 7]]  # block * 2 + position % 2 through each row's table
    assert got[..., 0].tolist() == [[3.0 * s for s in row] for row in slots]


def test_both_tensors_go_on_the_device_asked_for() -> None:
    cache = SPEC.allocate(num_blocks=2, block_size=4, device=torch.device("meta"))
    assert cache.rows.device.type == "meta" and cache.index_keys.device.type == "meta"
