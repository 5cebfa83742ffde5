"""The store connector's decisions and counts on constructed requests, to the
block and the byte (kv/store_connector.py): which blocks a save reads out of
the pool (the full computed blocks the store lacks, never the block holding
the newest token), which a load looks up and writes where, when loading is
judged to pay, and every KVTransferStats field and record those moves leave.
A pool of one layer stands in for the engine's; the store is a real DiskStore;
the connector's clock ticks one second per reading."""

from __future__ import annotations

import logging
import threading
import time

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
    conn.after_allocation(request(13, 0, "d"), [20, 21, 22], 12)  # each block with its tokens
    conn.fetcher.submit(lambda: None).result()
    assert conn.finished_loads() == {"d": 12} and stats.failed_blocks == 0


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
    conn.after_allocation(request(11, 0, "c"), [22, 23], 8)  # again: the counts add up
    conn.fetcher.submit(lambda: None).result()
    assert conn.finished_loads() == {"c": 8}
    assert (stats.loads, stats.hit_tokens, stats.loaded_bytes) == (2, 16, 4 * PAYLOAD)
    assert (stats.load_seconds, stats.recompute_seconds_estimate) == (2.0, 8.0)


def test_a_load_stops_at_the_first_block_gone_and_counts_the_rest_failed(parts) -> None:
    conn, pool, store, stats = parts
    conn.request_finished(request(13, 13), [7, 3, 9, 5])
    chain = conn.chain(request(13, 13), 3)
    store.evict(chain[1])
    seq = request(13, 0, "c")
    seq.handoff = Handoff([], 0, chain)  # handed on: its tokens count as such too
    conn.after_allocation(seq, [20, 21, 22], 12)
    conn.fetcher.submit(lambda: None).result()
    assert conn.finished_loads() == {"c": 4}
    assert pool.writes == [([20], [7.0])]
    assert (stats.hit_tokens, stats.handoff_tokens, stats.failed_blocks) == (4, 4, 2)
    seq = request(13, 4, "b")
    seq.handoff = Handoff([], 0, chain)
    conn.after_allocation(seq, [23, 24], 8)  # blocks 1 and 2; block 1 is gone
    conn.fetcher.submit(lambda: None).result()
    assert conn.finished_loads() == {"b": 0}
    assert pool.writes == [([20], [7.0])]
    assert (stats.loads, stats.hit_tokens, stats.handoff_tokens) == (2, 4, 4)
    assert (stats.failed_blocks, stats.loaded_bytes) == (2 + 2, PAYLOAD)
    assert (stats.load_seconds, stats.recompute_seconds_estimate) == (2.0, 4 * 0.5)


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
    assert conn.num_external_tokens(request(9, 4, "b"), 4) == (0, False)
    assert stats.skipped_tokens == 8 + 4
    seq = request(11, 0, "c")
    seq.handoff = Handoff([], 0, [])  # a handed-on request loads whatever it costs
    assert conn.num_external_tokens(seq, 0) == (8, True)
    assert stats.skipped_tokens == 8 + 4


def test_the_stored_entry_is_its_header_and_the_blocks_bytes(parts) -> None:
    conn, _, store, _ = parts
    conn.request_finished(request(5, 5), [7, 3])
    [key] = conn.chain(request(5, 5), 1)
    assert store.path(key).stat().st_size == HEADER.size + PAYLOAD


def background(parts) -> sc.StoreConnector:
    conn, pool, store, stats = parts
    return sc.StoreConnector(store, pool, conn.layout, BS, ROOT, conn.cost, stats)


def test_background_saves_hold_their_bytes_until_done_and_drop_past_the_bound(
    parts, monkeypatch, caplog
) -> None:
    conn = background(parts)
    _, pool, store, stats = parts
    one_save = 2 * 2 * 4  # two blocks of two float32 numbers
    monkeypatch.setattr(sc, "MAX_PENDING_SAVE_BYTES", 2 * one_save)
    held = threading.Event()
    conn.saver.submit(held.wait, 10)  # the saving thread is busy
    assert conn.request_finished(request(9, 9), [7, 3, 9]) is False
    assert conn.pending_bytes == one_save and conn.saving()
    conn.request_finished(request(9, 9, "b"), [7, 3, 9])  # 32 bytes: exactly the bound
    assert conn.pending_bytes == 2 * one_save
    conn.request_finished(request(9, 9, "c"), [7, 3, 9])  # past it: dropped
    conn.request_finished(request(9, 9, "d"), [7, 3, 9])
    assert stats.dropped_saves == 2 and conn.pending_bytes == 2 * one_save
    held.set()
    conn.flush()
    assert conn.pending_bytes == 0 and not conn.saving()
    assert (stats.saved_blocks, stats.saved_bytes, stats.dropped_saves) == (4, 4 * PAYLOAD, 2)
    conn.pending_bytes = 1
    assert conn.saving()  # a byte still waiting is a save still running
    conn.pending_bytes = 0
    conn.close()
    assert pool.reads == [[7, 3]] * 4  # the dropped saves were copied, then not sent
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # each save ended cleanly


