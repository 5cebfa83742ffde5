"""Block bookkeeping across a cache's KV-cache groups (config/cache_groups.py).

BlockManager keeps a request's token group, group 0. A cache with span groups
(DeepSeek-V4's compressed rows, kv/compressed_cache.py) has this coordinator,
which keeps one more table per span group in Sequence.block_tables, all drawn
from the one free list, and:

- allocate, can_admit, free and free_tail count and move every table's blocks;
- the prefix cache names token blocks as BlockManager does, and a span block by
  the name of the last token block of its span, and its group: its contents
  depend on the tokens up to there. A span block is published once its span is
  computed, so a hit covers whole spans of every group (match_prefix), taking
  their span blocks and only the token blocks the hit's last window reads: the
  others may have been evicted long ago, as the request's own window gave them
  back, and come back as HOLEs;
- a model with span groups computes every token the same whatever its window
  gave back (V4's attention never reads past its own window), so blocks
  computed after the first give-back are published too (window_changes_keys).
"""

from __future__ import annotations

from typing import NamedTuple

from engine.config.cache_groups import KVCacheGroups
from engine.kv.block_manager import BlockManager
from engine.kv.hashing import chain_hash
from engine.scheduler_output import HOLE
from engine.sequence import Sequence
from engine.utils import cdiv


class _Match(NamedTuple):
    """What match_prefix found, for can_admit and take_cached to use as it is."""

    hits: list[int]  # token blocks, HOLE where the window needs none
    spans: list[list[int]]  # per span group, the blocks of the hit's spans
    names: list[bytes]  # every hit token block's name, held or not


