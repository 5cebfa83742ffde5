"""DeepSeek-V4's paged cache (engine/kv/compressed_cache.py) pinned to exact
values (issue 49): the numbers a page holds for a token block and for a row
block, where each layer's parts sit in it, the slot of a position or a row
through a table, and what a write puts where. test_deepseek_v4.py runs these
through the model, where a part at a wrong offset is only a wrong float."""

from __future__ import annotations

import pytest
import torch

from engine.config.kv_format import FORMATS
from engine.kv.compressed_cache import (
    ROW_GROUP,
    CompressedAttentionSpec,
    CompressedCacheLayers,
    CompressedCacheSpec,
    batch_slots,
    carve,
    read,
    row_slots,
    slots,
    write,
)

# A CSA-like layer (kv 2, compressor state 3, indexer state 1; rows of 2 and keys of 1,
# one row per 2 tokens) and a sliding-window-only layer (kv 2, nothing else).
CSA = CompressedAttentionSpec(2, 3, 1, 2, 1, rate=2)
SWA = CompressedAttentionSpec(2, 0, 0, 0, 0, rate=0)


def test_the_row_group_is_the_one_after_the_token_group() -> None:
    assert ROW_GROUP == 1


def test_numbers_a_token_slot_and_a_row_block_take() -> None:
    assert CSA.token_numbers() == 2 + 3 + 1 and SWA.token_numbers() == 2
    assert CSA.row_numbers(8) == 8 // 2 * (2 + 1) == 12 and SWA.row_numbers(8) == 0
    assert CompressedAttentionSpec(1, 0, 0, 5, 3, rate=4).row_numbers(16) == 4 * 8


