"""The store connector's decisions and counts on constructed requests, to the
block and the byte (kv/store_connector.py): which blocks a save reads out of
the pool (the full computed blocks the store lacks, never the block holding
the newest token), which a load looks up and writes where, when loading is
judged to pay, and every KVTransferStats field and record those moves leave.
A pool of one layer stands in for the engine's; the store is a real DiskStore;
the connector's clock ticks one second per reading."""

from __future__ import annotations

import pytest
import torch

from engine.kv import store_connector as sc
from engine.kv.block_codec import layout_of
from engine.kv.handoff import Handoff
from engine.kv.kv_cache import KVBlocks
from engine.kv.store import DiskStore
from engine.kv.store.entry import HEADER
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.stats import KVTransferRecord, KVTransferStats

BS = 4
ROOT = b"r" * 32
# A stored block: the token count (4 bytes), 4 token ids (8 each), 2 float32 numbers.
PAYLOAD = 4 + 8 * BS + 2 * 4


class Pool:
    """One layer of one tensor: block i holds (i, i + 0.5). Reads and writes recorded."""

    def __init__(self) -> None:
        self.t = torch.stack([torch.tensor([i, i + 0.5]) for i in range(32)])
        self.reads: list[list[int]] = []
        self.writes: list[tuple[list[int], list[float]]] = []

    def read_kv_blocks(self, block_ids: list[int]) -> KVBlocks:
        self.reads.append(list(block_ids))
        return KVBlocks([[self.t[block_ids].clone()]])

    def write_kv_blocks(self, block_ids: list[int], data: KVBlocks) -> None:
        self.writes.append((list(block_ids), data.layers[0][0][:, 0].tolist()))


