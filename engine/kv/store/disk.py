"""The default cache store: one file per entry in a local directory, bounded in
size, shared safely by every process on the machine.

An entry lives at ``DIR/ab/abcd...``, named by its key's hex and fanned out by
the first two characters, so no directory grows past a few thousand files. Three
properties make concurrent use safe without a server:

- Atomic writes. A writer writes a uniquely named temporary file in the entry's
  own directory, then renames it over the entry (`os.replace`, atomic within a
  file system). A reader opens either the old file or the new one, never half
  of one; and a file that vanishes (evicted) is a miss, not an error. Nothing
  is fsynced: after a power cut an entry may be lost or torn, and its checksum
  (entry.py) turns that into a miss too.
- A size bound with LRU eviction. A read sets its file's mtime, so mtime orders
  entries by last use. The processes share a running total of the bytes stored
  (the file ``DIR/.size``, changed under an flock); a put that takes it past
  ``max_bytes`` scans the directory and removes the least recently used entries
  until a tenth of the bound is free, so that a full store scans once per tenth
  of its size written, not on every put. The scan also resets the total, which
  a crashed process or a hand-deleted file may have left off.
- A checksum per entry, so that a corrupt, truncated or misplaced file is found
  on read, counted, and removed.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from engine.kv.store.base import Outcome, StoreStats
from engine.kv.store.entry import HEADER, header, unframe

STALE_TEMP_NS = 3600 * 10**9  # a temporary file this old is a crashed writer's
HEX = re.compile(r"[0-9a-f]+")  # the only names a scan counts or evicts


class DiskStore:
    """Entries as files under ``directory``, at most ``max_bytes`` of them in all
    (plus, for a moment, the entries being written)."""

    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self.root = Path(directory)
        self.max_bytes = max_bytes
        self.stats = StoreStats()
        try:  # a probe write: better a clear error now than a miss on every put
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
            self._account(0, rescan=True)
        except OSError as e:
            raise ValueError(
                f"the KV store directory {self.root} cannot be created or written: {e}"
            ) from e

    @property
    def describe(self) -> str:
        return f"disk:{self.root}"

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / name

    def get(self, key: bytes) -> bytes | None:
        start = time.perf_counter()
        outcome, value = self._read(key)
        self.stats.read(outcome, time.perf_counter() - start, len(value or b""))
        return value

    def _read(self, key: bytes) -> tuple[Outcome, bytes | None]:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return "miss", None
        except OSError:
            return "error", None
        value = unframe(key, data)
        if value is None:  # removed, so the next get is a plain miss
            self._discard(path)
            return "corrupt", None
        now = time.time_ns()  # finer than the kernel's own timestamps
        with suppress(OSError):  # evicted since: the value read is still whole
            os.utime(path, ns=(now, now))
        return "hit", value

    def put(self, key: bytes, value: bytes) -> None:
        start = time.perf_counter()
        stored, failed = 0, False
        if HEADER.size + len(value) <= self.max_bytes:  # else it would evict itself
            try:
                self._account(self._write(self.path(key), key, value))
                stored = len(value)
            except OSError:
                failed = True
        self.stats.wrote(stored, time.perf_counter() - start, failed)

    def _write(self, path: Path, key: bytes, value: bytes) -> int:
        """Write the entry beside ``path``, rename it over; the bytes it added."""
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header(key, value))
                f.write(value)
            now = time.time_ns()
            os.utime(tmp, ns=(now, now))
            old = _size(path)
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
        return HEADER.size + len(value) - old

    def contains(self, keys: list[bytes]) -> int:
        present = 0
        for key in keys:
            if not self.path(key).is_file():
                break
            present += 1
        return present

    def evict(self, key: bytes) -> None:
        if self._discard(self.path(key)):
            self.stats.add(evictions=1)

    def close(self) -> None:
        pass  # nothing held open between calls

    def _discard(self, path: Path) -> bool:
        """Remove one entry's file; False if it was already gone (or cannot go)."""
        size = _size(path)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError:
            self.stats.add(errors=1)
            return False
        with suppress(OSError):
            self._account(-size)
        return True

    def _account(self, delta: int, rescan: bool = False) -> None:
        """Add ``delta`` to the shared total; past the bound, evict and recount."""
        with _locked(self.root / ".size") as fd:
            os.lseek(fd, 0, os.SEEK_SET)
            text = os.read(fd, 32)
            total = int(text) + delta if text.isdigit() and not rescan else None
            if total is None or total > self.max_bytes:
                total = self._evict_lru()
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, str(max(total, 0)).encode())

    def _evict_lru(self) -> int:
        """Scan every entry; remove the least recently used until a tenth of
        ``max_bytes`` is free (none if already under the bound); the bytes left."""
        entries = sorted(_entries(self.root))
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return total
        target, evicted = self.max_bytes - self.max_bytes // 10, 0
        for _, size, path in entries:
            if total <= target:
                break
            with suppress(FileNotFoundError):
                os.unlink(path)
                evicted += 1
            total -= size
        self.stats.add(evictions=evicted)
        return total


@contextmanager
def _locked(path: Path) -> Iterator[int]:
    """``path`` opened and flocked: one holder at a time, across processes and
    threads alike (each open is its own lock holder)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _entries(root: Path) -> Iterator[tuple[int, int, str]]:
    """(mtime in ns, size, path) of every entry; stale temporary files removed.
    Only names this store writes count, so a directory shared by mistake keeps
    its other files."""
    now = time.time_ns()
    for sub in os.scandir(root):
        if len(sub.name) != 2 or not HEX.fullmatch(sub.name) or not sub.is_dir():
            continue
        for item in os.scandir(sub.path):
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # renamed over or evicted since the listing
            if HEX.fullmatch(item.name) and item.name.startswith(sub.name):
                yield st.st_mtime_ns, st.st_size, item.path
            elif item.name.startswith(".tmp-") and now - st.st_mtime_ns > STALE_TEMP_NS:
                with suppress(OSError):
                    os.unlink(item.path)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
