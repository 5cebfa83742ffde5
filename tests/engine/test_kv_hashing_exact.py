"""The prefix cache's block names pinned to their bytes (engine/kv/hashing.py).
A store on disk, the router and every engine sharing a store must name a block
alike, so the exact bytes hashed are the contract: the root is SHA-256 of
model, KV format and block size joined by NUL bytes; a block's hash is SHA-256
of its parent's digest followed by its token ids in decimal, joined by commas."""

from __future__ import annotations

import hashlib

from engine.kv.hashing import chain_hash, chain_root


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_the_root_hashes_model_format_and_block_size_joined_by_nul() -> None:
    assert chain_root("tiny", "auto", 16) == sha(b"tiny\x00auto\x0016")
    assert chain_root("m/n", "fp8_e4m3", 1) == sha(b"m/n\x00fp8_e4m3\x001")
    assert chain_root("", "", 0) == sha(b"\x00\x000")
    assert len(chain_root("tiny", "auto", 16)) == 32


def test_each_part_of_the_root_separates_caches() -> None:
    roots = {
        chain_root("tiny", "auto", 16),
        chain_root("tiny2", "auto", 16),
        chain_root("tiny", "int8", 16),
        chain_root("tiny", "auto", 32),
        chain_root("tiny\x00auto", "", 16),  # the separator is a real byte, not a join artefact
    }
    assert len(roots) == 5


def test_a_block_hashes_its_parent_then_its_tokens_in_decimal_joined_by_commas() -> None:
    parent = chain_root("tiny", "auto", 4)
    assert chain_hash(parent, [1, 22, 333, 0]) == sha(parent + b"1,22,333,0")
    assert chain_hash(parent, (7,)) == sha(parent + b"7")
    assert chain_hash(parent, []) == sha(parent)
    assert chain_hash(b"", [5, 6]) == sha(b"5,6")
    child = chain_hash(parent, [1, 2])
    assert chain_hash(child, [3, 4]) == sha(sha(parent + b"1,2") + b"3,4")


def test_a_block_s_hash_depends_on_its_prefix_and_on_where_its_tokens_split() -> None:
    a, b = chain_root("tiny", "auto", 2), chain_root("tiny", "auto", 3)
    assert chain_hash(a, [1, 2]) != chain_hash(b, [1, 2])
    assert chain_hash(a, [12, 3]) != chain_hash(a, [1, 23])
    assert chain_hash(a, [1, 2]) == chain_hash(a, (1, 2))