class KVCacheCoordinator(BlockManager):
    window_changes_keys = False

    def __init__(
        self,
        num_blocks: int,
        groups: KVCacheGroups,
        enable_prefix_caching: bool,
        root: bytes | None,
    ) -> None:
        super().__init__(num_blocks, groups.block_size, enable_prefix_caching, root)
        self.spans = [group.span for group in groups.spans]  # span group g + 1's tokens a block
        self.per_span = [span // groups.block_size for span in self.spans]  # its token blocks
        self.unit = groups.hit_unit() // groups.block_size  # token blocks a hit is a multiple of
        self.window = groups.window  # the last tokens a request reads raw
        self._last = self._no_match()  # match_prefix's answer

    def _no_match(self) -> _Match:
        return _Match([], [[] for _ in self.spans], [])

    def group_blocks_needed(self, group: int, num_tokens: int) -> int:
        """Blocks of group ``group`` that ``num_tokens`` tokens fill: token blocks for
        group 0, span blocks for span group 1, 2, ..."""
        if group == 0:
            return self.blocks_needed(num_tokens)
        return cdiv(num_tokens, self.spans[group - 1])

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's span groups' tables, made on first use."""
        while len(seq.block_tables) <= len(self.spans):
            seq.block_tables.append([])
        return seq.block_tables[1:]

    @staticmethod
    def span_name(last_block_hash: bytes, group: int) -> bytes:
        """A span block's name, from the name of its span's last token block and
        its group (-group is never a token id, so no token block has it)."""
        return chain_hash(last_block_hash, (-group,))

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of whole spans of every group that can resume from the
        cache: every one of its span blocks cached, and the token blocks its last
        window reads (the chain names all of them from the tokens alone). Earlier
        token blocks are not needed, and come back as HOLEs, as the window would
        have left them: a long prompt still hits after they were evicted. Never
        the last token (the model must run on one)."""
        self._last = self._no_match()
        if not self.enable_prefix_caching:
            return self._last.hits
        names: list[bytes] = []
        spans = self._no_match().spans
        for _ in range((len(token_ids) - 1) // self.block_size // self.unit):
            names += self._chain(token_ids, names, self.unit)  # one more unit, while spans hit
            if not self._span_hits(names, spans):
                break
        for units in range(len(names) // self.unit, 0, -1):  # the longest whose window is cached
            end = units * self.unit
            window = self._window_hits(token_ids, names, end)
            if window is not None:
                taken = [blocks[: end // per] for blocks, per in zip(spans, self.per_span)]
                self._last = _Match(window, taken, names[:end])
                break
        return self._last.hits

    def _span_hits(self, names: list[bytes], spans: list[list[int]]) -> bool:
        """Extend each group's cached span blocks to the blocks ``names`` covers;
        False (and ``names`` cut back to the last whole unit) if one is missing."""
        for group, (blocks, per) in enumerate(zip(spans, self.per_span), 1):
            for span in range(len(blocks), len(names) // per):
                block_id = self.cached_blocks.get(
                    self.span_name(names[(span + 1) * per - 1], group)
                )
                if block_id is None:
                    del names[len(names) - self.unit :]
                    return False
                blocks.append(block_id)
        return True

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
        first = max(0, end * bs - self.window) // bs if self.window else 0
        hits = [HOLE] * first
        for i in range(first, end):
            block_id = self.cached_blocks.get(names[i])
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                return None  # a miss, or a hash collision caught by comparing tokens
            hits.append(block_id)
        return hits

    def _spans_of(self, hits: list[int]) -> list[list[int]]:
        """The span blocks that came with ``hits``, which match_prefix returned."""
        assert hits is self._last.hits or not hits, "hits come from match_prefix"
        return self._last.spans if hits else self._no_match().spans

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        spans = self._spans_of(hits)
        held = [b for b in hits if b != HOLE] + [b for blocks in spans for b in blocks]
        idle = sum(1 for b in held if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(num_tokens) - len(hits)
        for group, blocks in enumerate(spans, 1):
            fresh += self.group_blocks_needed(group, num_tokens) - len(blocks)
        return fresh <= self.num_free_blocks - idle

    def take_cached(self, seq: Sequence, hits: list[int]) -> None:
        """Share the hit's token blocks (HOLE where the window needs none) and span
        blocks; every hit block is named in the sequence's chain, held or not."""
        seq.block_hashes += self._last.names if hits else []
        for block_id in hits:
            if block_id != HOLE:
                self._hold(block_id)
            seq.block_table.append(block_id)
        for table, blocks in zip(self._tables(seq), self._spans_of(hits)):
            for block_id in blocks:
                self._hold(block_id)
                table.append(block_id)
        seq.num_computed_tokens = len(hits) * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow every table to hold ``num_tokens`` tokens; all or nothing."""
        tables = [seq.block_table, *self._tables(seq)]
        need = [self.group_blocks_needed(g, num_tokens) - len(t) for g, t in enumerate(tables)]
        if sum(need) > self.num_free_blocks:
            return False
        for table, n in zip(tables, need):
            table += [self._reclaim() for _ in range(n)]
        return True

    def free(self, seq: Sequence) -> None:
        for table in reversed(self._tables(seq)):
            for block_id in reversed(table):
                self._release(block_id)
        del seq.block_tables[1:]
        super().free(seq)

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Give back every table's blocks past the first ``num_tokens`` tokens (the
        scheduler's rollback of rejected drafts)."""
        super().free_tail(seq, num_tokens)
        for group, table in enumerate(self._tables(seq), 1):
            keep = self.group_blocks_needed(group, num_tokens)
            for block_id in table[keep:]:
                self._release(block_id)  # never published: its span is not computed
            del table[keep:]

    def cache_full_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Publish the full token blocks (BlockManager), then the span block of every
        span whose last token block that published."""
        published = len(seq.block_hashes)
        super().cache_full_blocks(seq, num_computed)
        for group, (table, per) in enumerate(zip(self._tables(seq), self.per_span), 1):
            for span in range(published // per, len(seq.block_hashes) // per):
                name = self.span_name(seq.block_hashes[(span + 1) * per - 1], group)
                block = self.blocks[table[span]]
                if name not in self.cached_blocks:  # first writer wins; twins stay private
                    self.cached_blocks[name] = block.block_id
                    block.hash = name
