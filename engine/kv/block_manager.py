"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, reference
counts, and a prefix cache that lets requests share blocks they both computed.

The cache tensors themselves live in the model runner. This module only decides
which physical block holds which logical block of which sequence.

With a sliding window (EngineConfig.kv_window), a running sequence also gives
back blocks from the middle of its table (free_outside_window), which leaves a
HOLE there; the blocks around it stay where they were.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from engine.kv.hashing import chain_hash, chain_root
from engine.scheduler_output import HOLE
from engine.sequence import Sequence
from engine.utils import cdiv


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0  # sequences whose block table holds this block
        self.hash: bytes | None = None  # set once the block is full and computed
        self.token_ids: tuple[int, ...] = ()  # kept to verify a hash hit


class BlockManager:
    # Whether a token computed after a window first gave a block back gets other
    # keys and values than it would have (a generic window: its attention saw
    # less). Then the prefix cache must not get them (cache_full_blocks).
    window_changes_keys: ClassVar[bool] = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        root: bytes | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Where every hash chain starts: the cache's model, KV format and block size.
        self.root = root if root is not None else chain_root("", "", block_size)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks no sequence holds, in the order they will be reused: blocks with
        # nothing worth keeping first, then cached blocks, least recently freed
        # first. A freed block that is still cached keeps its hash until reused.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """The cached blocks that hold a prefix of ``token_ids``, in order.

        The last token is never matched: the model must still run on at least
        one token to produce the logits for the next one.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = self.root
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, chunk)
            block_id = self.cached_blocks.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break  # a miss, or a hash collision caught by comparing tokens
            hits.append(block_id)
        return hits

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        """Would taking these cached blocks plus fresh ones cover ``num_tokens``?"""
        idle_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(num_tokens) - len(hits)
        return fresh <= self.num_free_blocks - idle_hits

    def take_cached(self, seq: Sequence, hits: list[int]) -> None:
        """Share the prefix blocks a match found; their tokens need no compute."""
        for block_id in hits:
            self._hold(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(self.blocks[block_id].hash)
        seq.num_computed_tokens = len(hits) * self.block_size

    def _hold(self, block_id: int) -> None:
        """One holder more; a block no sequence held leaves the free list."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]  # no longer free to reclaim
        block.ref_count += 1

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold ``num_tokens`` slots; all or nothing."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._reclaim())
        return True

    def _reclaim(self) -> int:
        """Pop the block at the front of the free list (an unhashed one if any, else
        the cached block freed longest ago); if it was cached, forget it."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached_blocks[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks. A block returns to the free list
        only when no other sequence holds it; a cached block keeps its contents
        there, so a later request with the same prefix can still hit it."""
        for block_id in reversed(seq.block_table):  # tail first: prefixes are reused
            if block_id != HOLE:  # a window's hole was given back already
                self._release(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        seq.num_unwindowed_tokens = None

    def _release(self, block_id: int) -> None:
        """One holder fewer. With none left the block is free: at the back of the
        free list if it is cached, at the front if it holds nothing worth keeping."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed more often than held"
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.hash is None:  # nothing worth keeping: reuse it first
                self.free_blocks.move_to_end(block_id, last=False)

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the sequence's blocks past its first ``num_tokens`` slots: the
        blocks that held only rejected drafts (the scheduler's rollback). They
        were never offered to the prefix cache, so they are reused first."""
        keep = self.blocks_needed(num_tokens)
        assert keep >= len(seq.block_hashes), "a published block cannot be rolled back"
        for block_id in seq.block_table[keep:]:
            self._release(block_id)  # unhashed, never published: to the front
        del seq.block_table[keep:]

    def cache_full_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Publish every block that is now full of computed tokens: the first
        ``num_computed`` of them, or all that ``seq`` counts as computed. Under a
        window, only those computed before it first gave a block back, and none
        from a hole on: the chain stops there."""
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        if seq.num_unwindowed_tokens is not None and self.window_changes_keys:
            num_computed = min(num_computed, seq.num_unwindowed_tokens)
        full = num_computed // self.block_size
        for i in range(len(seq.block_hashes), full):
            if seq.block_table[i] == HOLE:
                break  # given back before it was published: it never will be
            chunk = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = seq.block_hashes[-1] if seq.block_hashes else self.root
            h = chain_hash(parent, chunk)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached_blocks:  # first writer wins; twins stay private
                self.cached_blocks[h] = block.block_id
                block.hash, block.token_ids = h, chunk

    def free_outside_window(self, seq: Sequence, sinks: int, window: int) -> int:
        """A sliding window with attention sinks: give back every block of ``seq``
        that lies wholly after its first ``sinks`` tokens and wholly before the
        last ``window`` of its computed ones; returns how many. Each leaves a HOLE,
        so that position p still maps to entry p // block_size. The blocks given
        back form one run after the sinks' blocks, which only grows: walk it back
        from its new end to the first hole. The first time, the tokens computed so
        far are the last whose blocks the prefix cache may get (cache_full_blocks):
        those computed from now on attend to a windowed context."""
        bs, table = self.block_size, seq.block_table
        first = cdiv(sinks, bs)  # the blocks that hold a sink
        end = min((seq.num_computed_tokens - window) // bs, len(table))
        dropped = 0
        for i in range(end - 1, first - 1, -1):
            if table[i] == HOLE:
                break  # the run given back before
            self._release(table[i])
            table[i] = HOLE
            dropped += 1
        if dropped and seq.num_unwindowed_tokens is None:
            seq.num_unwindowed_tokens = seq.num_computed_tokens
        return dropped
