"""The disk store's books, to the byte: the shared total in ``.size`` after
every kind of change, the exact number of entries an eviction removes (down to
nine tenths of the bound, not one byte further), each outcome's counter, the
seconds counted from the store's own clock, the files a scan counts and the
ones it leaves alone, and the entry header's exact bytes; and what a hung Redis
costs. test_kv_store.py checks the store's behaviour; these pin the numbers
/metrics and the next process read (tests/mutation_survivors.md lists what
mutation testing left)."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import tempfile
import time
from pathlib import Path

import pytest

from engine.kv.store import DiskStore, RedisStore, StoreStats, frame, open_store, redis_store
from engine.kv.store import disk as disk_module
from engine.kv.store.entry import HEADER, MAGIC, VERSION, checksum
from engine.kv.store.redis_store import without_password


def key(i: int | str) -> bytes:
    return hashlib.sha256(f"exact {i}".encode()).digest()


def total(store: DiskStore) -> int:
    """The shared running total, as the next process reads it."""
    text = (store.root / ".size").read_text()
    assert text.isdigit(), text
    return int(text)


def entry(n: int) -> bytes:
    """A value whose stored entry is ``n`` bytes."""
    return bytes(n - HEADER.size)


def stored(store: DiskStore) -> list[str]:
    return sorted(p.name[:6] for p in store.root.glob("??/*") if not p.name.startswith("."))


@pytest.fixture
def scans(monkeypatch) -> list[int]:
    """Each directory scan the store makes, counted."""
    calls: list[int] = []
    entries = disk_module._entries

    def counted(root: Path):
        calls.append(1)
        return entries(root)

    monkeypatch.setattr(disk_module, "_entries", counted)
    return calls


def test_stats_add_up_each_call() -> None:
    s = StoreStats()
    s.read("miss", 0.25)
    s.read("corrupt", 0.5)
    s.read("corrupt", 0.25)
    s.read("hit", 1.0, 7)
    s.read("error", 0.0)
    s.wrote(5, 0.5)
    s.wrote(9, 0.25, failed=True)
    s.wrote(3, 0.25)
    s.add(errors=1)
    s.add(evictions=2)
    assert (s.hits, s.misses, s.corrupt, s.errors, s.evictions) == (1, 1, 2, 3, 2)
    assert (s.bytes_read, s.bytes_written) == (7, 8)
    assert (s.read_seconds, s.write_seconds) == (2.0, 1.0)


def test_the_total_is_exact_after_puts_replacements_and_evictions(tmp_path, scans) -> None:
    store = DiskStore(tmp_path / "a" / "b", 10_000)  # parents made too
    assert total(store) == 0 and len(scans) == 1  # opening counts once
    store.put(key(1), entry(100))
    store.put(key(2), entry(60))
    assert total(store) == 160
    store.put(key(1), entry(40))  # replaced: its old 100 bytes no longer count
    assert total(store) == 100
    store.evict(key(2))
    store.evict(key(2))  # already gone: nothing counted
    assert total(store) == 40 and store.stats.evictions == 1
    assert store.stats.bytes_written == 100 + 60 + 40 - 3 * HEADER.size
    assert len(scans) == 1  # under the bound, no put scans the directory


def test_an_entry_exactly_the_bound_is_stored_and_no_scan_runs_at_the_bound(
    tmp_path, scans
) -> None:
    store = DiskStore(tmp_path, 200)
    store.put(key(1), entry(201))  # would evict itself: not stored, not an error
    assert store.stats.bytes_written == 0 and store.stats.errors == 0
    store.put(key(1), entry(200))
    assert store.get(key(1)) == entry(200) and total(store) == 200
    assert len(scans) == 1 and store.stats.evictions == 0


def test_a_store_opened_again_recounts_and_keeps_a_store_exactly_full(tmp_path) -> None:
    store = DiskStore(tmp_path, 120)
    for i in range(3):
        store.put(key(i), entry(40))
    (store.root / ".size").write_text("7")  # a crashed writer's count
    again = DiskStore(tmp_path, 120)
    assert total(again) == 120 and again.stats.evictions == 0 and len(stored(again)) == 3


@pytest.mark.parametrize(
    "first,middle,evicted",
    [
        # 80 + 325 = 405, the bound; a put of 40 takes it to 445: evicting the two
        # oldest leaves 365, exactly the bound less a tenth (405 // 10 = 40): stop.
        ([40, 40], [65] * 5, 2),
        # 44 + 327 = 371; a put of 40: 411. Evicting 44 leaves 367, one of 109 more: 258.
        ([44], [109] * 3, 2),
        # Oldest first, not smallest first: the oldest is the largest here, and
        # the entries are written within one tick of the kernel's coarse clock.
        ([100, 90], [50] * 4, 1),
    ],
)
def test_eviction_stops_at_exactly_nine_tenths_of_the_bound(
    tmp_path, first, middle, evicted
) -> None:
    store = DiskStore(tmp_path, 405)
    sizes = [*first, *middle]
    for i, n in enumerate(sizes):
        store.put(key(i), entry(n))
    assert total(store) == sum(sizes) and store.stats.evictions == 0
    store.put(key("new"), entry(40))
    assert store.stats.evictions == evicted
    left = sum(sizes[evicted:]) + 40
    assert total(store) == left
    assert len(stored(store)) == len(sizes) - evicted + 1
    assert all(store.get(key(i)) is None for i in range(evicted))  # the oldest went


def test_the_bound_must_be_a_positive_byte_count(tmp_path) -> None:
    assert DiskStore(tmp_path, 1).max_bytes == 1
    with pytest.raises(ValueError, match="max_bytes must be at least 1, got 0"):
        DiskStore(tmp_path, 0)
    with pytest.raises(ValueError, match="^the KV store spec is empty: give a directory or a redis:// URL$"):  # fmt: skip
        open_store("")


def test_a_failed_read_a_failed_write_and_a_failed_eviction_are_errors(tmp_path) -> None:
    store = DiskStore(tmp_path, 10_000)
    k = key(1)
    store.path(k).mkdir(parents=True)  # the entry's name is a directory: reads fail
    assert store.get(k) is None
    assert (store.stats.errors, store.stats.misses, store.stats.corrupt) == (1, 0, 0)
    store.evict(k)  # cannot be removed: an error, not an eviction
    assert (store.stats.errors, store.stats.evictions) == (2, 0)
    blocked = key(2)
    (store.root / blocked.hex()[:2]).write_bytes(b"")  # its fan-out directory is a file
    store.put(blocked, entry(50))
    assert (store.stats.errors, store.stats.bytes_written) == (3, 0)


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    store = DiskStore(tmp_path, 10_000)

    def refuse(src, dst) -> None:
        raise OSError("no")

    monkeypatch.setattr(disk_module.os, "replace", refuse)
    store.put(key(1), entry(50))
    monkeypatch.undo()
    assert store.stats.errors == 1 and store.stats.bytes_written == 0
    assert list(store.root.glob("??/*")) == [] and total(store) == 0


def test_a_writer_writes_beside_the_entry_under_a_temporary_name(tmp_path, monkeypatch) -> None:
    made: list[tuple[object, object]] = []
    mkstemp = tempfile.mkstemp

    def spy(*, dir=None, prefix=None):
        made.append((dir, prefix))
        return mkstemp(dir=dir, prefix=prefix)

    store = DiskStore(tmp_path, 10_000)
    monkeypatch.setattr(disk_module.tempfile, "mkstemp", spy)
    store.put(key(1), entry(50))
    assert made == [(store.path(key(1)).parent, ".tmp-")]


def test_a_hit_whose_file_goes_before_its_touch_is_still_a_hit(tmp_path, monkeypatch) -> None:
    store = DiskStore(tmp_path, 10_000)
    store.put(key(1), entry(50))

    def gone(*args, **kwargs) -> None:
        raise FileNotFoundError

    monkeypatch.setattr(disk_module.os, "utime", gone)
    assert store.get(key(1)) == entry(50)
    assert (store.stats.hits, store.stats.bytes_read) == (1, 50 - HEADER.size)


class Ticks:
    """A perf_counter that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)


