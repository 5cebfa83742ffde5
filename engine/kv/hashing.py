"""How the prefix cache names a full block: a chain of SHA-256 digests.

Standard library only: the router hashes prompts the same way, and loads no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as TokenList


def chain_root(model: str, kv_format: str, block_size: int) -> bytes:
    """The digest every chain starts from. Blocks are interchangeable only
    between caches of one model, one KV format and one block size: a store
    shared by two of them must never hand one the other's blocks."""
    return hashlib.sha256(f"{model}\0{kv_format}\0{block_size}".encode()).digest()


def chain_hash(parent: bytes, token_ids: TokenList[int]) -> bytes:
    """A full block's identity: its tokens *and* everything before them.

    Hashing the parent's hash in means two blocks with the same tokens but
    different prefixes get different hashes, so a hit on block i implies that
    blocks 0..i-1 matched too. The first block's parent is the chain's root.
    """
    h = hashlib.sha256(parent)
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()
