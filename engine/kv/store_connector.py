"""A KV connector over a cache store (Chapter 8): blocks computed by any engine
that shares the store can be loaded here instead of recomputed.

It is the second tier of the prefix cache. When the scheduler admits a
request, the connector looks up the request's full blocks past the local hits,
by the same hash chain the prefix cache files them under, and offers the
leading run the store holds. A request handed on by a prefill worker always
loads them; any other loads them only when loading is estimated to be cheaper
than computing them (TransferCost, from what this engine measured).

Blocks are fetched and checked in a background thread while the request waits
in WAITING_FOR_KV and the others keep stepping; they are written into the pool
between steps (``finished_loads``). A block that is missing, corrupt or holds other tokens
ends the load there: the tokens from it on are computed, as if never found.
When a request finishes, its full computed blocks that the store lacks are copied
out of the pool and saved: at once on a prefill worker, whose reply must not
go out before them, and in a background thread elsewhere, so that no step
waits for the store's writes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence as TokenList
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.kv.block_codec import BlockLayout, concat, decode_block, encode_block, layout_of
from engine.kv.hashing import chain_hash
from engine.kv.kv_cache import KVBlocks
from engine.stats import KVTransferRecord, KVTransferStats

if TYPE_CHECKING:
    from engine.kv.store.base import KVStore, StoreStats
    from engine.sequence import Sequence


class BlockIO(Protocol):
    """Where the blocks live: the pool, through the executor."""

    def read_kv_blocks(self, block_ids: list[int]) -> KVBlocks: ...

    def write_kv_blocks(self, block_ids: list[int], data: KVBlocks) -> None: ...


RECORDS_KEPT = 4096
# Bytes of finished requests' blocks copied out and waiting for a background
# save; a save past this is dropped (counted): the store is a cache, and a lost
# entry is only a later miss, while a queue without bound would be a leak.
MAX_PENDING_SAVE_BYTES = 256 << 20


@dataclass
class TransferCost:
    """Seconds to compute a prompt token here, and to load a block from the store:
    measured at start-up, the load side then kept up to date by real loads."""

    compute_seconds_per_token: float
    load_seconds_per_block: float
    always: bool = False  # load whatever the costs say (kv_store_load="always")

    def load_pays(self, num_blocks: int, block_size: int) -> bool:
        if self.always:
            return True
        load = num_blocks * self.load_seconds_per_block
        return load < num_blocks * block_size * self.compute_seconds_per_token

    def observe_load(self, num_blocks: int, seconds: float) -> None:
        if num_blocks:  # a running mean, weighted toward the recent
            self.load_seconds_per_block += 0.2 * (
                seconds / num_blocks - self.load_seconds_per_block
            )


@dataclass
class Load:
    seq: Sequence
    block_ids: list[int]
    future: Future[tuple[list[KVBlocks], int]]
    started: float


def block_chain(root: bytes, token_ids: TokenList[int], block_size: int, n: int) -> list[bytes]:
    """The hash chain of the first ``n`` full blocks of ``token_ids``."""
    chain, parent = [], root
    for i in range(n):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        chain.append(parent)
    return chain


class StoreConnector:
    def __init__(
        self,
        store: KVStore,
        io: BlockIO,
        layout: BlockLayout,
        block_size: int,
        root: bytes,
        cost: TransferCost,
        stats: KVTransferStats,
        background_saves: bool = True,
    ) -> None:
        self.store, self.io, self.layout = store, io, layout
        self.block_size, self.root = block_size, root
        self.cost, self.stats = cost, stats
        self.loads: dict[str, Load] = {}  # request id -> its load in flight
        # None: save in the step (a prefill worker); else the thread that saves
        self.saver = ThreadPoolExecutor(1, "kv-store-save") if background_saves else None
        self.pending_bytes = 0  # what the background saves not yet done hold
        self.saves_lock = threading.Lock()  # the saving thread ends saves
        # Each request's load and save, until the front end takes them (bounded,
        # so an offline engine that never takes them keeps only the latest).
        self.records: deque[KVTransferRecord] = deque(maxlen=RECORDS_KEPT)
        self.fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-store")

    def chain(self, seq: Sequence, n: int) -> list[bytes]:
        return block_chain(self.root, seq.token_ids, self.block_size, n)

    def num_external_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """The store's run of ``seq``'s full blocks after the local hits, if
        loading them pays (always, for a request a prefill worker handed on)."""
        bs = self.block_size
        first, last = num_computed_tokens // bs, (seq.num_tokens - 1) // bs
        if last <= first:
            return 0, False
        found = self.store.contains(self.chain(seq, last)[first:])
        if found and seq.handoff is None and not self.cost.load_pays(found, bs):
            self.stats.skipped_tokens += found * bs
            return 0, False
        return found * bs, True

    def after_allocation(
        self, seq: Sequence, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Fetch the blocks in the background; ``finished_loads`` writes them in."""
        first = seq.num_computed_tokens // self.block_size
        keys = self.chain(seq, first + len(block_ids))[first:]
        bs = self.block_size
        tokens = [seq.token_ids[(first + i) * bs : (first + i + 1) * bs] for i in range(len(keys))]
        future = self.fetcher.submit(self._fetch, keys, tokens)
        self.stats.loads += 1
        self.loads[seq.request_id] = Load(seq, list(block_ids), future, time.perf_counter())

    def _fetch(self, keys: list[bytes], tokens: list[list[int]]) -> tuple[list[KVBlocks], int]:
        """The blocks the store holds for ``keys``, checked, up to the first that
        is missing (evicted since the lookup), corrupt, or holds other tokens;
        and the bytes they came in."""
        found, nbytes = [], 0
        for key, want in zip(keys, tokens):
            payload = self.store.get(key)  # None if missing or its checksum fails
            block = decode_block(payload, self.layout) if payload is not None else None
            if block is None or block[0] != want:
                break
            found.append(block[1])
            nbytes += len(payload)
        return found, nbytes

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a load to finish, if none has."""
        if self.loads and not any(ld.future.done() for ld in self.loads.values()):
            wait([ld.future for ld in self.loads.values()], timeout, "FIRST_COMPLETED")

    def finished_loads(self) -> dict[str, int]:
        """Write the finished loads into the pool: tokens loaded, by request id."""
        done = {rid: ld for rid, ld in self.loads.items() if ld.future.done()}
        loaded = {}
        for rid, ld in done.items():
            del self.loads[rid]
            blocks, nbytes = ld.future.result()
            if blocks:
                self.io.write_kv_blocks(ld.block_ids[: len(blocks)], concat(blocks))
            self.stats.loaded_bytes += nbytes
            loaded[rid] = self._count_load(ld, len(blocks), nbytes)
        return loaded

    def _count_load(self, ld: Load, num_blocks: int, nbytes: int) -> int:
        tokens = num_blocks * self.block_size
        seconds = time.perf_counter() - ld.started
        self.stats.hit_tokens += tokens
        self.stats.handoff_tokens += tokens if ld.seq.handoff is not None else 0
        self.stats.failed_blocks += len(ld.block_ids) - num_blocks
        self.stats.load_seconds += seconds
        recompute = tokens * self.cost.compute_seconds_per_token
        self.stats.recompute_seconds_estimate += recompute
        self.records.append(KVTransferRecord("load", tokens, nbytes, seconds, recompute))
        self.cost.observe_load(num_blocks, seconds)
        return tokens

    def take_records(self) -> list[KVTransferRecord]:
        """The loads and saves since the last call, oldest first (a background save
        may append while this runs: each record is taken once)."""
        taken = []
        while self.records:
            taken.append(self.records.popleft())
        return taken

    def backend_stats(self) -> StoreStats:
        """The store's own counts: hits, misses, corrupt entries, errors."""
        return self.store.stats.snapshot()

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        """Save the full computed blocks the store lacks. They are copied out of
        the pool now, so they can be freed at once (False); a prefill worker also
        writes them now, since its reply must not go out before they are there."""
        n = min(seq.num_computed_tokens, seq.num_tokens - 1) // self.block_size
        chain = self.chain(seq, n)
        have = self.store.contains(chain)
        if have == n:
            return False
        start = time.perf_counter()
        data = self.io.read_kv_blocks(block_ids[have:n])
        bs = self.block_size
        tokens = [seq.token_ids[b * bs : (b + 1) * bs] for b in range(have, n)]
        copied = time.perf_counter() - start
        if self.saver is None:
            self._put(chain[have:], tokens, data, copied)
        else:
            self._put_later(chain[have:], tokens, data, copied)
        return False

    def _put(
        self, keys: list[bytes], tokens: list[list[int]], data: KVBlocks, copied: float
    ) -> None:
        """Encode and store each block; count the save (``copied``: seconds the
        copy out of the pool took)."""
        start, nbytes = time.perf_counter(), 0
        for i, key in enumerate(keys):
            payload = encode_block(tokens[i], data, i)
            self.store.put(key, payload)
            nbytes += len(payload)
        self._count_save(len(keys), nbytes, copied + time.perf_counter() - start)

    def _put_later(
        self, keys: list[bytes], tokens: list[list[int]], data: KVBlocks, copied: float
    ) -> None:
        """``_put`` in the saving thread; dropped, and counted, past the bound."""
        size = data.nbytes()
        with self.saves_lock:
            if self.pending_bytes + size > MAX_PENDING_SAVE_BYTES:
                self.stats.dropped_saves += 1
                return
            self.pending_bytes += size
        future = self.saver.submit(self._put, keys, tokens, data, copied)
        future.add_done_callback(lambda f: self._saved(f, size))

    def _saved(self, future: Future[None], size: int) -> None:
        with self.saves_lock:
            self.pending_bytes -= size
        future.result()  # a save that raised is a bug: let it show

    def saving(self) -> bool:
        """Background saves are still running (every one holds some bytes)."""
        return self.pending_bytes > 0

    def flush(self) -> None:
        """Wait until every background save so far is in the store: the saving
        thread runs them in order, and ends each (``_saved``) before the next."""
        if self.saver is not None:
            self.saver.submit(lambda: None).result()

    def _count_save(self, num_blocks: int, nbytes: int, seconds: float) -> None:
        tokens = num_blocks * self.block_size
        self.stats.saved_bytes += nbytes
        self.stats.saved_blocks += num_blocks
        self.stats.save_seconds += seconds
        recompute = tokens * self.cost.compute_seconds_per_token
        self.records.append(KVTransferRecord("save", tokens, nbytes, seconds, recompute))

    def close(self) -> None:
        """Finish the saves begun, stop the threads, close the store."""
        if self.saver is not None:
            self.saver.shutdown(wait=True)
        self.fetcher.shutdown(wait=True, cancel_futures=True)
        self.store.close()


def make_connector(
    store: KVStore,
    io: BlockIO,
    block_size: int,
    root: bytes,
    stats: KVTransferStats,
    step_seconds: float,
    step_tokens: int,
    always_load: bool = False,
    background_saves: bool = True,
) -> StoreConnector:
    """A connector whose costs start from what this engine measured: a forward
    pass of ``step_tokens`` tokens took ``step_seconds``, and loading one block
    (timed now, with a probe entry of a block's size, filed under a key no chain
    can produce) takes what it takes."""
    probe_blocks = io.read_kv_blocks([0])
    layout = layout_of(probe_blocks)
    payload = encode_block([0] * block_size, probe_blocks, 0)
    key = chain_hash(root, [-1])  # token -1 is in no prompt
    store.put(key, payload)
    start = time.perf_counter()
    store.get(key)
    load = time.perf_counter() - start
    store.evict(key)
    cost = TransferCost(step_seconds / step_tokens, load, always_load)
    return StoreConnector(store, io, layout, block_size, root, cost, stats, background_saves)