def test_seconds_come_from_the_store_clock(tmp_path, monkeypatch) -> None:
    store = DiskStore(tmp_path, 10_000)
    monkeypatch.setattr(disk_module, "time", Ticks())
    store.put(key(1), entry(50))
    store.get(key(1))
    store.get(key(2))
    assert (store.stats.write_seconds, store.stats.read_seconds) == (1.0, 2.0)


def test_a_scan_counts_only_the_stores_own_files(tmp_path, monkeypatch) -> None:
    foreign = [tmp_path / "ab", tmp_path / "abc" / "abcdef", tmp_path / "cd" / "cdnotes"]
    foreign[0].write_bytes(b"x" * 300)  # a file named like a fan-out directory
    for path in foreign[1:]:
        path.parent.mkdir()
        path.write_bytes(b"x" * 300)
    link = tmp_path / "ef" / "ef00"  # an entry's name, but a link to a large file
    link.parent.mkdir()
    link.symlink_to(foreign[1])
    stale, fresh = tmp_path / "cd" / ".tmp-old", tmp_path / "cd" / ".tmp-new"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    now = 10**18
    old = now - disk_module.STALE_TEMP_NS - 1
    os.utime(stale, ns=(old, old))
    os.utime(fresh, ns=(now - disk_module.STALE_TEMP_NS,) * 2)  # exactly the age: kept
    monkeypatch.setattr(disk_module.time, "time_ns", lambda: now)
    again = DiskStore(tmp_path, 100)
    monkeypatch.undo()
    assert total(again) == link.lstat().st_size  # the link's own size, not its target's
    assert again.stats.evictions == 0
    assert all(p.exists() for p in foreign) and fresh.exists() and not stale.exists()