class Ticks:
    """The connector's clock: one second later at every reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def parts(tmp_path, monkeypatch):
    monkeypatch.setattr(sc, "time", Ticks())
    pool = Pool()
    store = DiskStore(tmp_path, 1 << 20)
    stats = KVTransferStats()
    cost = sc.TransferCost(compute_seconds_per_token=0.5, load_seconds_per_block=0.25)
    layout = layout_of(pool.read_kv_blocks([0]))
    pool.reads.clear()
    conn = sc.StoreConnector(store, pool, layout, BS, ROOT, cost, stats, background_saves=False)
    yield conn, pool, store, stats
    conn.close()


def request(n: int, computed: int, rid: str = "a") -> Sequence:
    seq = Sequence(rid, list(range(100, 100 + n)), SamplingParams())
    seq.num_computed_tokens = computed
    return seq


@pytest.mark.parametrize(
    "n,computed,saved",
    [(11, 11, 2), (12, 12, 2), (13, 12, 3), (13, 11, 2), (3, 3, 0), (9, 8, 2)],
)
def test_a_save_reads_the_full_computed_blocks_before_the_newest_token(
    parts, n, computed, saved
) -> None:
    conn, pool, store, stats = parts
    assert conn.request_finished(request(n, computed), [7, 3, 9, 5]) is False
    assert pool.reads == ([[7, 3, 9][:saved]] if saved else [])
    assert store.contains(conn.chain(request(n, n), 4)) == saved
    assert (stats.saved_blocks, stats.saved_bytes) == (saved, saved * PAYLOAD)
    assert store.stats.bytes_written == saved * PAYLOAD


def test_a_save_reads_only_the_blocks_the_store_lacks(parts) -> None:
    conn, pool, store, stats = parts
    conn.request_finished(request(9, 9), [7, 3, 9])  # blocks 0 and 1
    conn.request_finished(request(13, 13, "b"), [7, 3, 9, 5])  # block 2 is new
    conn.request_finished(request(13, 13, "c"), [1, 2, 4, 6])  # nothing new: no read
    assert pool.reads == [[7, 3], [9]]
    assert (stats.saved_blocks, stats.saved_bytes) == (3, 3 * PAYLOAD)
    assert conn.take_records() == [
        KVTransferRecord("save", 8, 2 * PAYLOAD, 2.0, 8 * 0.5),  # copy 1 s, put 1 s
        KVTransferRecord("save", 4, PAYLOAD, 2.0, 4 * 0.5),
    ]
    assert conn.take_records() == []
    assert stats.save_seconds == 4.0


@pytest.mark.parametrize(
    "n,computed,external",
    [(11, 0, 8), (11, 4, 4), (11, 8, 0), (9, 0, 8), (8, 0, 4), (4, 0, 0), (12, 0, 8)],
)
def test_a_lookup_offers_the_stored_blocks_before_the_newest_token(
    parts, n, computed, external
) -> None:
    conn, _, _, stats = parts
    conn.request_finished(request(13, 13), [7, 3, 9, 5])  # blocks 0, 1, 2 stored
    assert conn.num_external_tokens(request(n, computed), computed) == (external, external > 0)
    assert stats.skipped_tokens == 0


def test_a_load_writes_what_it_found_where_it_was_given_and_counts_it(parts) -> None:
    conn, pool, store, stats = parts
    conn.request_finished(request(13, 13), [7, 3, 9, 5])
    conn.take_records()
    seq = request(11, 0, "b")
    conn.after_allocation(seq, [20, 21], 8)
    conn.fetcher.submit(lambda: None).result()  # the fetch is done
    assert conn.finished_loads() == {"b": 8}
    assert pool.writes == [([20, 21], [7.0, 3.0])]
    assert (stats.loads, stats.hit_tokens, stats.handoff_tokens) == (1, 8, 0)
    assert (stats.loaded_bytes, stats.failed_blocks) == (2 * PAYLOAD, 0)
    assert stats.load_seconds == 1.0 and stats.recompute_seconds_estimate == 8 * 0.5
    assert conn.take_records() == [KVTransferRecord("load", 8, 2 * PAYLOAD, 1.0, 4.0)]
    # A running mean of one second over two blocks, weighted 0.2 to the new.
    assert conn.cost.load_seconds_per_block == pytest.approx(0.25 + 0.2 * (0.5 - 0.25), abs=1e-12)


def test_a_load_stops_at_the_first_block_gone_and_counts_the_rest_failed(parts) -> None:
    conn, pool, store, stats = parts
    conn.request_finished(request(13, 13), [7, 3, 9, 5])
    chain = conn.chain(request(13, 13), 3)
    store.evict(chain[1])
    seq = request(13, 4, "b")
    seq.handoff = Handoff([], 0, chain)  # handed on: its tokens count as such too
    conn.after_allocation(seq, [20, 21], 8)  # blocks 1 and 2; block 1 is gone
    conn.fetcher.submit(lambda: None).result()
    assert conn.finished_loads() == {"b": 0}
    assert pool.writes == []
    assert (stats.hit_tokens, stats.handoff_tokens, stats.failed_blocks) == (0, 0, 2)
    seq = request(13, 0, "c")
    seq.handoff = Handoff([], 0, chain)
    conn.after_allocation(seq, [20, 21, 22], 12)
    conn.fetcher.submit(lambda: None).result()
    assert conn.finished_loads() == {"c": 4}
    assert pool.writes == [([20], [7.0])]
    assert (stats.loads, stats.hit_tokens, stats.handoff_tokens) == (2, 4, 4)
    assert (stats.failed_blocks, stats.loaded_bytes) == (2 + 2, PAYLOAD)


def test_loading_pays_only_when_strictly_cheaper_than_computing() -> None:
    cost = sc.TransferCost(compute_seconds_per_token=1.0, load_seconds_per_block=4.0)
    assert not cost.load_pays(2, 4)  # 8 s either way: compute
    assert sc.TransferCost(1.0, 3.5).load_pays(2, 4)
    assert sc.TransferCost(1.0, 100.0, always=True).load_pays(2, 4)
    cost.observe_load(0, 5.0)  # nothing loaded: nothing learned
    assert cost.load_seconds_per_block == 4.0


def test_a_lookup_that_does_not_pay_counts_the_tokens_skipped(parts) -> None:
    conn, _, _, stats = parts
    conn.request_finished(request(13, 13), [7, 3, 9, 5])
    conn.cost.load_seconds_per_block = BS * 0.5  # as dear as computing a block
    assert conn.num_external_tokens(request(11, 0, "b"), 0) == (0, False)
    assert stats.skipped_tokens == 8
    seq = request(11, 0, "c")
    seq.handoff = Handoff([], 0, [])  # a handed-on request loads whatever it costs
    assert conn.num_external_tokens(seq, 0) == (8, True)
    assert stats.skipped_tokens == 8


def test_the_stored_entry_is_its_header_and_the_blocks_bytes(parts) -> None:
    conn, _, store, _ = parts
    conn.request_finished(request(5, 5), [7, 3])
    [key] = conn.chain(request(5, 5), 1)
    assert store.path(key).stat().st_size == HEADER.size + PAYLOAD