def test_wait_returns_at_once_with_no_load_or_a_finished_one(parts, monkeypatch) -> None:
    conn, _, _, _ = parts
    waited: list[tuple] = []
    monkeypatch.setattr(sc, "wait", lambda *args: waited.append(args))
    conn.wait(5.0)  # nothing loading
    conn.request_finished(request(9, 9), [7, 3, 9])
    conn.after_allocation(request(9, 0, "b"), [20, 21], 8)
    conn.fetcher.submit(lambda: None).result()
    conn.wait(5.0)  # its load is done: nothing to wait for
    assert waited == []
    held = threading.Event()
    conn.fetcher.submit(held.wait, 10)
    conn.after_allocation(request(9, 0, "c"), [22, 23], 8)  # behind the held task
    conn.loads.pop("b")
    conn.wait(5.0)
    assert waited == [([conn.loads["c"].future], 5.0, "FIRST_COMPLETED")]
    held.set()


def test_a_new_connector_times_one_probe_load_and_leaves_no_entry(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sc, "time", Ticks())
    pool, store = Pool(), DiskStore(tmp_path, 1 << 20)
    stats = KVTransferStats()
    conn = sc.make_connector(store, pool, BS, ROOT, stats, 2.0, 8, background_saves=False)
    assert pool.reads == [[0]]  # block 0, which every pool has
    assert conn.cost == sc.TransferCost(0.25, 1.0, False)
    assert conn.saver is None and conn.block_size == BS and conn.root == ROOT
    assert conn.io is pool and conn.stats is stats and conn.store is store
    assert conn.layout == layout_of(pool.read_kv_blocks([0]))
    assert (store.stats.bytes_written, store.stats.hits, store.stats.evictions) == (PAYLOAD, 1, 1)
    assert stored_files(tmp_path) == []
    always = sc.make_connector(store, pool, BS, ROOT, KVTransferStats(), 2.0, 8, True)
    assert always.cost.always and always.saver is not None
    conn.close()
    always.close()


def stored_files(root) -> list:
    return [p for p in root.glob("??/*")]


def test_the_probe_key_is_no_chains(tmp_path) -> None:
    """With one-token blocks, token 1's first block is a real entry: the probe
    (token -1) leaves it alone."""
    store = DiskStore(tmp_path, 1 << 20)
    real = sc.chain_hash(ROOT, [1])
    store.put(real, b"kept")
    sc.make_connector(store, Pool(), 1, ROOT, KVTransferStats(), 1.0, 1).close()
    assert store.get(real) == b"kept"


def test_the_threads_are_one_each_named_and_the_records_bounded(parts) -> None:
    conn = background(parts)
    name = threading.current_thread
    assert conn.fetcher.submit(lambda: name().name).result().startswith("kv-store_")
    assert conn.saver.submit(lambda: name().name).result().startswith("kv-store-save_")
    assert conn.fetcher._max_workers == 1 and conn.saver._max_workers == 1  # in order
    assert conn.records.maxlen == sc.RECORDS_KEPT
    conn.close()


def test_close_waits_for_the_saves_begun_and_cancels_the_loads_queued(parts) -> None:
    conn = background(parts)
    _, _, _, stats = parts
    saving, fetching = threading.Event(), threading.Event()
    conn.saver.submit(saving.wait, 10)
    conn.request_finished(request(9, 9), [7, 3, 9])  # queued behind the held task
    running = conn.fetcher.submit(fetching.wait, 10)
    conn.after_allocation(request(9, 0, "b"), [20, 21], 8)
    queued = conn.loads["b"].future

    saved_by_then: list[int] = []

    def release() -> None:
        """The save once close has begun; the fetch once close stops the loads
        (by then the save must be in the store)."""
        for pool, held in ((conn.saver, saving), (conn.fetcher, fetching)):
            while not pool._shutdown:
                time.sleep(0.01)
            saved_by_then.append(stats.saved_blocks)
            held.set()

    releaser = threading.Thread(target=release)
    releaser.start()
    conn.close()  # returns once the save is done and the running fetch ended
    ended = running.done()
    releaser.join()
    assert saved_by_then == [0, 2] and ended and queued.cancelled()