def test_the_entry_header_is_exactly_its_documented_bytes() -> None:
    k, v = key(1), b"value"
    data = frame(k, v)
    assert data[HEADER.size :] == v and len(data) == 32 + 5
    assert HEADER.unpack(data[:32]) == (MAGIC, VERSION, 0, 5, checksum(k, v))
    assert data[:8] == b"DIKV\x01\x00\x00\x00"


# ---------------------------------------------------------------- Redis's bounds


def silent_server(backlog: int) -> socket.socket:
    """A loopback listener that never accepts: a hung Redis. With its queue full
    (``backlog`` connections already waiting), a connect hangs too."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(backlog)
    return listener


@pytest.mark.parametrize("hangs", ["reading", "connecting"])
def test_a_hung_redis_costs_one_try_and_one_retry_of_timeout_s_each(hangs: str) -> None:
    """The store's docstring: one attempt and one retry, each at most TIMEOUT_S
    (1 s); construction pings, so a hung server fails it after 2 s, not 1 or 3."""
    listener = silent_server(8 if hangs == "reading" else 0)
    port = listener.getsockname()[1]
    waiting = [] if hangs == "reading" else [socket.create_connection(("127.0.0.1", port))]
    url = f"redis://127.0.0.1:{port}/0"
    start = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(f"cannot reach the KV store at {url}: Timeout {hangs}")):  # fmt: skip
        RedisStore(url)
    assert 2.0 <= time.perf_counter() - start < 2.9
    for s in [*waiting, listener]:
        s.close()


def test_redis_seconds_come_from_the_store_clock(redis_server, monkeypatch) -> None:
    store = RedisStore(redis_server.url)
    monkeypatch.setattr(redis_store, "time", Ticks())
    store.put(key(1), entry(50))
    store.get(key(1))
    store.get(key(2))
    s = store.stats
    assert (s.write_seconds, s.read_seconds, s.hits, s.misses) == (1.0, 2.0, 1, 1)
    assert s.bytes_written == s.bytes_read == 50 - HEADER.size
    store.close()


def test_a_redis_url_in_a_log_hides_its_whole_password() -> None:
    assert without_password("redis://h:1/0") == "redis://h:1/0"
    assert without_password("redis://:pw@h:1/0") == "redis://:***@h:1/0"  # no user: none named
    assert without_password("redis://u:p@ss@h:1/2") == "redis://u:***@h:1/2"  # an @ in it too
