"""One KV block as bytes, for a store (Chapter 8): the block's token ids, then
every layer's cache tensors at that block, in the pool's order.

The tokens travel with the numbers so that whoever loads a block can check it
holds the tokens it was looked up for, not only that its bytes arrived whole
(the store's checksum covers that). The tensors' shapes and dtypes are not
written: only an engine whose pool has the same layout may read the block, and
the hash chain's root (model, KV format, block size) already says which do.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import torch

from engine.kv.kv_cache import KVBlocks

# One block's layout in a pool: per layer, per tensor, (shape of one block, dtype).
BlockLayout = list[list[tuple[tuple[int, ...], torch.dtype]]]


def layout_of(blocks: KVBlocks) -> BlockLayout:
    """The layout of the blocks ``blocks`` holds (read from any pool)."""
    return [[(tuple(t.shape[1:]), t.dtype) for t in ts] for ts in blocks.layers]


def encode_block(token_ids: Sequence[int], blocks: KVBlocks, index: int) -> bytes:
    """Block ``index`` of ``blocks``, with the tokens it holds."""
    parts = [struct.pack("<I", len(token_ids)), array("q", token_ids).tobytes()]
    for tensors in blocks.layers:
        for t in tensors:
            parts.append(t[index].contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def decode_block(payload: bytes, layout: BlockLayout) -> tuple[list[int], KVBlocks] | None:
    """The tokens and the one-block KVBlocks ``payload`` holds; None if its size
    does not fit ``layout`` (written by a pool of another shape)."""
    if len(payload) < 4:
        return None
    (n,) = struct.unpack_from("<I", payload)
    sizes = [_nbytes(shape, dtype) for tensors in layout for shape, dtype in tensors]
    if len(payload) != 4 + 8 * n + sum(sizes):
        return None
    token_ids = array("q", payload[4 : 4 + 8 * n]).tolist()
    raw = torch.frombuffer(bytearray(payload[4 + 8 * n :]), dtype=torch.uint8)
    layers, offset = [], 0
    for tensors in layout:
        layer = []
        for shape, dtype in tensors:
            size = _nbytes(shape, dtype)
            layer.append(raw[offset : offset + size].view(dtype).reshape(1, *shape))
            offset += size
        layers.append(layer)
    return token_ids, KVBlocks(layers)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def concat(blocks: list[KVBlocks]) -> KVBlocks:
    """Several KVBlocks of one layout as one, in order."""
    layers = [
        [torch.cat([b.layers[i][j] for b in blocks]) for j in range(len(ts))]
        for i, ts in enumerate(blocks[0].layers)
    ]
    return KVBlocks(layers)
