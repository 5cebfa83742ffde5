"""One stored entry: a fixed header, then the value, so that a reader can tell
a whole, right entry from anything else.

The header holds a magic number, the format's version, the value's length and a
checksum (blake2b, 16 bytes) over the key and the value. The length catches a
truncated entry; the checksum, a corrupt one; and because the key is in it, an
entry stored under the wrong key (a copied file, a misplaced write) fails too.
Either way `unframe` returns None and the store treats the entry as gone.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"DIKV"
VERSION = 1
# magic, version, a reserved half-word, value length, checksum: 32 bytes.
HEADER = struct.Struct("<4sHHQ16s")


def checksum(key: bytes, value: bytes | memoryview) -> bytes:
    """blake2b over the key, then the value (no copy of the value to join them)."""
    digest = hashlib.blake2b(key, digest_size=16)
    digest.update(value)
    return digest.digest()


def header(key: bytes, value: bytes) -> bytes:
    """The header that goes before ``value``: a writer may send the two apart."""
    return HEADER.pack(MAGIC, VERSION, 0, len(value), checksum(key, value))


def frame(key: bytes, value: bytes) -> bytes:
    """``value`` as stored under ``key``: its header, then the value."""
    return header(key, value) + value


def unframe(key: bytes, data: bytes) -> bytes | None:
    """The value in ``data`` if it is a whole entry of this format for ``key``;
    None if it is truncated, corrupt, of another version, or another key's."""
    if len(data) < HEADER.size:
        return None
    magic, version, _, length, digest = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or length != len(data) - HEADER.size:
        return None
    value = memoryview(data)[HEADER.size :]
    if checksum(key, value) != digest:
        return None
    return bytes(value)
