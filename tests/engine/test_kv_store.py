"""The KV cache store (engine/kv/store/): bytes in, bytes out, for both backends.

A store is only a cache, so what matters is that it never hands back a wrong
value and never raises for its backend: a missing, truncated, corrupt or
misplaced entry is a counted miss and is gone after; a Redis that stops mid-run
is a counted error until it is back. The disk store must also stay whole under
concurrent writer and reader processes, within its size bound, evicting the
least recently used entries first.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import random
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from engine.kv.store import DiskStore, KVStore, RedisStore, StoreStats, frame, open_store, unframe
from engine.kv.store.entry import HEADER
from engine.kv.store.redis_store import PREFIX, without_password
from engine.tools import store_bench
from engine.tools.launch import free_port
from engine.tools.redis_server import RedisServer

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event


def key(i: int | str) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def value_of(k: bytes, largest: int = 16384) -> bytes:
    """A value that is a function of its key, of a size between 1 and ``largest``."""
    rng = random.Random(k)
    return rng.randbytes(rng.randrange(1, largest + 1))


class Raw:
    """A backend's stored bytes, reached around the store, to damage them."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        if isinstance(store, RedisStore):
            self.client = redis.Redis.from_url(store.describe)

    def get(self, k: bytes) -> bytes:
        if isinstance(self.store, DiskStore):
            return self.store.path(k).read_bytes()
        return self.client.get(PREFIX + k.hex().encode())

    def set(self, k: bytes, data: bytes) -> None:
        if isinstance(self.store, DiskStore):
            self.store.path(k).parent.mkdir(exist_ok=True)
            self.store.path(k).write_bytes(data)
        else:
            self.client.set(PREFIX + k.hex().encode(), data)

    def delete(self, k: bytes) -> None:
        if isinstance(self.store, DiskStore):
            self.store.path(k).unlink()
        else:
            self.client.delete(PREFIX + k.hex().encode())


