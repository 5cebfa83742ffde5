"""Block bookkeeping for a cache with two tables per request (DeepSeek-V4).

DeepSeek-V4's cache (engine/kv/compressed_cache.py) holds a request's raw
per-token state in token blocks, one per ``block_size`` tokens, which its window
gives back as the request runs; and its compressed rows in row blocks, one per
``row_span`` tokens, which it keeps. Both come from one free list. So, beside
BlockManager's token table, each request has a ``row_table``, and:

- allocate, can_admit, free and free_tail count and move both tables' blocks;
- the prefix cache names token blocks as BlockManager does, and a row block by
  the name of the last token block of its span: its rows depend on the tokens up
  to there. A row block is published once its span is computed, so a hit covers
  whole spans (match_prefix), taking their row blocks and only the token blocks
  the hit's last window reads: the others may have been evicted long ago, as
  the request's own window gave them back, and come back as HOLEs;
- V4 computes every token the same whatever its window gave back (its attention
  never reads past its own window), so blocks computed after the first give-back
  are published too (window_changes_keys).
"""

from __future__ import annotations

from typing import NamedTuple

from engine.kv.block_manager import BlockManager
from engine.kv.hashing import chain_hash
from engine.scheduler_output import HOLE
from engine.sequence import Sequence
from engine.utils import cdiv


class _Match(NamedTuple):
    """What match_prefix found, for can_admit and take_cached to use as it is."""

    hits: list[int]  # token blocks, HOLE where the window needs none
    rows: list[int]  # the row blocks of the hit's spans
    names: list[bytes]  # every hit token block's name, held or not


class GroupedBlockManager(BlockManager):
    window_changes_keys = False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        root: bytes,
        row_span: int,
        window: int,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, root)
        assert row_span % block_size == 0, "a row span ends where a token block ends"
        self.row_span = row_span
        self.blocks_per_span = row_span // block_size
        self.window = window  # the last tokens a request reads raw (V4Config.window_tokens)
        self._last = _Match([], [], [])  # match_prefix's answer

    def row_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.row_span)

    @staticmethod
    def row_name(last_block_hash: bytes) -> bytes:
        """A row block's name, from the name of its span's last token block (-1 is
        never a token id, so no token block has it)."""
        return chain_hash(last_block_hash, (-1,))

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of whole spans that can resume from the cache: every
        one of its row blocks cached, and the token blocks its last window reads
        (V4Config.window_tokens; the chain names all of them from the tokens
        alone). Earlier token blocks are not needed, and come back as HOLEs, as the
        window would have left them: a long prompt still hits after they were
        evicted. Never the last token (the model must run on one)."""
        self._last = _Match([], [], [])
        if not self.enable_prefix_caching:
            return self._last.hits
        per = self.blocks_per_span
        names: list[bytes] = []
        rows: list[int] = []
        for _ in range((len(token_ids) - 1) // self.block_size // per):
            names += self._chain(token_ids, names, per)  # one more span, while rows hit
            row = self.cached_blocks.get(self.row_name(names[-1]))
            if row is None:
                break
            rows.append(row)
        for spans in range(len(rows), 0, -1):  # the longest whose window is cached
            window = self._window_hits(token_ids, names, spans * per)
            if window is not None:
                self._last = _Match(window, rows[:spans], names[: spans * per])
                break
        return self._last.hits

    def _chain(self, token_ids: list[int], before: list[bytes], num_blocks: int) -> list[bytes]:
        """The names of the ``num_blocks`` token blocks of ``token_ids`` after the
        blocks named ``before``."""
        bs, first = self.block_size, len(before)
        names, parent = [], before[-1] if before else self.root
        for i in range(first, first + num_blocks):
            parent = chain_hash(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            names.append(parent)
        return names

    def _window_hits(self, token_ids: list[int], names: list[bytes], end: int) -> list[int] | None:
        """Token blocks 0..end-1: HOLE for those wholly before the window that ends
        at block ``end``, the cached block for the others; None if one is missing."""
        bs = self.block_size
        first = max(0, end * bs - self.window) // bs
        hits = [HOLE] * first
        for i in range(first, end):
            block_id = self.cached_blocks.get(names[i])
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                return None  # a miss, or a hash collision caught by comparing tokens
            hits.append(block_id)
        return hits

    def _rows_of(self, hits: list[int]) -> list[int]:
        """The row blocks that came with ``hits``, which match_prefix returned."""
        assert hits is self._last.hits or not hits, "hits come from match_prefix"
        return self._last.rows if hits else []

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        held = [b for b in hits if b != HOLE] + self._rows_of(hits)
        idle = sum(1 for b in held if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(num_tokens) - len(hits)
        fresh += self.row_blocks_needed(num_tokens) - len(self._rows_of(hits))
        return fresh <= self.num_free_blocks - idle

    def take_cached(self, seq: Sequence, hits: list[int]) -> None:
        """Share the hit's token blocks (HOLE where the window needs none) and row
        blocks; every hit block is named in the sequence's chain, held or not."""
        rows = self._rows_of(hits)
        seq.block_hashes += self._last.names if hits else []
        for block_id in hits:
            if block_id != HOLE:
                self._hold(block_id)
            seq.block_table.append(block_id)
        for block_id in rows:
            self._hold(block_id)
            seq.row_table.append(block_id)
        seq.num_computed_tokens = len(hits) * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow both tables to hold ``num_tokens`` tokens; all or nothing."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        need_rows = self.row_blocks_needed(num_tokens) - len(seq.row_table)
        if need + need_rows > self.num_free_blocks:
            return False
        seq.block_table += [self._reclaim() for _ in range(need)]
        seq.row_table += [self._reclaim() for _ in range(need_rows)]
        return True

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.row_table):
            self._release(block_id)
        seq.row_table.clear()
        super().free(seq)

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Give back both tables' blocks past the first ``num_tokens`` tokens (the
        scheduler's rollback of rejected drafts)."""
        super().free_tail(seq, num_tokens)
        keep = self.row_blocks_needed(num_tokens)
        for block_id in seq.row_table[keep:]:
            self._release(block_id)  # never published: its span is not computed
        del seq.row_table[keep:]

    def cache_full_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Publish the full token blocks (BlockManager), then the row block of every
        span whose last token block that published."""
        published = len(seq.block_hashes)
        super().cache_full_blocks(seq, num_computed)
        per = self.blocks_per_span
        for span in range(published // per, len(seq.block_hashes) // per):
            name = self.row_name(seq.block_hashes[(span + 1) * per - 1])
            block = self.blocks[seq.row_table[span]]
            if name not in self.cached_blocks:  # first writer wins; twins stay private
                self.cached_blocks[name] = block.block_id
                block.hash = name