def test_a_page_holds_the_larger_of_a_token_block_and_a_row_block() -> None:
    spec = CompressedCacheSpec((CSA, SWA), row_span=8, dtype=torch.float16)
    assert spec.page_numbers(4) == max(4 * (6 + 2), 12) == 32  # token parts the larger
    assert spec.block_bytes(4) == 32 * 2
    wide_rows = CompressedCacheSpec((CSA, SWA), row_span=64, dtype=torch.float32)
    assert wide_rows.page_numbers(1) == max(1 * 8, 64 // 2 * 3) == 96  # row parts the larger
    assert wide_rows.block_bytes(1) == 96 * 4
    assert type(wide_rows.page_numbers(1)) is int  # a shape: whole numbers of rows
    assert wide_rows.allocate(2, 1, torch.device("meta")).pages.shape == (2, 96)


def test_each_layers_parts_are_views_at_their_offsets_in_every_page() -> None:
    pages = torch.arange(2 * 32, dtype=torch.float32).view(2, 32)
    csa, swa = carve(pages, (CSA, SWA), block_size=4, row_span=8)
    # Token parts from each page's start: CSA's kv 4 x 2, state 4 x 3, index 4 x 1, SWA's kv.
    assert csa.kv.shape == (2, 4, 2) and csa.kv[1, 0].tolist() == [32, 33]
    assert csa.kv[0, 3].tolist() == [6, 7]
    assert csa.state.shape == (2, 4, 3) and csa.state[0, 0].tolist() == [8, 9, 10]
    assert csa.index_state.shape == (2, 4, 1) and csa.index_state[0, :, 0].tolist() == [
        20,
        21,
        22,
        23,
    ]
    assert swa.kv.shape == (2, 4, 2) and swa.kv[0, 0].tolist() == [24, 25]
    assert swa.kv[1, 3].tolist() == [32 + 30, 32 + 31]
    # Row parts from the page's start too: CSA's 8 / 2 = 4 rows of 2, then 4 keys of 1.
    assert csa.rows.shape == (2, 4, 2) and csa.rows[0].flatten().tolist() == list(range(8))
    assert csa.index_keys.shape == (2, 4, 1) and csa.index_keys[1, :, 0].tolist() == [
        40,
        41,
        42,
        43,
    ]
    assert swa.state is None and swa.index_state is None
    assert swa.rows is None and swa.index_keys is None
    csa.rows[1, 2, 1] = -1.0  # views, not copies
    assert pages[1, 5].item() == -1.0
    # A second layer's rows follow the first's rows and keys: HCA's 8 / 4 = 2 rows of 2.
    hca = CompressedAttentionSpec(2, 3, 0, 2, 0, rate=4)
    _, second = carve(torch.arange(44.0).view(1, 44), (CSA, hca), block_size=4, row_span=8)
    assert second.rows[0].tolist() == [[12, 13], [14, 15]] and second.index_keys is None
    assert second.state[0, 0].tolist() == [32, 33, 34]  # after both kv blocks: 24 + 8
    no_rate = CompressedAttentionSpec(2, 0, 0, 2, 1, rate=0)  # rate 0: no rows, whatever widths
    [only] = carve(pages, (no_rate,), block_size=4, row_span=8)
    assert only.rows is None and only.index_keys is None


def test_allocate_makes_pages_of_the_spec_and_carves_them() -> None:
    spec = CompressedCacheSpec((CSA, SWA), row_span=8, dtype=torch.float16)
    cache = spec.allocate(num_blocks=3, block_size=4, device=torch.device("meta"))
    assert cache.pages.shape == (3, 32) and cache.pages.dtype == torch.float16
    assert cache.pages.device.type == "meta" and cache.tensors() == [cache.pages]
    assert [c.kv.shape for c in cache.layers] == [(3, 4, 2), (3, 4, 2)]
    assert cache.layers[0].rows.shape == (3, 4, 2) and cache.layers[1].rows is None


def test_a_quantized_v4_cache_is_refused_by_name() -> None:
    spec = CompressedCacheSpec((CSA,), row_span=8, dtype=torch.float16)
    message = (
        "kv_cache_dtype='int8' is not supported on DeepSeek-V4 yet: its "
        "compressor reads its states back in the model's dtype"
    )
    with pytest.raises(ValueError, match=f"^{message}$"):
        spec.quantized(FORMATS["int8"])


class Layer:
    def __init__(self, spec: CompressedAttentionSpec) -> None:
        self.spec, self.kv_cache, self.asked = spec, "unbound", []

    def kv_cache_spec(self, dtype: torch.dtype) -> CompressedAttentionSpec:
        self.asked.append(dtype)
        return self.spec


def test_the_layers_as_one_cached_layer_bind_each_its_views() -> None:
    a, b = Layer(CSA), Layer(SWA)
    layers = CompressedCacheLayers([a, b], row_span=8)
    assert layers.kv_cache is None
    spec = layers.kv_cache_spec(torch.bfloat16)
    assert spec == CompressedCacheSpec((CSA, SWA), 8, torch.bfloat16)
    assert a.asked == b.asked == [torch.bfloat16]
    cache = spec.allocate(2, 4, torch.device("cpu"))
    layers.kv_cache = cache
    assert layers.kv_cache is cache
    assert a.kv_cache is cache.layers[0] and b.kv_cache is cache.layers[1]
    layers.kv_cache = None
    assert layers.kv_cache is None and a.kv_cache is None and b.kv_cache is None


def test_slots_of_positions_rows_and_a_padded_batch() -> None:
    table = torch.tensor([5, 2], dtype=torch.int32)
    got = slots(table, torch.tensor([0, 3, 4, 7]), block_size=4)
    assert got.tolist() == [20, 23, 8, 11] and got.dtype == torch.int64
    cache = torch.zeros(6, 4, 2)  # 4 rows a row block
    got = row_slots(torch.tensor([3, 1], dtype=torch.int32), torch.tensor([0, 3, 4, 5]), cache)
    assert got.tolist() == [12, 15, 4, 5] and got.dtype == torch.int64
    tables = torch.tensor([[2, -1], [0, 3]])
    got = batch_slots(tables, torch.tensor([[1, 5], [6, 0]]), per_block=4)
    assert got.tolist() == [[9, 1], [14, 0]]  # a -1 block reads block 0


def test_write_and_read_rows_at_slots() -> None:
    cache = torch.zeros(3, 4, 2, dtype=torch.float16)
    write(cache, torch.tensor([5, 11]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert cache[1, 1].tolist() == [1.0, 2.0] and cache[2, 3].tolist() == [3.0, 4.0]
    assert cache.abs().sum().item() == 10.0 and cache.dtype == torch.float16
    got = read(cache, torch.tensor([11, 5, 0]))
    assert got.tolist() == [[3.0, 4.0], [1.0, 2.0], [0.0, 0.0]] and got.dtype == torch.float16
