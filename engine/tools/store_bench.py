"""`python -m engine.tools.store_bench [--redis URL]`: how fast the KV cache
store moves bytes, put and get, in MB/s.

Two entry sizes: one KV block of deepinfer-tiny (every layer's keys and values
for one block of tokens, as the engine's own pool sizes it), which is what the
connector stores, and 1 MiB, a block of a larger model. Each store gets about
``--total-mib`` of entries of each size, written once and then read back once
in the same order; every read is verified, and counted in the row's hits.

The disk store runs in a temporary directory, so its reads come from the page
cache (as a hot store's do), not from the device. Redis runs at ``--redis``,
or, without it, on a redis-server of the bench's own when one is installed
(engine/tools/redis_server.py), over loopback. The figures are this machine's,
under whatever else it runs: measure on a quiet machine. No test asserts them.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.kv.store import DiskStore, KVStore, RedisStore
from engine.tools.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "snippets" / "models" / "deepinfer-tiny"
MIB = 1 << 20


@dataclass(frozen=True)
class Row:
    store: str  # "disk" or "redis"
    entry_bytes: int
    entries: int
    hits: int  # reads that came back verified (all of them, unless evicted)
    put_mb_s: float
    get_mb_s: float


def tiny_block_bytes() -> int:
    """One block of deepinfer-tiny's KV cache, every layer, as its pool allocates it."""
    from engine.llm import LLM  # torch: only when the size is not given

    llm = LLM(str(TINY), num_kv_blocks=1)
    return llm.llm_engine.executor.model_runner.kv_cache.block_bytes()


def measure(name: str, store: KVStore, entry_bytes: int, total_bytes: int) -> Row:
    """Put ``total_bytes`` in entries of ``entry_bytes``, then get them back."""
    count = max(4, total_bytes // entry_bytes)
    base = random.Random(entry_bytes).randbytes(entry_bytes)
    keys = [hashlib.sha256(b"%d/%d" % (entry_bytes, i)).digest() for i in range(count)]
    values = [i.to_bytes(8, "little") + base[8:] for i in range(count)]  # distinct entries
    start = time.perf_counter()
    for k, v in zip(keys, values):
        store.put(k, v)
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    got = [store.get(k) for k in keys]
    get_s = time.perf_counter() - start
    hits = sum(g == v for g, v in zip(got, values))
    for k in keys:
        store.evict(k)
    moved = count * entry_bytes / 1e6
    return Row(name, entry_bytes, count, hits, moved / put_s, moved / get_s)


@contextmanager
def stores(
    redis_url: str | None, total_bytes: int, want_redis: bool
) -> Iterator[list[tuple[str, KVStore]]]:
    """(name, store) for the disk store in a temporary directory and, when asked
    and reachable, Redis (at ``redis_url``, or a server of the bench's own);
    each with room for one size's entries, so that none is evicted."""
    room = 2 * max(total_bytes, 4 * MIB) + MIB  # at least four entries of 1 MiB
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="store-bench-"))
        opened: list[tuple[str, KVStore]] = [("disk", DiskStore(tmp, room))]
        if want_redis and redis_url is None and shutil.which("redis-server"):
            memory = f"{(room + 64 * MIB) // MIB}mb"
            redis_url = stack.enter_context(RedisServer(maxmemory=memory)).url
        if want_redis and redis_url is not None:
            opened.append(("redis", RedisStore(redis_url)))
        yield opened
        for _, store in opened:
            store.close()


def table(rows: list[Row]) -> list[str]:
    lines = [f"{'store':7}{'entry':>10}{'entries':>9}{'hits':>7}{'put MB/s':>10}{'get MB/s':>10}"]
    for r in rows:
        size = f"{r.entry_bytes / 1024:.0f} KiB"
        lines.append(
            f"{r.store:7}{size:>10}{r.entries:>9}{r.hits:>7}{r.put_mb_s:>10.0f}{r.get_mb_s:>10.0f}"
        )
    return lines


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.store_bench")
    parser.add_argument("--redis", metavar="URL", help="a Redis server to measure")
    parser.add_argument("--no-redis", action="store_true", help="measure the disk store only")
    parser.add_argument("--total-mib", type=float, default=64.0, help="per store and size")
    parser.add_argument("--block-bytes", type=int, help="the small entry (default: tiny's block)")
    args = parser.parse_args(argv)
    total = int(args.total_mib * MIB)
    sizes = [args.block_bytes or tiny_block_bytes(), MIB]
    with stores(args.redis, total, not args.no_redis) as opened:
        rows = [measure(name, store, size, total) for name, store in opened for size in sizes]
    for line in table(rows):
        print(line)
    return rows


if __name__ == "__main__":
    main()