@pytest.fixture(params=["disk", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStore]:
    if request.param == "disk":
        opened: KVStore = DiskStore(tmp_path / "store", max_bytes=1 << 24)
    else:
        opened = RedisStore(request.getfixturevalue("redis_server").url)
    yield opened
    opened.close()


def test_a_frame_holds_its_value_for_its_key_only() -> None:
    a, b = key(0), key(1)
    data = frame(a, b"kv block")
    assert len(data) == HEADER.size + len(b"kv block") and HEADER.size == 32
    assert unframe(a, data) == b"kv block"
    assert unframe(a, frame(a, b"")) == b""
    assert unframe(b, data) is None  # another key's entry
    assert unframe(a, data[:-1]) is None and unframe(a, data + b"x") is None
    assert unframe(a, data[:10]) is None
    newer = bytearray(data)
    newer[4] += 1  # the version
    assert unframe(a, bytes(newer)) is None


def test_round_trip_contains_and_evict(store: KVStore) -> None:
    keys = [key(i) for i in range(3)]
    for k in keys:
        store.put(k, value_of(k))
    store.put(key("empty"), b"")
    assert [store.get(k) for k in keys] == [value_of(k) for k in keys]
    assert store.get(key("empty")) == b""
    store.put(keys[0], b"replaced")
    assert store.get(keys[0]) == b"replaced"
    absent = key("absent")
    assert store.contains(keys) == 3
    assert store.contains([keys[0], absent, keys[2]]) == 1  # leading keys only
    assert store.contains([absent, *keys]) == 0 and store.contains([]) == 0
    store.evict(keys[1])
    store.evict(absent)  # nothing there: no error, no eviction counted
    assert store.get(keys[1]) is None
    assert store.contains(keys) == 1
    moved = sum(len(value_of(k)) for k in keys) + len(b"replaced")  # each read once
    s = store.stats
    assert (s.hits, s.misses, s.corrupt, s.errors, s.evictions) == (5, 1, 0, 0, 1)
    assert (s.bytes_written, s.bytes_read) == (moved, moved)
    assert s.read_seconds > 0 and s.write_seconds > 0


def flip(data: bytes) -> bytes:
    middle = bytearray(data)
    middle[len(data) // 2] ^= 0x40
    return bytes(middle)


DAMAGE: dict[str, Callable[[Raw, bytes], None]] = {
    "flipped byte": lambda raw, k: raw.set(k, flip(raw.get(k))),
    "truncated": lambda raw, k: raw.set(k, raw.get(k)[:-7]),
    "header only": lambda raw, k: raw.set(k, raw.get(k)[: HEADER.size]),
    "garbage": lambda raw, k: raw.set(k, b"not an entry"),
    "another key's entry": lambda raw, k: raw.set(k, raw.get(key("other"))),
    "deleted": lambda raw, k: raw.delete(k),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_a_counted_miss_and_is_gone_after(store: KVStore, damage: str) -> None:
    k = key("victim")
    store.put(k, value_of(k))
    store.put(key("other"), value_of(key("other")))
    DAMAGE[damage](Raw(store), k)
    assert store.get(k) is None
    expected = StoreStats(misses=1) if damage == "deleted" else StoreStats(corrupt=1)
    s = store.stats
    assert (s.hits, s.misses, s.corrupt, s.errors) == (0, expected.misses, expected.corrupt, 0)
    assert store.contains([k]) == 0  # removed, not left to fail again
    assert store.get(k) is None and store.stats.misses == expected.misses + 1
    assert store.get(key("other")) == value_of(key("other"))  # the neighbour is untouched
    store.put(k, value_of(k))  # and the key can be stored again
    assert store.get(k) == value_of(k)


def on_disk(root: Path) -> list[Path]:
    return [p for p in root.glob("??/*") if not p.name.startswith(".")]


def test_the_least_recently_read_entries_go_first(tmp_path: Path) -> None:
    """Bound of three entries: a fourth evicts down to nine tenths of the bound,
    so two go, the least recently used; A, read since it was written, stays."""
    size = 1000
    bound = 3 * (HEADER.size + size) + 10
    for read_first in (True, False):
        store = DiskStore(tmp_path / f"read_{read_first}", max_bytes=bound)
        a, b, c, d = (key(x) for x in "abcd")
        for k in (a, b, c):
            store.put(k, k * (size // 32) + k[: size % 32])
        if read_first:
            assert store.get(a) is not None
        store.put(d, bytes(size))
        present = {name for name, k in zip("abcd", (a, b, c, d)) if store.contains([k])}
        assert present == ({"a", "d"} if read_first else {"c", "d"})
        assert store.stats.evictions == 2
        assert sum(p.stat().st_size for p in on_disk(store.root)) <= bound


def test_a_value_larger_than_the_bound_is_not_stored(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "small", max_bytes=4096)
    store.put(key(0), bytes(100))
    store.put(key(1), bytes(5000))
    assert store.contains([key(0), key(1)]) == 1  # the small one was not evicted for it
    assert store.stats.bytes_written == 100 and store.stats.errors == 0


def test_the_bound_is_shared_by_stores_on_one_directory(tmp_path: Path) -> None:
    """Two stores (as two processes would open it) fill one directory: the
    total they share, not each one's own writes, is held to the bound."""
    bound = 20_000
    first = DiskStore(tmp_path / "shared", bound)
    second = DiskStore(tmp_path / "shared", bound)
    for i in range(60):
        (first if i % 2 else second).put(key(i), value_of(key(i), 2000))
        assert sum(p.stat().st_size for p in on_disk(tmp_path / "shared")) <= bound
    reopened = DiskStore(tmp_path / "shared", bound)  # and a later process sees it whole
    assert all(reopened.get(key(i)) in (None, value_of(key(i), 2000)) for i in range(60))
    assert reopened.stats.corrupt == 0 and reopened.stats.hits > 0


# The disk store under four writer and four reader processes: every value a
# reader gets must be exactly its key's value, with the bound held at the end.
POOL = 48  # keys
PUTS, GETS = 150, 300  # per writer, per reader
MP_BOUND = 16 * 8192  # about a third of the pool's values at once, so eviction runs


def writer(root: str, seed: int, start: Event, out: Queue) -> None:
    store = DiskStore(root, MP_BOUND)
    rng = random.Random(seed)
    start.wait()
    for _ in range(PUTS):
        k = key(rng.randrange(POOL))
        store.put(k, value_of(k))
    out.put(("writer", store.stats, 0))


def reader(root: str, seed: int, start: Event, out: Queue) -> None:
    store = DiskStore(root, MP_BOUND)
    rng = random.Random(seed)
    start.wait()
    wrong = 0
    for _ in range(GETS):
        k = key(rng.randrange(POOL))
        got = store.get(k)
        wrong += got is not None and got != value_of(k)
    out.put(("reader", store.stats, wrong))


def test_four_writers_and_four_readers_share_one_directory(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    DiskStore(root, MP_BOUND)
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=writer, args=(root, i, start, out)) for i in range(4)]
    procs += [ctx.Process(target=reader, args=(root, 10 + i, start, out)) for i in range(4)]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    written = [s for role, s, _ in results if role == "writer"]
    read = [(s, wrong) for role, s, wrong in results if role == "reader"]
    assert sum(wrong for _, wrong in read) == 0  # no torn or wrong value
    assert all(s.corrupt == 0 and s.errors == 0 for s, _ in read)
    assert all(s.errors == 0 and s.write_seconds > 0 for s in written)
    assert sum(s.hits for s, _ in read) > 0 and sum(s.misses for s, _ in read) > 0
    assert sum(s.bytes_written for s in written) > 2 * MP_BOUND
    assert sum(s.evictions for s in written) > 0
    files = on_disk(Path(root))
    assert sum(p.stat().st_size for p in files) <= MP_BOUND + HEADER.size + 16384
    assert not list(Path(root).glob("??/.tmp-*"))  # no temporary file left behind
    check = DiskStore(root, MP_BOUND)  # every entry left is whole, and its key's
    for p in files:
        k = bytes.fromhex(p.name)
        assert check.get(k) == value_of(k)
    assert check.stats.hits == len(files)


def test_two_threads_share_one_store(store: KVStore) -> None:
    """The connector loads in a background thread while the engine stores."""
    rounds = 60

    def work(thread: int) -> None:
        for i in range(rounds):
            k = key(f"{thread}/{i}")
            store.put(k, value_of(k, 4096))
            assert store.get(k) == value_of(k, 4096)
            assert store.get(key(f"{thread}/absent/{i}")) is None

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = store.stats.snapshot()
    assert (s.hits, s.misses, s.corrupt, s.errors) == (2 * rounds, 2 * rounds, 0, 0)
    assert (
        s.bytes_read
        == s.bytes_written
        == sum(len(value_of(key(f"{t}/{i}"), 4096)) for t in range(2) for i in range(rounds))
    )


def test_an_unreachable_redis_url_fails_at_construction_naming_it() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with pytest.raises(ValueError, match=re.escape(f"cannot reach the KV store at {url}: ")):
        open_store(url)
    with pytest.raises(ValueError) as err:
        RedisStore(f"redis://:hunter2@127.0.0.1:{free_port()}/0")
    assert ":***@127.0.0.1" in str(err.value) and "hunter2" not in str(err.value)
    assert without_password("redis://u:p@h:1/2") == "redis://u:***@h:1/2"


def test_an_unwritable_directory_fails_at_construction_naming_it(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("a file, so nothing can be made under it, even by root")
    path = tmp_path / "afile" / "store"
    with pytest.raises(ValueError, match=re.escape(f"KV store directory {path} cannot be")):
        open_store(str(path))
    with pytest.raises(ValueError, match="max_bytes"):
        DiskStore(tmp_path / "fine", max_bytes=0)
    with pytest.raises(ValueError, match="spec is empty"):
        open_store("")


def test_open_store_picks_the_backend_from_the_spec(tmp_path: Path, redis_server) -> None:
    shared = open_store(redis_server.url)
    assert isinstance(shared, RedisStore) and shared.describe == redis_server.url
    shared.close()
    on_path = open_store(f"file://{tmp_path}/a", max_bytes=123)
    assert isinstance(on_path, DiskStore) and on_path.root == tmp_path / "a"
    assert on_path.max_bytes == 123 and on_path.describe == f"disk:{tmp_path}/a"
    assert open_store(str(tmp_path / "b")).max_bytes == 1 << 30


def test_a_redis_that_stops_mid_run_is_counted_and_served_again(
    redis_server: RedisServer,
) -> None:
    store = RedisStore(redis_server.url)
    a, b = key("a"), key("b")
    store.put(a, b"before")
    assert store.get(a) == b"before"
    redis_server.stop()
    assert store.get(a) is None
    store.put(b, b"lost")  # no raise
    assert store.contains([a, b]) == 0
    store.evict(a)
    assert store.stats.errors == 4 and store.stats.hits == 1
    assert store.stats.bytes_written == len(b"before")  # the lost put stored nothing
    redis_server.start()  # same port, empty: it persists nothing
    assert store.get(a) is None and store.stats.misses == 1
    store.put(b, b"after")
    assert store.get(b) == b"after" and store.contains([b]) == 1
    assert store.stats.errors == 4
    store.close()


def test_the_benchmark_prints_a_row_per_store_and_size(redis_server: RedisServer) -> None:
    text = io.StringIO()
    with redirect_stdout(text):
        rows = store_bench.main(
            ["--total-mib", "0.0625", "--block-bytes", "4096", "--redis", redis_server.url]
        )
    assert [(r.store, r.entry_bytes) for r in rows] == [
        ("disk", 4096),
        ("disk", 1 << 20),
        ("redis", 4096),
        ("redis", 1 << 20),
    ]
    assert all(r.hits == r.entries and r.put_mb_s > 0 and r.get_mb_s > 0 for r in rows)
    assert [line.split()[0] for line in text.getvalue().splitlines()[-4:]] == [
        "disk",
        "disk",
        "redis",
        "redis",
    ]
