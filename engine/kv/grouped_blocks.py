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
  whole spans (match_prefix), taking the row blocks with the token blocks;
- V4 computes every token the same whatever its window gave back (its attention
  never reads past its own window), so blocks computed after the first give-back
  are published too (window_changes_keys).
"""

from __future__ import annotations

from engine.kv.block_manager import BlockManager
from engine.kv.hashing import chain_hash
from engine.sequence import Sequence
from engine.utils import cdiv


class GroupedBlockManager(BlockManager):
    window_changes_keys = False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        root: bytes,
        row_span: int,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, root)
        assert row_span % block_size == 0, "a row span ends where a token block ends"
        self.row_span = row_span
        self.blocks_per_span = row_span // block_size

    def row_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.row_span)

    @staticmethod
    def row_name(last_block_hash: bytes) -> bytes:
        """A row block's name, from the name of its span's last token block (-1 is
        never a token id, so no token block has it)."""
        return chain_hash(last_block_hash, (-1,))

    def _row_hits(self, hits: list[int]) -> list[int]:
        """The cached row blocks of the whole spans among token blocks ``hits``."""
        rows = []
        for end in range(self.blocks_per_span, len(hits) + 1, self.blocks_per_span):
            block_hash = self.blocks[hits[end - 1]].hash
            row = None if block_hash is None else self.cached_blocks.get(self.row_name(block_hash))
            if row is None:
                break
            rows.append(row)
        return rows

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """The token blocks of the longest cached prefix of whole spans whose row
        blocks are cached too (the row blocks come with them: take_cached)."""
        hits = super().match_prefix(token_ids)
        return hits[: len(self._row_hits(hits)) * self.blocks_per_span]

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        rows = self._row_hits(hits)
        idle = sum(1 for b in hits + rows if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(num_tokens) - len(hits)
        fresh += self.row_blocks_needed(num_tokens) - len(rows)
        return fresh <= self.num_free_blocks - idle

    def take_cached(self, seq: Sequence, hits: list[int]) -> None:
        rows = self._row_hits(hits)
        super().take_cached(seq, hits)
        for block_id in rows:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.row_table.append(block_id)

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
